"""Pools that are views of one allocation: found, refused, and moved bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from staging_contracts._staging import kernels
from staging_contracts._staging.host_rows import put_pages, put_rows
from staging_contracts._staging.kernels import KernelBackend, PagedKVPools, WriterPlacement
from tests.test_kernels import (
    PAGE_PATTERNS,
    WRITER_SETS,
    as_bytes,
    random_bits,
    reference_scatter,
    token_indices,
    torch_threads,
)

LAYERS, POOL_PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 2, 10, 3, 4, 4
TOKENS = POOL_PAGES * PAGE_SIZE
ROW = (HEADS, HEAD_DIM)

Views = Callable[[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor]]]

# How a backing allocation is cut into K and V pools: shape of the backing, and the cut.
LAYOUTS: dict[str, tuple[tuple[int, ...], Views]] = {
    # [2, L, tokens, heads, dim]: every K pool, then every V pool (the demo's pools).
    "k then v": (
        (2, LAYERS, TOKENS, *ROW),
        lambda b: (list(b[0].unbind()), list(b[1].unbind())),
    ),
    # [L, 2, tokens, heads, dim]: each layer's K and V side by side (vLLM's per-layer cache).
    "layer major": (
        (LAYERS, 2, TOKENS, *ROW),
        lambda b: ([b[i, 0] for i in range(LAYERS)], [b[i, 1] for i in range(LAYERS)]),
    ),
    # Two unused pages after every pool: rows in between belong to no pool.
    "padded": (
        (2 * LAYERS, TOKENS + 2 * PAGE_SIZE, *ROW),
        lambda b: (
            [b[i, :TOKENS] for i in range(LAYERS)],
            [b[LAYERS + i, :TOKENS] for i in range(LAYERS)],
        ),
    ),
    # One token more than whole pages per pool: pools are not whole pages apart.
    "partial page": (
        (2 * LAYERS, TOKENS + 1, *ROW),
        lambda b: (list(b[:LAYERS].unbind()), list(b[LAYERS:].unbind())),
    ),
    # Pools in no even order inside one allocation: three runs of evenly spaced pools.
    "shuffled": (
        (2 * LAYERS, TOKENS, *ROW),
        lambda b: ([b[2], b[0]], [b[3], b[1]]),
    ),
    # V pools are the K pools: a scatter would write each page twice.
    "aliased": (
        (LAYERS, TOKENS, *ROW),
        lambda b: (list(b.unbind()), list(b.unbind())),
    ),
}
FUSED = {"k then v", "layer major", "padded", "shuffled"}
RUNS = {"k then v": 1, "layer major": 2, "padded": 1, "shuffled": 3}


def backing_for(layout: str, generator: torch.Generator) -> torch.Tensor:
    return random_bits(LAYOUTS[layout][0], torch.bfloat16, generator)


def views_of(layout: str, backing: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return LAYOUTS[layout][1](backing)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_rows_are_the_pools_pages(layout: str) -> None:
    """Finds one allocation exactly for the fusable layouts; each row is a pool's page."""
    k, v = views_of(layout, backing_for(layout, torch.Generator().manual_seed(1)))
    fused = PagedKVPools(k, v, PAGE_SIZE).fused(torch.int16)
    assert (fused is not None) == (layout in FUSED)
    if fused is None:
        return
    assert len(fused.runs) == RUNS[layout]
    assert [run.first_pool for run in fused.runs] == sorted(run.first_pool for run in fused.runs)
    for run in fused.runs:
        pages = fused.run_pages(run)
        for offset in range(run.length):
            pool = [*k, *v][run.first_pool + offset]
            assert torch.equal(as_bytes(pages[offset]).flatten(), as_bytes(pool[:TOKENS]).flatten())
    for pool_index, pool in enumerate((*k, *v)):
        for page in range(POOL_PAGES):
            row = int(fused.first_row[pool_index]) + page
            want = pool[page * PAGE_SIZE : (page + 1) * PAGE_SIZE]
            assert torch.equal(as_bytes(fused.rows[row]).flatten(), as_bytes(want).flatten())
    rows = fused.rows_of(torch.tensor([4, 1]))
    assert rows.tolist() == [int(r) + p for r in fused.first_row for p in (4, 1)]


def test_separate_allocations_are_not_fused() -> None:
    """Pools allocated one by one go layer by layer."""
    generator = torch.Generator().manual_seed(2)
    k = [random_bits((TOKENS, *ROW), torch.bfloat16, generator) for _ in range(LAYERS)]
    v = [random_bits((TOKENS, *ROW), torch.bfloat16, generator) for _ in range(LAYERS)]
    assert PagedKVPools(k, v, PAGE_SIZE).fused() is None


