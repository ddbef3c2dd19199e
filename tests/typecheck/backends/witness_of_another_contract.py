"""The witness of another contract: the staging witness on a host of the cache contract."""

from __future__ import annotations

from typing import ClassVar

from cache_contract import CacheMixin

from staging_contracts import StagingHostCheck


class Mistaken(CacheMixin):  # expect: runtime
    __contract: ClassVar[StagingHostCheck[Mistaken]]  # expect: all
    cache_dir: str = "/tmp"

    def evict(self, key: str) -> bool:
        return bool(key)
