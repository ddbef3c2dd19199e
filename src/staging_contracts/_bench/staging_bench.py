"""Group ``staging``: the data path's kernels and the ring allocator.

Every bandwidth row is ``bytes / median time`` of ours against a plain ``copy_`` of the same
number of bytes between two preallocated tensors on the same device, measured alternately in
the same run (ratio = ours / copy, goal >= 0.5), with one torch intra-op thread as the
cluster's rank processes run (the previous count is restored afterwards), on
``options.device``. A chunk is 4096 tokens (1024 quick) of 32 layers (4 quick) x 128
head_dim bf16, page_size 16, on random pages of a pool 25 % larger than the chunk.

* ``staging.gather.<case>`` / ``staging.scatter.<case>``: prefill rank 0's gather of its head
  slice for decode rank 0 (as ``StagingWriter`` runs it) and decode rank 0's scatter of a
  complete ring region (as ``DecodeStagingHandler`` runs it), each rank's pool one
  allocation; cases in :data:`_CASES`;
* ``staging.gather`` / ``staging.scatter``: ``kernels.gather_chunk`` / ``scatter_chunk`` of
  all heads of pools allocated one by one (not a case the ranks run), for comparison;
* ``staging.integrity.{tag,check,transfer}.<case>``: the gather with the writer's digest, the
  scatter with ``ArrivalVerifier.check``, and gather, ``copy_`` into the ring and scatter
  with both, each against the same work without them (goal on the transfer <= 1.1);
* ``staging.alloc-scaling``: our ``assign`` + ``free`` at 100,000 live allocations against
  the same at 10 (goal <= 1.2: flat), and ``.anchor``, the same for a list-based ring
  allocator (the reference's design).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import NamedTuple

import torch

from .._control.integrity import ChunkIdentity, chunk_digest
from .._decode.integrity import ArrivalVerifier
from .._decode.rooms import ChunkRegion, PrefillPeer, RoomPlan
from .._decode.scatter import ChunkScatter
from .._staging.allocator import StagingAllocator
from .._staging.host_view import host_view
from .._staging.kernels import PagedKVPools, gather_chunk, scatter_chunk
from .._staging.layout import (
    WriterPlacement,
    compute_head_slice_params,
    compute_staging_layout,
    heads_per_rank,
)
from .._staging.ordering import ordering_for
from ..protocols import Allocation, KVBufferTensors, Watermark
from . import BenchOptions, BenchRow, ratio_row, smoke
from .timing import alternating_seconds, interleaved_ns_per_call

_LAYERS = 32
_HEADS = 8
_HEAD_DIM = 128
_TOKENS = 4096
_PAGE_SIZE = 16
_DTYPE = torch.bfloat16
_REGION = 64
"""Bytes per region in the allocator benchmark."""
_RANK_THREADS = 1
"""Torch intra-op threads of a rank process (``cluster.rank`` sets them)."""


class _Case(NamedTuple):
    """A prefill/decode TP pair whose staging moves head slices."""

    name: str
    prefill_tp: int
    decode_tp: int
    kv_heads: int


_CASES = (
    _Case("p4d2", 4, 2, 8),
    _Case("p2d4-gqa", 2, 4, 2),
    _Case("p1d4-gqa", 1, 4, 2),
)


class _Size(NamedTuple):
    """The chunk and pool of a run, and how it is measured."""

    layers: int
    tokens: int
    repeats: int
    device: torch.device

    @property
    def chunk_pages(self) -> int:
        return self.tokens // _PAGE_SIZE

    @property
    def pool_pages(self) -> int:
        return self.chunk_pages + self.chunk_pages // 4

    def pages(self) -> list[int]:
        """The chunk's pages: random pages of the pool, the same in every row."""
        generator = torch.Generator().manual_seed(0)
        return torch.randperm(self.pool_pages, generator=generator)[: self.chunk_pages].tolist()

    def sync(self) -> Callable[[], object] | None:
        """What to wait on before reading the clock: the device's queue on CUDA."""
        if self.device.type == "cuda":
            device = self.device
            return lambda: torch.cuda.synchronize(device)
        return None

    def where(self) -> str:
        return f"{_RANK_THREADS} torch thread, {self.device.type}"


