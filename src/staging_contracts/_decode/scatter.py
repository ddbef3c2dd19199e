"""Decode: moving a complete chunk region of the ring into the paged KV pool.

:class:`ChunkScatter` knows the decode rank's pool and layout; it sizes regions for a prefill
TP size and scatters a region whose writers have all arrived, returning the token of its
:class:`~staging_contracts._staging.ordering.DeviceOrdering` that the caller polls before freeing
the region: ``None`` on CPU (already complete), an event on CUDA (on the dedicated stream, or
the current one when none is given).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._staging.allocator import StagingAllocator
from .._staging.kernels import PagedKVPools, PoolGeometry
from .._staging.layout import (
    WriterPlacement,
    compute_staging_layout,
    heads_per_rank,
    writer_index,
    writer_placements,
)
from .._staging.ordering import DeviceOrdering, ordering_for
from ..protocols import Allocation, KVBufferTensors

__all__ = ["ChunkScatter"]


class _RegionLayout(NamedTuple):
    """What a decode rank needs of a chunk region's layout."""

    total_bytes: int
    """Bytes of the region."""
    writers: tuple[WriterPlacement, ...]
    """Each writer's byte offset and destination heads."""


class ChunkScatter:
    """Scatters chunk regions of one decode rank's ring into its KV pool.

    **Side:** decode. **Thread-safety:** ``scatter`` of distinct regions may run on several
    threads; the caller keeps two scatters into the same pages apart (one room's chunks have
    disjoint pages).

    Args:
        allocator: the decode rank's staging ring.
        kv_buffers: the decode rank's paged KV pool.
        decode_tp: attention TP size of decode.
        decode_rank: this rank's attention-TP rank.
        total_kv_heads: KV heads of the whole model.
        stream: CUDA only: the dedicated stream scatters run on.
        ordering: when a scatter has completed (default: the device's real one, see
            :func:`~staging_contracts._staging.ordering.ordering_for`; tests pass an
            instrumented one).

    Raises:
        ValueError: the pool does not hold ``total_kv_heads // decode_tp`` heads per token.
    """

    def __init__(
        self,
        allocator: StagingAllocator,
        kv_buffers: KVBufferTensors,
        *,
        decode_tp: int,
        decode_rank: int,
        total_kv_heads: int,
        stream: torch.cuda.Stream | None = None,
        ordering: DeviceOrdering | None = None,
    ) -> None:
        self._pools = PagedKVPools(kv_buffers.k_buffers, kv_buffers.v_buffers, kv_buffers.page_size)
        self.geometry: PoolGeometry = self._pools.geometry
        expected_heads = heads_per_rank(total_kv_heads, decode_tp)
        if self.geometry.num_heads != expected_heads:
            raise ValueError(
                f"decode KV pool has {self.geometry.num_heads} heads per token, expected "
                f"{expected_heads} (total_kv_heads={total_kv_heads}, decode_tp={decode_tp})"
            )
        self._allocator = allocator
        self._kv = kv_buffers
        self._decode_tp = decode_tp
        self._decode_rank = decode_rank
        self._total_heads = total_kv_heads
        self._stream = stream
        self.ordering: DeviceOrdering = ordering or ordering_for(self.geometry.device, stream)
        """When a scatter has completed; the handler polls its tokens before freeing."""
        self._layouts: dict[tuple[int, int], _RegionLayout] = {}

    @property
    def page_size(self) -> int:
        """Tokens per page of the pool."""
        return self._kv.page_size

    def region_bytes(self, prefill_tp: int, num_pages: int) -> int:
        """Bytes of a chunk region of ``num_pages`` pages written by a prefill of TP size
        ``prefill_tp`` (cached per pair)."""
        return self._layout(prefill_tp, num_pages).total_bytes

    def _layout(self, prefill_tp: int, num_pages: int) -> _RegionLayout:
        """The region's size and writer placements, computed once per pair."""
        key = (prefill_tp, num_pages)
        layout = self._layouts.get(key)
        if layout is None:
            args = (
                prefill_tp,
                self._decode_tp,
                self._decode_rank,
                self._total_heads,
                num_pages * self._kv.page_size,
                self.geometry.bytes_per_head_token,
                self.geometry.num_layers,
            )
            layout = _RegionLayout(
                compute_staging_layout(*args).total_bytes, writer_placements(*args)
            )
            self._layouts[key] = layout
        return layout

    def writer_bytes(
        self, allocation: Allocation, prefill_tp: int, num_pages: int, writer_rank: int
    ) -> torch.Tensor:
        """The bytes of one writer (prefill rank ``writer_rank``) in a chunk region: a view of
        the ring (for its integrity check).

        Raises:
            ValueError: ``writer_rank`` is not a rank of a prefill of TP size ``prefill_tp``.
        """
        layout = self._layout(prefill_tp, num_pages)
        index = writer_index(prefill_tp, self._decode_tp, writer_rank)
        start = allocation.offset + layout.writers[index].byte_offset
        end = (
            allocation.offset + layout.writers[index + 1].byte_offset
            if index + 1 < len(layout.writers)
            else allocation.offset + layout.total_bytes
        )
        return self._allocator.buffer[start:end]

    def scatter(
        self, allocation: Allocation, pages: torch.Tensor, prefill_tp: int
    ) -> object | None:
        """Scatter every writer of a region into the pool's ``pages``.

        **Blocking:** on CPU until copied; on CUDA until enqueued.

        Returns:
            The ordering's token to poll (``ordering.done``) before freeing the region:
            ``None`` when already complete (CPU), an event on CUDA.

        Raises:
            ValueError: the region, pages or layout do not match the pool.
        """
        self._pools.scatter(
            self._allocator.buffer[allocation.offset : allocation.end],
            pages,
            self._layout(prefill_tp, int(pages.numel())).writers,
            stream=self._stream,
        )
        return self.ordering.scattered()
