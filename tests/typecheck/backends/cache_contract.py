"""A contract of a serving stack's own: its Protocol, witness class, mixin and a conforming host."""

from __future__ import annotations

from typing import ClassVar, Protocol, TypeVar

from staging_contracts import Contract, ContractMixin, HostCheck


class CacheHost(Protocol):
    """What the cache mixin needs of its host: read-only members, so narrower types fit."""

    @property
    def cache_dir(self) -> str: ...

    def evict(self, key: str) -> bool: ...


_Host = TypeVar("_Host", bound=CacheHost)


class CacheHostCheck(HostCheck[_Host]):
    """The witness of the CacheHost contract."""


class CacheMixin(ContractMixin, contract=Contract(CacheHost)):
    """Enforces CacheHost."""

    def cache_path(self: CacheHost, key: str) -> str:
        """Where ``key`` is cached."""
        return f"{self.cache_dir}/{key}"


class Store(CacheMixin):
    """A conforming host."""

    __contract: ClassVar[CacheHostCheck[Store]]
    cache_dir: str = "/tmp"

    def evict(self, key: str) -> bool:
        """Drop ``key``."""
        return bool(key)