def _one_allocation(size: _Size, heads: int) -> KVBufferTensors:
    """A rank's pool as the cluster builds it: views of one ``[2, layers, tokens, heads,
    head_dim]`` allocation (K of every layer, then V)."""
    shape = (2, size.layers, size.pool_pages * _PAGE_SIZE, heads, _HEAD_DIM)
    cache = torch.ones(shape, dtype=_DTYPE, device=size.device)
    return KVBufferTensors(tuple(cache[0].unbind()), tuple(cache[1].unbind()), _PAGE_SIZE)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):g} MiB"


def _heads(start: int, count: int) -> str:
    """``head 3`` or ``heads 2-3``."""
    return f"head {start}" if count == 1 else f"heads {start}-{start + count - 1}"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _ratio(name: str, size: _Size, nbytes: int, ours: Callable[[], object], note: str) -> BenchRow:
    """``ours`` against ``copy_`` of ``nbytes`` bytes, measured alternately."""
    source = torch.ones(nbytes, dtype=torch.uint8, device=size.device)
    target = torch.empty(nbytes, dtype=torch.uint8, device=size.device)
    seconds = alternating_seconds(
        {"ours": ours, "copy": lambda: target.copy_(source)},
        repeats=size.repeats,
        sync=size.sync(),
    )
    ours_gbps = nbytes / seconds["ours"] / 1e9
    copy_gbps = nbytes / seconds["copy"] / 1e9
    return ratio_row(name, ours_gbps, copy_gbps, "GB/s", ">= 0.5", note=note)


class _Pair:
    """Prefill rank 0 and decode rank 0 of a case: the gather of what the one stages for the
    other (into a staging buffer, as ``StagingWriter`` does) and the scatter of a complete
    ring region (as ``DecodeStagingHandler`` calls ``ChunkScatter.scatter``)."""

    def __init__(self, case: _Case, size: _Size) -> None:
        self.case = case
        self.size = size
        self.prefill_heads = heads_per_rank(case.kv_heads, case.prefill_tp)
        self.decode_heads = heads_per_rank(case.kv_heads, case.decode_tp)
        pool = _one_allocation(size, self.prefill_heads)
        self.pools = PagedKVPools(pool.k_buffers, pool.v_buffers, pool.page_size)
        self.head = compute_head_slice_params(case.prefill_tp, case.decode_tp, 0, 0, case.kv_heads)
        self.head_bytes = _HEAD_DIM * self.pools.geometry.element_size
        self.layout = compute_staging_layout(
            case.prefill_tp,
            case.decode_tp,
            0,
            case.kv_heads,
            size.tokens,
            self.head_bytes,
            size.layers,
        )
        self.buffer = torch.zeros(
            self.layout.writer_bytes[0], dtype=torch.uint8, device=size.device
        )
        self.ordering = ordering_for(size.device, None)
        self.page_list = size.pages()
        self.allocator = StagingAllocator(self.layout.total_bytes, device=size.device)
        self.scatterer = ChunkScatter(
            self.allocator,
            _one_allocation(size, self.decode_heads),
            decode_tp=case.decode_tp,
            decode_rank=0,
            total_kv_heads=case.kv_heads,
        )
        allocation = self.allocator.assign(self.layout.total_bytes)
        if allocation is None:
            raise RuntimeError(f"a ring of {self.layout.total_bytes} bytes refused as many")
        self.allocation = allocation
        # decode's page tensor is built once per room, as the handler does at registration
        self.pages = torch.tensor(self.page_list, dtype=torch.int64, device=size.device)

    def gather(self) -> None:
        # prefill's is built for every chunk, as StagingWriter does: part of the timed work
        pages = torch.tensor(self.page_list, dtype=torch.int64, device=self.size.device)
        self.pools.gather(pages, self.head.src_head_start, self.head.num_heads, self.buffer)
        self.ordering.gathered()

    def scatter(self) -> None:
        self.scatterer.scatter(self.allocation, self.pages, self.case.prefill_tp)

    def terms(self) -> str:
        """``P=4 -> D=2, 8 KV heads``."""
        case = self.case
        return f"P={case.prefill_tp} -> D={case.decode_tp}, {case.kv_heads} KV heads"