@pytest.mark.parametrize(
    ("backend", "threads", "max_runs"),
    [
        (KernelBackend.TORCH, 1, 4),
        (KernelBackend.TORCH, 1, 0),
        (KernelBackend.TORCH, 2, 4),
        (KernelBackend.TORCH_ONLY, 1, 4),
    ],
    ids=["numpy pages", "numpy rows", "torch threads", "torch only"],
)
@pytest.mark.parametrize("pattern", ["two runs", "mixed"])
@pytest.mark.parametrize("writer_set", WRITER_SETS)
@pytest.mark.parametrize("layout", sorted(set(LAYOUTS) - {"aliased"}))
def test_scatter_into_one_allocation_matches_the_literal_layout(
    monkeypatch: pytest.MonkeyPatch,
    backend: KernelBackend,
    threads: int,
    max_runs: int,
    pattern: str,
    writer_set: str,
    layout: str,
) -> None:
    """Writes what a token-by-token reading of the layout writes, and no byte of the
    allocation outside the chunk's pages and the writers' heads (padding included), by
    every path: NumPy copies per run and page or per row (one torch thread), torch's on
    several threads, or the torch-only (CUDA) path."""
    monkeypatch.setattr(kernels, "_MAX_HOST_RUNS", max_runs)
    generator = torch.Generator().manual_seed(3)
    pages = PAGE_PATTERNS[pattern]
    unit = len(pages) * PAGE_SIZE * HEAD_DIM * 2 * 2 * LAYERS
    writers = [
        WriterPlacement(w.byte_offset * unit, w.dst_head_start, w.num_heads)
        for w in WRITER_SETS[writer_set]
    ]
    region = random_bits(
        (max(w.byte_offset + w.num_heads * unit for w in writers),), torch.uint8, generator
    )
    backing = backing_for(layout, generator)
    expected = backing.clone()
    k, v = views_of(layout, expected)
    reference_scatter(region, [*k, *v], pages, PAGE_SIZE, writers)
    k, v = views_of(layout, backing)
    with torch_threads(threads):
        PagedKVPools(k, v, PAGE_SIZE).scatter(region, torch.tensor(pages), writers, backend=backend)
    assert torch.equal(as_bytes(backing), as_bytes(expected))


