"""Our gather against the reference's scatter, and its gather against our scatter, bit-exact.

Prefill pools hold random bit patterns of one global KV cache, each rank its heads; a chunk of
pages in shuffled order is gathered into each decode rank's staging region by every prefill
rank feeding it, and scattered into the decode pool. The pool must hold exactly the decode
rank's heads of the chunk's tokens, whichever side gathered and whichever scattered; and both
gathers must produce the same bytes.

One difference, found here: on the CPU its torch gather (``torch.gather`` from a head slice of
the pool) rewrites the payload of NaNs it copies out of a head slice (``0x7fcd`` comes out as
``0xffff`` in bfloat16), where our kernels move integer words. So with NaN payloads in the
pools, our gather feeds its scatter bit for bit, and its gather feeds ours bit for bit except
for the payloads of NaNs (which stay NaNs); with finite values both ways are bit-exact.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from staging_contracts import KVBufferTensors
from staging_contracts._staging.kernels import gather_chunk, scatter_chunk
from staging_contracts._staging.layout import (
    compute_head_slice_params,
    compute_staging_layout,
    prefill_ranks_for_decode,
    validate_tp_pair,
    writer_index,
    writer_placements,
)
from tests.interop._reference import CpuStagingBuffer, Reference
from tests.local_cluster import pools_equal, rank_heads

INT_OF: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Case:
    """One geometry of the kernel comparison."""

    prefill_tp: int
    decode_tp: int
    heads: int
    dtype: torch.dtype = torch.bfloat16
    page_size: int = 4
    layers: int = 2
    head_dim: int = 8
    pages: int = 3
    pool_pages: int = 12

    def __str__(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        return f"P{self.prefill_tp}-D{self.decode_tp}-H{self.heads}-{name}-ps{self.page_size}"

    @property
    def head_bytes(self) -> int:
        return self.head_dim * torch.empty((), dtype=self.dtype).element_size()


def cases() -> list[Case]:
    """Every valid TP pair up to 8, in bf16, with one replicated head (GQA), one head per rank
    of the larger side, and 2 and 8 heads where they divide; then other dtypes, page sizes
    and layer counts on a few pairs."""
    out = []
    for prefill_tp, decode_tp in itertools.product(range(1, 9), range(1, 9)):
        for heads in sorted({1, 2, 8, max(prefill_tp, decode_tp)}):
            try:
                validate_tp_pair(prefill_tp, decode_tp, heads)
            except ValueError:
                continue
            out.append(Case(prefill_tp, decode_tp, heads))
    for dtype in (torch.float16, torch.float32, torch.float64, torch.int8):
        out.append(Case(4, 2, 8, dtype=dtype))
        out.append(Case(2, 4, 8, dtype=dtype))
    out.append(Case(8, 2, 16, page_size=1, layers=3, head_dim=16))
    out.append(Case(1, 4, 4, page_size=16, layers=5, head_dim=4, pages=2))
    return out


def global_kv(
    case: Case, seed: int, *, finite: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, K and V of every head for every pool token: random bits (NaNs replaced by
    their position's index when ``finite``)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (case.pool_pages * case.page_size, case.heads, case.head_dim)
    size = torch.empty((), dtype=case.dtype).element_size()

    def bits() -> torch.Tensor:
        raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), generator=generator)
        values = raw.to(torch.uint8).view(case.dtype)
        if finite and values.is_floating_point():
            values = torch.where(values.isnan(), torch.ones_like(values), values)
        return values

    return [bits() for _ in range(case.layers)], [bits() for _ in range(case.layers)]


def pool_of(
    case: Case, tp: int, rank: int, kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None
) -> KVBufferTensors:
    """A rank's pool: its heads of ``kv`` (zeros without it), one tensor per layer."""
    heads = rank_heads(case.heads, tp, rank)
    shape = (case.pool_pages * case.page_size, len(heads), case.head_dim)
    if kv is None:
        k = tuple(torch.zeros(shape, dtype=case.dtype) for _ in range(case.layers))
        v = tuple(torch.zeros(shape, dtype=case.dtype) for _ in range(case.layers))
    else:
        k = tuple(layer[:, heads].contiguous() for layer in kv[0])
        v = tuple(layer[:, heads].contiguous() for layer in kv[1])
    return KVBufferTensors(k, v, case.page_size)