def _gather_row(case: _Case, size: _Size) -> BenchRow:
    pair = _Pair(case, size)
    head, heads, head_bytes = pair.head, pair.prefill_heads, pair.head_bytes
    nbytes = pair.layout.writer_bytes[0]
    rows = (
        f"whole {_PAGE_SIZE * head.num_heads * head_bytes} B page rows"
        if head.num_heads == heads
        else f"{head.num_heads * head_bytes} B of each {heads * head_bytes} B token row"
    )
    note = (
        f"{pair.terms()}: prefill rank 0 gathers {_heads(head.src_head_start, head.num_heads)} "
        f"of its {heads} ({rows}), {size.tokens} tokens x {size.layers} layers K+V bf16 = "
        f"{_mib(nbytes)}, into its staging buffer as StagingWriter does (PagedKVPools.gather, "
        f"pool in one allocation); copy_ of {_mib(nbytes)}; {size.where()}"
    )
    return _ratio(f"staging.gather.{case.name}", size, nbytes, pair.gather, note)


def _scatter_row(case: _Case, size: _Size) -> BenchRow:
    pair = _Pair(case, size)
    heads, per_writer, head_bytes = pair.decode_heads, pair.head.num_heads, pair.head_bytes
    writers = pair.layout.num_writers
    nbytes = pair.layout.total_bytes
    rows = (
        f"whole {_PAGE_SIZE * heads * head_bytes} B page rows"
        if writers == 1 and per_writer == heads
        else f"the writers' {per_writer * head_bytes} B pieces side by side in each "
        f"{heads * head_bytes} B token row"
    )
    note = (
        f"{pair.terms()}: decode rank 0 scatters a ring region of {_plural(writers, 'writer')} "
        f"x {_plural(per_writer, 'head')} into its {heads}-head pool ({rows}), "
        f"{size.tokens} tokens x {size.layers} layers K+V bf16 = {_mib(nbytes)}, as "
        f"DecodeStagingHandler does (ChunkScatter.scatter, pool in one allocation); copy_ of "
        f"{_mib(nbytes)}; {size.where()}"
    )
    return _ratio(f"staging.scatter.{case.name}", size, nbytes, pair.scatter, note)


def _integrity_rows(case: _Case, size: _Size) -> list[BenchRow]:
    """Tag at gather, check at scatter, and both in the staged transfer, each against the
    same work without them."""
    pair = _Pair(case, size)
    layout, allocation, scatterer = pair.layout, pair.allocation, pair.scatterer
    nbytes = layout.writer_bytes[0]
    session = "decode-0"
    writers = range(layout.num_writers)
    plan = RoomPlan(
        0,
        tuple(pair.page_list),
        size.chunk_pages,
        case.prefill_tp,
        tuple(PrefillPeer(rank, f"tcp://prefill:{rank}") for rank in writers),
    )
    region = ChunkRegion(allocation, size.chunk_pages, 0, layout.num_writers)
    verifier = ArrivalVerifier(scatterer, session_id=session, integrity=True, keys=None)

    def identity(rank: int) -> ChunkIdentity:
        return ChunkIdentity(0, 0, 0, size.chunk_pages, session, rank, allocation.round)

    target = pair.allocator.buffer[allocation.offset : allocation.offset + nbytes]

    def tag() -> None:
        pair.gather()
        chunk_digest(identity(0), host_view(pair.buffer))

    def check() -> None:
        pair.scatter()
        if verifier.check(plan, 0, region) is not None:
            raise RuntimeError("the integrity check of unchanged bytes failed")

    def tagged_transfer() -> None:
        tag()
        target.copy_(pair.buffer)
        check()

    def transfer() -> None:
        pair.gather()
        target.copy_(pair.buffer)
        pair.scatter()

    # Writer 0's part of the region holds what it gathers, so copying the gather in keeps
    # every digest valid; each writer's part is checked, as the handler does.
    pair.gather()
    target.copy_(pair.buffer)
    for rank in writers:  # the digests the writers would have sent for these bytes
        staged = scatterer.writer_bytes(allocation, case.prefill_tp, size.chunk_pages, rank)
        region.digests[rank] = chunk_digest(identity(rank), host_view(staged))

    compared: tuple[tuple[str, Callable[[], object], Callable[[], object], str], ...] = (
        (
            "tag",
            tag,
            pair.gather,
            f"gather of {_mib(nbytes)} + XXH3-64 digest of it (StagingWriter), against the "
            "gather alone",
        ),
        (
            "check",
            check,
            pair.scatter,
            f"scatter of a {_mib(layout.total_bytes)} region of "
            f"{_plural(layout.num_writers, 'writer')} + ArrivalVerifier.check of each writer's "
            "bytes, against the scatter alone",
        ),
        (
            "transfer",
            tagged_transfer,
            transfer,
            f"gather of {_mib(nbytes)} + copy_ into the ring (the engine's write at memory "
            f"speed) + scatter of the {_mib(layout.total_bytes)} region, with the tag and the "
            "check against without",
        ),
    )
    rows = []
    for name, ours, anchor, what in compared:
        seconds = alternating_seconds(
            {"ours": ours, "anchor": anchor}, repeats=size.repeats, sync=size.sync()
        )
        rows.append(
            ratio_row(
                f"staging.integrity.{name}.{case.name}",
                seconds["ours"] * 1e3,
                seconds["anchor"] * 1e3,
                "ms/chunk",
                "<= 1.1" if name == "transfer" else "",
                note=f"{pair.terms()}, {size.tokens} tokens x {size.layers} layers: {what}; "
                f"{size.where()}",
            )
        )
    return rows


