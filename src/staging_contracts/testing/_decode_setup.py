"""What the contract kit asks of a live decode manager, and the small decode rank it suggests.

A backend author's factory receives a :class:`DecodeSetup` (KV arguments, KV pool and ring
sizes chosen so that every behaviour check can be made) and returns a started decode manager
with staging enabled, i.e. something that satisfies :class:`LiveDecodeManager`::

    def make_decode_manager(self, setup: DecodeSetup) -> MyKVManager:
        manager = MyKVManager(setup.kv_args, role=Role.DECODE, attn_tp_size=setup.attn_tp_size)
        return setup.start(manager)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar

import torch

from .._run.workload import TransferConfig, require_positive
from .._staging.layout import heads_per_rank as layout_heads_per_rank
from ..backends._staging_setup import StagingBackend, enable_decode_staging
from ..protocols import (
    ArrivalOutcome,
    DecodeStagingContext,
    KVArgs,
    KVArgsRecord,
    KVBufferTensors,
    PrefillStagingContext,
    StagingHandler,
    StagingReqOutcome,
)

if TYPE_CHECKING:
    from .._decode.handler import DecodeStagingHandler
    from ..stats import StagingStats


class LiveDecodeManager(Protocol):
    """A started decode manager with staging enabled, as the kit drives it.

    What the kit uses: the :class:`~staging_contracts.StagingHost` members, the mixin's entry
    points (``attach_staging_handler``, ``detach_staging_handler``, ``_handle_staging_req``,
    ``_handle_chunk_ready``, ``staging_stats``), the control listener's ``endpoint`` (the kit
    sends ``STAGING_REQ`` there, as a prefill rank would) and ``close``. Every backend built on
    ``CommonKVManager`` and ``StagingManagerMixin`` has them.

    The kit also expects ``_staging_handler`` to be a
    :class:`~staging_contracts._decode.handler.DecodeStagingHandler` (it registers its own rooms
    on it),
    ``_staging_ctx`` to be a :class:`~staging_contracts.DecodeStagingContext`, and
    ``kv_buffer_tensors`` to hold the KV pool; ``enable_decode_staging`` (and so
    :meth:`DecodeSetup.start`) sets all three.
    """

    @property
    def kv_args(self) -> KVArgs:
        """This rank's KV arguments."""
        ...

    @property
    def attn_tp_size(self) -> int:
        """Attention TP size of the decode side."""
        ...

    @property
    def _staging_handler(self) -> StagingHandler | None: ...

    @property
    def _staging_ctx(self) -> DecodeStagingContext | PrefillStagingContext | None: ...

    @property
    def endpoint(self) -> str:
        """The control listener's ``tcp://host:port``."""
        ...

    def attach_staging_handler(self, handler: StagingHandler) -> None:
        """Attach the decode staging handler (checked against ``StagingHandler``)."""
        ...

    def detach_staging_handler(self) -> None:
        """Detach the handler; later staging messages are dropped and counted."""
        ...

    def _handle_staging_req(self, frames: Sequence[bytes]) -> StagingReqOutcome | None: ...

    def _handle_chunk_ready(self, frames: Sequence[bytes]) -> ArrivalOutcome | None: ...

    def staging_stats(self) -> StagingStats:
        """What the staging message handling counted."""
        ...

    def close(self) -> None:
        """Stop the listener and release sockets and engine; safe to call twice."""
        ...


class StartableBackend(StagingBackend, Protocol):
    """A staging backend that :meth:`DecodeSetup.start` can enable, start and close."""

    def start(self) -> None:
        """Start the control listener."""
        ...

    def close(self) -> None:
        """Stop the listener and release sockets and engine."""
        ...


_B = TypeVar("_B", bound=StartableBackend)


@dataclass(frozen=True, slots=True)
class DecodeSetup:
    """A small decode rank on CPU: KV arguments, a KV pool and a staging ring.

    The defaults are what the kit's behaviour checks need: decode TP 1 with two KV heads (so
    a prefill side of TP 2 has two writers per chunk), and a ring that holds half of the KV
    pool (so a chunk of the whole pool can never fit it). A factory may ignore the setup, as
    long as the manager it returns satisfies :class:`LiveDecodeManager`; the kit reads every
    size from the live manager, not from here.

    Raises:
        ValueError: a size is not positive, or the heads do not split over ``attn_tp_size``.
    """

    total_kv_heads: int = 2
    """KV heads of the whole model."""
    num_layers: int = 2
    """Layers in the KV pool."""
    head_dim: int = 8
    """Elements per head and token."""
    page_size: int = 4
    """Tokens per KV page."""
    pool_pages: int = 16
    """Pages in the KV pool."""
    ring_bytes: int = 4096
    """Size of the staging ring (a chunk of 8 pages fills it, one of 16 never fits)."""
    dtype: torch.dtype = torch.float16
    """Element type of the KV pool."""
    attn_tp_size: int = 1
    """Attention TP size of the decode side."""
    engine_rank: int = 0
    """This decode rank."""

    def __post_init__(self) -> None:
        require_positive(self, "DecodeSetup.", but=("engine_rank",))
        if not 0 <= self.engine_rank < self.attn_tp_size:
            raise ValueError(
                f"DecodeSetup.engine_rank={self.engine_rank} must be in [0, {self.attn_tp_size})"
            )
        big, small = sorted((self.total_kv_heads, self.attn_tp_size), reverse=True)
        if big % small:
            raise ValueError(
                f"total_kv_heads={self.total_kv_heads} and attn_tp_size={self.attn_tp_size} "
                "must divide one another"
            )

    @property
    def heads_per_rank(self) -> int:
        """KV heads this rank holds (1 under GQA replication)."""
        return layout_heads_per_rank(self.total_kv_heads, self.attn_tp_size)

    @property
    def kv_args(self) -> KVArgsRecord:
        """KV arguments of this rank (CPU device), matching :meth:`kv_pool`."""
        return self._config.kv_args(self.attn_tp_size, self.engine_rank)

    def kv_pool(self) -> KVBufferTensors:
        """A new zeroed KV pool, owned by the caller: per layer, K and V of ``[pool_tokens,
        heads, head_dim]``."""
        return self._config.empty_pool(self.attn_tp_size, self.engine_rank)

    @property
    def _config(self) -> TransferConfig:
        """This rank's sizes as the one workload states them."""
        return TransferConfig(
            prefill_tp=1,
            decode_tp=self.attn_tp_size,
            kv_heads=self.total_kv_heads,
            layers=self.num_layers,
            head_dim=self.head_dim,
            page_size=self.page_size,
            dtype=self.dtype,
            separate_layers=True,
            pool_size=self.pool_pages,
            ring_size=self.ring_bytes,
        )

    def enable_staging(self, manager: StagingBackend) -> DecodeStagingHandler:
        """Give ``manager`` a new KV pool, this setup's ring, a context and an attached handler.

        Returns:
            The attached handler (``enable_decode_staging``'s result).
        """
        return enable_decode_staging(manager, kv_buffers=self.kv_pool(), ring_bytes=self.ring_bytes)

    def start(self, manager: _B) -> _B:
        """Enable decode staging on ``manager`` and start its listener.

        If either step fails, the manager is closed before the error propagates, so a
        factory that fails leaks no thread or socket.

        Returns:
            ``manager``, started.
        """
        try:
            self.enable_staging(manager)
            manager.start()
        except BaseException:
            manager.close()
            raise
        return manager


DecodeFactory: TypeAlias = Callable[[DecodeSetup], LiveDecodeManager]
"""A function that builds a live decode manager from a :class:`DecodeSetup`."""