def expected_decode_pool(
    case: Case,
    rank: int,
    kv: tuple[list[torch.Tensor], list[torch.Tensor]],
    prefill_pages: list[int],
    decode_pages: list[int],
) -> KVBufferTensors:
    """The decode pool after the chunk: the prefill pages' tokens in the decode pages."""
    pool = pool_of(case, case.decode_tp, rank, None)
    heads = rank_heads(case.heads, case.decode_tp, rank)
    ps = case.page_size
    src = torch.tensor([p * ps + t for p in prefill_pages for t in range(ps)])
    dst = torch.tensor([p * ps + t for p in decode_pages for t in range(ps)])
    for layer in range(case.layers):
        pool.k_buffers[layer][dst] = kv[0][layer][src][:, heads]
        pool.v_buffers[layer][dst] = kv[1][layer][src][:, heads]
    return pool


def chunk_pages(case: Case, seed: int) -> tuple[list[int], list[int]]:
    """Shuffled distinct prefill pages and decode pages of one chunk."""
    order = torch.randperm(case.pool_pages, generator=torch.Generator().manual_seed(seed))
    pages = order.tolist()
    return pages[: case.pages], pages[case.pages : 2 * case.pages]


def our_region(
    case: Case, decode_rank: int, prefills: list[KVBufferTensors], pages: list[int]
) -> torch.Tensor:
    """The staging region of ``decode_rank``, gathered by our kernels (every writer)."""
    layout = compute_staging_layout(
        case.prefill_tp,
        case.decode_tp,
        decode_rank,
        case.heads,
        case.pages * case.page_size,
        case.head_bytes,
        case.layers,
    )
    region = torch.full((layout.total_bytes,), 0xA5, dtype=torch.uint8)
    index = torch.tensor(pages, dtype=torch.int64)
    for p in prefill_ranks_for_decode(case.prefill_tp, case.decode_tp, decode_rank):
        head = compute_head_slice_params(
            case.prefill_tp, case.decode_tp, p, decode_rank, case.heads
        )
        w = writer_index(case.prefill_tp, case.decode_tp, p)
        start = layout.writer_offsets[w]
        pool = prefills[p]
        written = gather_chunk(
            pool.k_buffers,
            pool.v_buffers,
            index,
            case.page_size,
            head.src_head_start,
            head.num_heads,
            region[start : start + layout.writer_bytes[w]],
        )
        assert written == layout.writer_bytes[w]
    return region


def their_region(
    reference: Reference,
    case: Case,
    decode_rank: int,
    prefills: list[KVBufferTensors],
    pages: list[int],
) -> torch.Tensor:
    """The same region, gathered by the reference's gather (its torch path) per writer."""
    import numpy as np

    buffer = reference.staging_buffer
    parts = []
    for p in prefill_ranks_for_decode(case.prefill_tp, case.decode_tp, decode_rank):
        src_start, count, _, _ = buffer.compute_head_slice_params(
            case.prefill_tp, case.decode_tp, p, decode_rank, case.heads
        )
        size = case.pages * case.page_size * count * case.head_bytes * case.layers * 2
        staging = CpuStagingBuffer(size)
        pool = prefills[p]
        written = buffer.gather_all_layers_to_staging(
            list(pool.k_buffers),
            list(pool.v_buffers),
            np.array(pages, dtype=np.int32),
            staging,
            src_start,
            count,
            case.page_size,
        )
        assert written == size
        parts.append(staging.buffer)
    return torch.cat(parts)