def _all_heads_rows(size: _Size) -> list[BenchRow]:
    """Every head of 32 pools allocated one by one, checked per call."""
    pool_tokens = size.pool_pages * _PAGE_SIZE
    shape = (pool_tokens, _HEADS, _HEAD_DIM)
    k = [torch.ones(shape, dtype=_DTYPE, device=size.device) for _ in range(size.layers)]
    v = [torch.ones(shape, dtype=_DTYPE, device=size.device) for _ in range(size.layers)]
    pages = torch.tensor(size.pages(), dtype=torch.int64, device=size.device)
    nbytes = 2 * size.layers * size.tokens * _HEADS * _HEAD_DIM * k[0].element_size()
    staging = torch.ones(nbytes, dtype=torch.uint8, device=size.device)
    writers = [WriterPlacement(0, 0, _HEADS)]

    def gather() -> None:
        gather_chunk(k, v, pages, _PAGE_SIZE, 0, _HEADS, staging)

    def scatter() -> None:
        scatter_chunk(staging, k, v, pages, _PAGE_SIZE, writers)

    what = (
        f"all {_HEADS} heads of {size.layers} x 2 pools allocated one by one (layer by layer, "
        f"not the ranks' fused pools; pools re-checked per call): whole "
        f"{_PAGE_SIZE * _HEADS * _HEAD_DIM * 2} B page rows, {size.tokens} tokens = "
        f"{_mib(nbytes)}; copy_ of {_mib(nbytes)}; {size.where()}"
    )
    return [
        _ratio("staging.gather", size, nbytes, gather, f"kernels.gather_chunk of {what}"),
        _ratio("staging.scatter", size, nbytes, scatter, f"kernels.scatter_chunk of {what}"),
    ]


def _bandwidths(options: BenchOptions) -> list[BenchRow]:
    quick = options.quick
    size = _Size(
        layers=4 if quick else _LAYERS,
        tokens=1024 if quick else _TOKENS,
        repeats=5 if quick else 15,
        device=torch.device(options.device),
    )
    rows: list[BenchRow] = []
    before = torch.get_num_threads()
    torch.set_num_threads(_RANK_THREADS)  # as a rank process runs
    try:
        for case in _CASES:
            rows.append(_gather_row(case, size))
            rows.append(_scatter_row(case, size))
        rows.extend(_all_heads_rows(size))
        for case in _CASES:
            rows.extend(_integrity_rows(case, size))
    finally:
        torch.set_num_threads(before)
    return rows


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
    """Assign + free at 100,000 live allocations against 10, ours and the list ring's."""
    total = 1 << 20
    rows = []
    for name, ring, goal, loops, repeats in (
        ("staging.alloc-scaling", StagingAllocator, "<= 1.2", 200_000, 11),
        ("staging.alloc-scaling.anchor", _ListRing, "", 2_000, 7),
    ):
        large, small = interleaved_ns_per_call(
            _churn(ring(total), 100_000),
            _churn(ring(total), 10),
            loops=loops // 10 if quick else loops,
            repeats=3 if quick else repeats,
        )
        rows.append(ratio_row(name, large, small, "ns/assign+free (@100k, @10 live)", goal))
    return rows


def run(options: BenchOptions) -> list[BenchRow]:
    """Run the group on ``options.device``; ``options.quick`` trades size and precision for
    time (:func:`smoke` rows)."""
    rows = [*_bandwidths(options), *_alloc_scaling(options.quick)]
    return smoke(rows) if options.quick else rows  # quick: nothing to judge against a goal
