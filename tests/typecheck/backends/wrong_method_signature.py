"""A method whose signature cannot take the Protocol's calls (a contract of a stack's own)."""

from __future__ import annotations

from typing import ClassVar

from cache_contract import CacheHostCheck, CacheMixin


class NoKeyStore(CacheMixin):  # expect: plugin runtime
    __contract: ClassVar[CacheHostCheck[NoKeyStore]]  # expect: all
    cache_dir: str = "/tmp"

    def evict(self) -> bool:
        return False