def same_but_nan_payloads(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether two byte tensors of ``dtype`` values hold the same bits, except that a NaN may
    have another NaN's bits."""
    x, y = a.view(dtype), b.view(dtype)
    same = x.view(INT_OF[x.element_size()]) == y.view(INT_OF[y.element_size()])
    if x.is_floating_point():
        same |= x.isnan() & y.isnan()
    return bool(same.all())


def pool_bytes(pool: KVBufferTensors) -> torch.Tensor:
    """Every byte of a pool, layer by layer, K then V."""
    return torch.cat(
        [t.contiguous().view(torch.uint8).flatten() for t in (*pool.k_buffers, *pool.v_buffers)]
    )


CASES = cases()


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("finite", [True, False], ids=["finite", "nan-payloads"])
def test_our_gather_feeds_its_scatter_and_its_gather_feeds_ours(
    reference: Reference, case: Case, finite: bool
) -> None:
    """For every decode rank: both gathers give the same region bytes; its scatter of our
    region and our scatter of its region both fill the decode pool bit for bit (with NaN
    payloads in the pools, its gather keeps NaNs NaN but not their payloads)."""
    kv = global_kv(case, seed=case.prefill_tp * 31 + case.decode_tp, finite=finite)
    prefills = [pool_of(case, case.prefill_tp, p, kv) for p in range(case.prefill_tp)]
    prefill_pages, decode_pages = chunk_pages(case, seed=case.heads)
    decode_index = torch.tensor(decode_pages, dtype=torch.int64)
    for d in range(case.decode_tp):
        expected = expected_decode_pool(case, d, kv, prefill_pages, decode_pages)
        ours = our_region(case, d, prefills, prefill_pages)
        theirs = their_region(reference, case, d, prefills, prefill_pages)
        if finite:
            assert torch.equal(ours, theirs), f"gathered bytes differ for decode rank {d}"
        else:
            assert same_but_nan_payloads(ours, theirs, case.dtype), f"decode rank {d}"

        by_them = pool_of(case, case.decode_tp, d, None)
        reference.staging_buffer.scatter_staging_to_kv(
            ours,
            list(by_them.k_buffers),
            list(by_them.v_buffers),
            decode_index,
            case.page_size,
            case.prefill_tp,
            case.decode_tp,
            d,
            case.heads,
        )
        assert pools_equal(by_them, expected), f"its scatter of our gather, decode rank {d}"

        by_us = pool_of(case, case.decode_tp, d, None)
        scatter_chunk(
            theirs,
            by_us.k_buffers,
            by_us.v_buffers,
            decode_index,
            case.page_size,
            writer_placements(
                case.prefill_tp,
                case.decode_tp,
                d,
                case.heads,
                case.pages * case.page_size,
                case.head_bytes,
                case.layers,
            ),
        )
        if finite:
            assert pools_equal(by_us, expected), f"our scatter of its gather, decode rank {d}"
        else:
            assert same_but_nan_payloads(pool_bytes(by_us), pool_bytes(expected), case.dtype)


def test_its_gather_rewrites_nan_payloads_of_a_head_slice_and_ours_does_not(
    reference: Reference,
) -> None:
    """The difference the NaN cases allow, pinned down: bfloat16 NaNs of payload 0x7fcd,
    gathered as a one-head slice (P=1 -> D=2), come out of its gather as other NaNs."""
    case = Case(1, 2, 2, pages=1, pool_pages=2, layers=1, head_dim=1)
    k = torch.full((case.pool_pages * case.page_size, 2, 1), 0x7FCD, dtype=torch.int16)
    pool = KVBufferTensors(
        (k.view(torch.bfloat16),), (k.view(torch.bfloat16).clone(),), case.page_size
    )
    ours = our_region(case, 1, [pool], [0])
    theirs = their_region(reference, case, 1, [pool], [0])
    assert ours.view(torch.int16).tolist() == [0x7FCD] * (2 * case.page_size)
    assert theirs.view(torch.bfloat16).isnan().all()
    assert not torch.equal(ours, theirs)


def test_the_cases_cover_every_tp_pair_up_to_8() -> None:
    """The comparison runs on every TP pair that divide one another, with GQA."""
    pairs = {(c.prefill_tp, c.decode_tp) for c in CASES}
    assert pairs >= {(p, d) for p in range(1, 9) for d in range(1, 9) if max(p, d) % min(p, d) == 0}
    assert any(c.heads < max(c.prefill_tp, c.decode_tp) for c in CASES)
