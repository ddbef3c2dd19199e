"""Group ``staging``: the data path's kernels and the ring allocator.

* ``staging.gather`` / ``staging.scatter`` — bandwidth of ``kernels.gather_chunk`` and
  ``kernels.scatter_chunk`` on a chunk of 32 layers x 8 heads x 128 head_dim bf16 (all heads
  of the pool), 4096 tokens, page_size 16, random pages, against a plain
  ``copy_`` of the same number of bytes between preallocated tensors, measured alternately in
  the same run (ratio = ours / copy, goal >= 0.5);
* ``staging.alloc-scaling`` — our ``assign`` + ``free`` at 100,000 live allocations against
  the same at 10 (ratio, goal <= 1.2: flat);
* ``staging.alloc-scaling.anchor`` — the same two figures for a straightforward list-based
  ring allocator (the reference's design), informative.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable

import torch

from ..protocols import Allocation, Watermark
from ..staging.allocator import StagingAllocator
from ..staging.kernels import gather_chunk, scatter_chunk
from ..staging.layout import WriterPlacement
from . import BenchOptions, BenchRow, ratio_row
from .timing import interleaved_ns_per_call

__all__ = ["run"]

_LAYERS = 32
_HEADS = 8
_HEAD_DIM = 128
_TOKENS = 4096
_PAGE_SIZE = 16
_REGION = 64
"""Bytes per region in the allocator benchmark."""


def _bandwidths(quick: bool) -> list[BenchRow]:
    layers = 4 if quick else _LAYERS
    tokens = 1024 if quick else _TOKENS
    chunk_pages = tokens // _PAGE_SIZE
    pool_pages = chunk_pages + chunk_pages // 4
    generator = torch.Generator().manual_seed(0)
    pages = torch.randperm(pool_pages, generator=generator)[:chunk_pages]
    shape = (pool_pages * _PAGE_SIZE, _HEADS, _HEAD_DIM)
    k = [torch.ones(shape, dtype=torch.bfloat16) for _ in range(layers)]
    v = [torch.ones(shape, dtype=torch.bfloat16) for _ in range(layers)]
    nbytes = 2 * layers * tokens * _HEADS * _HEAD_DIM * 2
    staging = torch.ones(nbytes, dtype=torch.uint8)
    source = torch.ones(nbytes, dtype=torch.uint8)
    writers = [WriterPlacement(0, 0, _HEADS)]

    def gather() -> None:
        gather_chunk(k, v, pages, _PAGE_SIZE, 0, _HEADS, staging)

    def scatter() -> None:
        scatter_chunk(staging, k, v, pages, _PAGE_SIZE, writers)

    def copy() -> None:
        staging.copy_(source)

    samples: dict[str, list[float]] = {"gather": [], "scatter": [], "copy": []}
    functions: dict[str, Callable[[], None]] = {"gather": gather, "scatter": scatter, "copy": copy}
    for fn in functions.values():
        fn()
    for index in range(7 if quick else 15):
        order = list(functions.items())
        if index % 2:
            order.reverse()
        for name, fn in order:
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    gbps = {name: nbytes / statistics.median(times) / 1e9 for name, times in samples.items()}
    return [
        ratio_row("staging.gather", gbps["gather"], gbps["copy"], "GB/s", ">= 0.5"),
        ratio_row("staging.scatter", gbps["scatter"], gbps["copy"], "GB/s", ">= 0.5"),
    ]


class _ListRing:
    """The anchor: the reference's design, live allocations in a list in allocation order."""

    def __init__(self, total_size: int) -> None:
        self.total_size = total_size
        self.head = 0
        self.round = 0
        self.next_id = 0
        self.allocs: list[tuple[int, int, int, int]] = []  # (id, offset, size, round)
        self.watermark = Watermark(0, 0)

    def assign(self, size: int) -> Allocation | None:
        if size > self.total_size:
            return None
        if size <= self.total_size - self.head:
            offset = self.head
            self.head += size
        else:
            self.round += 1
            offset = 0
            self.head = size
        alloc_id = self.next_id
        self.next_id += 1
        self.allocs.append((alloc_id, offset, size, self.round))
        return Allocation(alloc_id, offset, self.round, offset + size)

    def free(self, alloc_id: int) -> None:
        for index, entry in enumerate(self.allocs):
            if entry[0] == alloc_id:
                del self.allocs[index]
                break
        else:
            return
        if not self.allocs:
            self.round += 1
            self.head = 0
            self.watermark = Watermark(self.round, 0)
        else:
            _, offset, _, alloc_round = self.allocs[0]
            self.watermark = Watermark(alloc_round, offset)


def _churn(ring: StagingAllocator | _ListRing, live: int) -> Callable[[int], object]:
    """A loop body keeping ``live`` allocations: assign one, free the oldest."""
    ids: collections.deque[int] = collections.deque()
    for _ in range(live):
        allocation = ring.assign(_REGION)
        if allocation is not None:
            ids.append(allocation.alloc_id)
    assign, free, append, popleft = ring.assign, ring.free, ids.append, ids.popleft

    def loop(n: int) -> None:
        for _ in range(n):
            allocation = assign(_REGION)
            if allocation is not None:
                append(allocation.alloc_id)
            free(popleft())

    return loop


def _alloc_scaling(quick: bool) -> list[BenchRow]:
    small, large = 10, 100_000
    total = 1 << 20
    ours_large, ours_small = interleaved_ns_per_call(
        _churn(StagingAllocator(total), large),
        _churn(StagingAllocator(total), small),
        loops=20_000 if quick else 200_000,
        repeats=3 if quick else 11,
    )
    list_large, list_small = interleaved_ns_per_call(
        _churn(_ListRing(total), large),
        _churn(_ListRing(total), small),
        loops=200 if quick else 2_000,
        repeats=3 if quick else 7,
    )
    return [
        ratio_row(
            "staging.alloc-scaling",
            ours_large,
            ours_small,
            "ns/assign+free (@100k, @10 live)",
            "<= 1.2",
        ),
        ratio_row(
            "staging.alloc-scaling.anchor",
            list_large,
            list_small,
            "ns/assign+free (@100k, @10 live)",
        ),
    ]


def run(options: BenchOptions) -> list[BenchRow]:
    """Run the group; ``options.quick`` trades size and precision for time (smoke tests)."""
    quick = options.quick
    return [*_bandwidths(quick), *_alloc_scaling(quick)]