@pytest.mark.parametrize("pattern", PAGE_PATTERNS)
@pytest.mark.parametrize("heads", [(0, 4), (1, 2)], ids=["all heads", "head slice"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gather_from_one_allocation_follows_the_layout(
    pattern: str, heads: tuple[int, int], layout: str
) -> None:
    """Gathers K of every layer, then V, each [tokens, heads, dim] in page order."""
    k, v = views_of(layout, backing_for(layout, torch.Generator().manual_seed(4)))
    pages = PAGE_PATTERNS[pattern]
    out = torch.zeros(1 << 13, dtype=torch.uint8)
    written = PagedKVPools(k, v, PAGE_SIZE).gather(torch.tensor(pages), heads[0], heads[1], out)
    tokens = token_indices(pages, PAGE_SIZE)
    expected = torch.cat(
        [as_bytes(pool[tokens][:, heads[0] : sum(heads)]).flatten() for pool in (*k, *v)]
    )
    assert torch.equal(out[:written], expected)
    assert not out[written:].any()


@pytest.mark.parametrize(
    ("layout", "backend", "threads", "used"),
    [
        ("k then v", KernelBackend.TORCH, 1, "put_pages"),
        ("shuffled", KernelBackend.TORCH, 1, "put_rows"),
        ("partial page", KernelBackend.TORCH, 1, "put_each"),
        ("k then v", KernelBackend.TORCH, 2, None),
        ("k then v", KernelBackend.TORCH_ONLY, 1, None),
    ],
)
def test_numpy_copies_only_on_one_torch_thread(
    monkeypatch: pytest.MonkeyPatch,
    layout: str,
    backend: KernelBackend,
    threads: int,
    used: str | None,
) -> None:
    """Per page over few runs of fused pools, per row over many; per row into each pool of
    pools allocated one by one; torch's index op when torch has several threads (it spreads
    over them) or when asked for the torch-only path."""
    monkeypatch.setattr(kernels, "_MAX_HOST_RUNS", 2)
    calls: list[str] = []

    def recording(name: str) -> Callable[..., None]:
        real: Callable[..., None] = getattr(kernels, name)

        def record(*args: torch.Tensor) -> None:
            calls.append(name)
            real(*args)

        return record

    for name in ("put_each", "put_pages", "put_rows"):
        monkeypatch.setattr(kernels, name, recording(name))
    k, v = views_of(layout, backing_for(layout, torch.Generator().manual_seed(6)))
    region = torch.zeros(2 * LAYERS * 3 * PAGE_SIZE * HEADS * HEAD_DIM * 2, dtype=torch.uint8)
    with torch_threads(threads):
        PagedKVPools(k, v, PAGE_SIZE).scatter(
            region, torch.tensor([5, 1, 2]), [WriterPlacement(0, 0, HEADS)], backend=backend
        )
    assert set(calls) == ({used} if used else set())


@pytest.mark.parametrize("layout", ["k then v", "partial page"])
def test_one_pool_set_serves_scatters_of_any_writers(layout: str) -> None:
    """Views cached by a prepared pool set (per word size and writer geometry) never leak
    from one scatter into the next: five writer sets in a row land as the literal layout."""
    generator = torch.Generator().manual_seed(7)
    backing = backing_for(layout, generator)
    expected = backing.clone()
    pools = PagedKVPools(*views_of(layout, backing), PAGE_SIZE)
    reference_k, reference_v = views_of(layout, expected)
    reference = [*reference_k, *reference_v]
    pages = [3, 8, 1]
    unit = len(pages) * PAGE_SIZE * HEAD_DIM * 2 * 2 * LAYERS
    with torch_threads(1):
        for number, writer_set in enumerate([*WRITER_SETS, "adjacent"]):
            writers = [
                WriterPlacement(w.byte_offset * unit, w.dst_head_start, w.num_heads)
                for w in WRITER_SETS[writer_set]
            ]
            size = max(w.byte_offset + w.num_heads * unit for w in writers)
            region = random_bits((size + number,), torch.uint8, generator)[number:]
            reference_scatter(region, reference, pages, PAGE_SIZE, writers)
            pools.scatter(region, torch.tensor(pages), writers)
            assert torch.equal(as_bytes(backing), as_bytes(expected)), writer_set


def test_paged_pools_check_their_arguments_per_call() -> None:
    """A prepared pool set still refuses pages outside the pool and a short output."""
    k, v = views_of("k then v", backing_for("k then v", torch.Generator().manual_seed(5)))
    pools = PagedKVPools(k, v, PAGE_SIZE)
    with pytest.raises(ValueError, match=r"^page_indices range over \[0, 10\]"):
        pools.gather(torch.tensor([0, 10]), 0, 4, torch.zeros(1 << 13, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"^out holds 16 bytes, the chunk needs 96$"):
        pools.gather(torch.tensor([1]), 0, 1, torch.zeros(16, dtype=torch.uint8))


def test_put_rows_copies_bytes_not_values() -> None:
    """Moves NaN payloads and every other bit pattern unchanged, rows in index order."""
    patterns = torch.tensor([0x7FC1, 0x7F81, 0x8000, 0x0001, 0x7FFF, 0xFF80], dtype=torch.int32)
    words = patterns.to(torch.int16)  # wraps: the bit patterns, as bf16 NaNs and others
    # One element per row, read through a size-1 inner dimension with an odd stride.
    source = words.as_strided((3, 1), (2, 7))
    target = torch.zeros(5, 1, dtype=torch.int16)
    put_rows(target, torch.tensor([4, 0, 2]), source)
    assert target.flatten().tolist() == [int(words[2]), 0, int(words[4]), 0, int(words[0])]
    assert torch.equal(target.view(torch.bfloat16)[4].view(torch.int16), words[:1])
    wide = torch.arange(24, dtype=torch.int64).view(3, 2, 4)
    into = torch.zeros(4, 2, 4, dtype=torch.int64)
    put_rows(into, torch.tensor([3, 1, 0]), wide)
    assert torch.equal(into[[3, 1, 0]], wide)
    assert not into[2].any()


def test_put_pages_copies_each_page_of_every_pool() -> None:
    """``target[:, pages[j]] = source[:, j]``, whatever the pool stride; other pages kept."""
    backing = torch.zeros(3, 7, 5, 2, dtype=torch.int32)
    target = backing[::2]  # two pools, a pool apart
    source = torch.arange(2 * 3 * 5 * 2, dtype=torch.int32).view(2, 3, 5, 2)
    put_pages(target, torch.tensor([6, 0, 3]), source)
    assert torch.equal(target[:, [6, 0, 3]], source)
    assert not target[:, [1, 2, 4, 5]].any()
    assert not backing[1].any()


def test_put_rows_needs_a_contiguous_inner_dimension() -> None:
    """Refuses views whose innermost elements are not side by side."""
    target = torch.zeros(4, 6, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"innermost dimension of a \(4, 3\) view"):
        put_rows(target[:, ::2], torch.tensor([0]), torch.zeros(1, 3, dtype=torch.int32))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip_through_one_allocation() -> None:
    """On CUDA, one allocation moves with one index op per writer group, bit for bit."""
    device = torch.device("cuda")
    k, v = views_of("layer major", backing_for("layer major", torch.Generator()).to(device))
    pools = PagedKVPools(k, v, PAGE_SIZE)
    assert pools.fused() is not None
    pages = torch.tensor([7, 2, 5], device=device)
    out = torch.zeros(1 << 13, dtype=torch.uint8, device=device)
    written = pools.gather(pages, 0, HEADS, out)
    target = torch.zeros(LAYOUTS["k then v"][0], dtype=torch.bfloat16, device=device)
    dst_k, dst_v = views_of("k then v", target)
    PagedKVPools(dst_k, dst_v, PAGE_SIZE).scatter(
        out[:written], pages, [WriterPlacement(0, 0, HEADS)]
    )
    torch.cuda.synchronize()
    tokens = token_indices([7, 2, 5], PAGE_SIZE).to(device)
    for got, want in zip((*dst_k, *dst_v), (*k, *v), strict=True):
        assert torch.equal(as_bytes(got[tokens]), as_bytes(want[tokens]))
