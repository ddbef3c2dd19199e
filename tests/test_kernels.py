"""Tests of the gather and scatter kernels: SPEC §3 layout, bit-exact round trips, checks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from staging_contracts._staging.kernels import (
    KernelBackend,
    WriterPlacement,
    gather_chunk,
    pool_geometry,
    scatter_chunk,
)
from staging_contracts._staging.layout import (
    compute_head_slice_params,
    compute_staging_layout,
    heads_per_rank,
    prefill_ranks_for_decode,
    writer_placements,
)

DTYPES = [
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int64,
]

# (total_kv_heads, prefill_tp, decode_tp): P > D, P < D with GQA replication, P = 1, D = 1.
TP_CASES = [
    (8, 4, 2),
    (8, 2, 4),
    (2, 1, 4),
    (2, 4, 1),
    (4, 8, 2),
    (2, 2, 8),
    (4, 1, 1),
    (8, 1, 2),
    (8, 8, 1),
    (1, 2, 2),
]


def random_bits(
    shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bytes (NaN payloads included)."""
    size = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for extent in shape:
        numel *= extent
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).view(shape)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bit-exact comparison."""
    return tensor.contiguous().view(torch.uint8)


def global_heads(total_kv_heads: int, tp: int, rank: int) -> list[int]:
    """Model-level head of each local head of a rank."""
    if tp <= total_kv_heads:
        per_rank = total_kv_heads // tp
        return [rank * per_rank + j for j in range(per_rank)]
    return [rank // (tp // total_kv_heads)]


def token_indices(pages: list[int], page_size: int) -> torch.Tensor:
    """Pool token of each chunk token, in page order."""
    return torch.tensor(
        [page * page_size + t for page in pages for t in range(page_size)], dtype=torch.int64
    )


# CPU scatter paths: (backend, torch intra-op threads). NumPy copies run with one thread.
PATHS = {
    "numpy": (KernelBackend.TORCH, 1),
    "torch threads": (KernelBackend.TORCH, 2),
    "torch only": (KernelBackend.TORCH_ONLY, 1),
}


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` torch intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Pools(NamedTuple):
    """One rank's K and V pools."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]


def one_allocation(pools: Pools) -> Pools:
    """The same pools, copied into views of one allocation (K of every layer, then V)."""
    every = [*pools.k, *pools.v]
    backing = torch.stack(every)
    views = list(backing.unbind())
    return Pools(views[: len(pools.k)], views[len(pools.k) :])


def make_pools(
    model: list[torch.Tensor],
    heads: list[int],
    *,
    pool_pages: int,
    pages: list[int],
    page_size: int,
    generator: torch.Generator,
) -> Pools:
    """Random pools holding the model's ``heads`` of the chunk at ``pages``."""
    tokens = token_indices(pages, page_size)
    head_index = torch.tensor(heads, dtype=torch.int64)
    made = []
    for block in model:
        pool = random_bits(
            (pool_pages * page_size, len(heads), block.shape[2]), block.dtype, generator
        )
        pool.view(torch.uint8)[tokens] = block.view(torch.uint8)[:, head_index]
        made.append(pool)
    half = len(made) // 2
    return Pools(made[:half], made[half:])


def test_gather_follows_spec_layout() -> None:
    """Writes K of every layer, then V, each [tokens, heads, head_dim] in page order."""
    generator = torch.Generator().manual_seed(1)
    k = [random_bits((40, 4, 3), torch.bfloat16, generator) for _ in range(2)]
    v = [random_bits((40, 4, 3), torch.bfloat16, generator) for _ in range(2)]
    pages = [7, 2, 5]
    out = torch.zeros(4096, dtype=torch.uint8)
    written = gather_chunk(k, v, torch.tensor(pages), 4, 1, 2, out)
    tokens = token_indices(pages, 4)
    expected = torch.cat([as_bytes(pool[tokens][:, 1:3]).flatten() for pool in (*k, *v)])
    assert written == expected.numel() == 12 * 2 * 3 * 2 * 4
    assert torch.equal(out[:written], expected)
    assert not out[written:].any()


def test_scatter_writes_only_its_heads_and_pages() -> None:
    """Fills the writers' heads of the chunk's pages and leaves every other byte alone."""
    generator = torch.Generator().manual_seed(2)
    k = [random_bits((24, 4, 2), torch.float32, generator)]
    v = [random_bits((24, 4, 2), torch.float32, generator)]
    before = [as_bytes(pool).clone() for pool in (*k, *v)]
    region = random_bits((2 * 3 * 2 * 2 * 4 * 2,), torch.uint8, generator)
    scatter_chunk(region, k, v, torch.tensor([4, 1]), 3, [WriterPlacement(0, 1, 2)])
    tokens = token_indices([4, 1], 3)
    for index, pool in enumerate((*k, *v)):
        expected = before[index].clone()
        block = region[index * 96 : (index + 1) * 96].view(6, 2, 8)
        expected[tokens, 1:3] = block
        assert torch.equal(as_bytes(pool), expected)


@settings(max_examples=150, deadline=None)
@given(
    case=st.sampled_from(TP_CASES),
    dtype=st.sampled_from(DTYPES),
    page_size=st.integers(1, 5),
    head_dim=st.sampled_from([1, 2, 3, 8]),
    num_layers=st.integers(1, 3),
    data=st.data(),
)
def test_gather_then_scatter_reproduces_decode_pools(
    *,
    case: tuple[int, int, int],
    dtype: torch.dtype,
    page_size: int,
    head_dim: int,
    num_layers: int,
    data: st.DataObject,
) -> None:
    """Reproduces every decode pool bit for bit after gathering from prefill and scattering,
    with pools allocated one by one or as views of one allocation on either side."""
    total, prefill_tp, decode_tp = case
    fused_prefill, fused_decode = data.draw(st.booleans()), data.draw(st.booleans())
    backend, threads = PATHS[data.draw(st.sampled_from(sorted(PATHS)))]
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    chunk_pages = data.draw(st.integers(1, 4))
    pool_pages = chunk_pages + data.draw(st.integers(0, 3))
    model = [
        random_bits((chunk_pages * page_size, total, head_dim), dtype, generator)
        for _ in range(2 * num_layers)
    ]
    pages_strategy = st.permutations(range(pool_pages)).map(lambda p: list(p[:chunk_pages]))
    prefill = {}
    prefill_pages = {}
    for p in range(prefill_tp):
        prefill_pages[p] = data.draw(pages_strategy)
        heads = global_heads(total, prefill_tp, p)
        prefill[p] = make_pools(
            model,
            heads,
            pool_pages=pool_pages,
            pages=prefill_pages[p],
            page_size=page_size,
            generator=generator,
        )
        if fused_prefill:
            prefill[p] = one_allocation(prefill[p])
    element = torch.empty((), dtype=dtype).element_size()
    for d in range(decode_tp):
        heads = global_heads(total, decode_tp, d)
        decode_pages = data.draw(pages_strategy)
        expected = make_pools(
            model,
            heads,
            pool_pages=pool_pages,
            pages=decode_pages,
            page_size=page_size,
            generator=generator,
        )
        decode = Pools(
            [random_bits(t.shape, dtype, generator) for t in expected.k],
            [random_bits(t.shape, dtype, generator) for t in expected.v],
        )
        # Bytes outside the chunk are whatever decode held: start from the expected pools'
        # untouched bytes, then overwrite the chunk's pages with garbage.
        tokens = token_indices(decode_pages, page_size)
        for made, want in zip((*decode.k, *decode.v), (*expected.k, *expected.v), strict=True):
            garbage = made.view(torch.uint8)[tokens].clone()
            made.copy_(want)
            made.view(torch.uint8)[tokens] = garbage
        if fused_decode:
            decode = one_allocation(decode)
        layout = compute_staging_layout(
            prefill_tp,
            decode_tp,
            d,
            total,
            chunk_pages * page_size,
            head_dim * element,
            num_layers,
        )
        region = random_bits((layout.total_bytes,), torch.uint8, generator)
        feeders = prefill_ranks_for_decode(prefill_tp, decode_tp, d)
        for offset, size, p in zip(
            layout.writer_offsets, layout.writer_bytes, feeders, strict=True
        ):
            head_slice = compute_head_slice_params(prefill_tp, decode_tp, p, d, total)
            written = gather_chunk(
                prefill[p].k,
                prefill[p].v,
                torch.tensor(prefill_pages[p]),
                page_size,
                head_slice.src_head_start,
                head_slice.num_heads,
                region[offset : offset + size],
            )
            assert written == size
        placements = writer_placements(
            prefill_tp,
            decode_tp,
            d,
            total,
            chunk_pages * page_size,
            head_dim * element,
            num_layers,
        )
        with torch_threads(threads):
            scatter_chunk(
                region,
                decode.k,
                decode.v,
                torch.tensor(decode_pages),
                page_size,
                placements,
                backend=backend,
            )
        assert len(decode.k[0][0]) == heads_per_rank(total, decode_tp)
        for got, want in zip((*decode.k, *decode.v), (*expected.k, *expected.v), strict=True):
            assert torch.equal(as_bytes(got), as_bytes(want))


def reference_scatter(
    region: torch.Tensor,
    pools: list[torch.Tensor],
    pages: list[int],
    page_size: int,
    writers: list[WriterPlacement],
) -> None:
    """SPEC §3 read literally: one token row of one writer at a time (slow, obviously right)."""
    head_bytes = pools[0].shape[2] * pools[0].element_size()
    tokens = token_indices(pages, page_size).tolist()
    for writer in writers:
        row = writer.num_heads * head_bytes
        block = len(tokens) * row
        for layer, pool in enumerate(pools):
            flat = pool.view(pool.shape[0], -1).view(torch.uint8)
            for index, token in enumerate(tokens):
                start = writer.byte_offset + layer * block + index * row
                column = writer.dst_head_start * head_bytes
                flat[token, column : column + row] = region[start : start + row]


PAGE_PATTERNS = {
    "one run": [3, 4, 5, 6, 7, 8],
    "two runs": [6, 7, 8, 0, 1, 2],
    "descending": [8, 7, 6, 5],
    "mixed": [2, 3, 9, 0, 4, 5, 6],
}

WRITER_SETS = {
    # P > D: writers side by side, evenly spaced bytes (scattered as one group).
    "adjacent": [WriterPlacement(0, 0, 1), WriterPlacement(1, 1, 1), WriterPlacement(2, 2, 1)],
    # Padding between writers' bytes, still evenly spaced.
    "padded": [WriterPlacement(0, 0, 2), WriterPlacement(3, 2, 2)],
    # Uneven spacing, reversed heads, differing head counts: no group forms.
    "uneven": [WriterPlacement(0, 0, 1), WriterPlacement(1, 1, 1), WriterPlacement(5, 2, 1)],
    "reversed": [WriterPlacement(0, 2, 2), WriterPlacement(2, 0, 2)],
    "mixed heads": [WriterPlacement(0, 0, 1), WriterPlacement(1, 1, 3)],
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pattern", PAGE_PATTERNS)
@pytest.mark.parametrize("writer_set", WRITER_SETS)
def test_scatter_matches_the_literal_layout(path: str, pattern: str, writer_set: str) -> None:
    """Writes exactly what a token-by-token reading of the layout writes, with NumPy row
    copies, torch's on several threads, or the torch-only (CUDA) code path."""
    backend, threads = PATHS[path]
    generator = torch.Generator().manual_seed(6)
    pages, page_size, layers = PAGE_PATTERNS[pattern], 3, 2
    chunk_tokens = len(pages) * page_size
    head_bytes = 4 * 2  # head_dim 4, bf16
    # Each writer unit is one head's bytes of the chunk (all layers, K and V).
    unit = chunk_tokens * head_bytes * 2 * layers
    writers = [
        WriterPlacement(w.byte_offset * unit, w.dst_head_start, w.num_heads)
        for w in WRITER_SETS[writer_set]
    ]
    end = max(w.byte_offset + w.num_heads * unit for w in writers)
    region = random_bits((end,), torch.uint8, generator)
    pools = [random_bits((10 * page_size, 4, 4), torch.bfloat16, generator) for _ in range(4)]
    expected = [pool.clone() for pool in pools]
    reference_scatter(region, expected, pages, page_size, writers)
    with torch_threads(threads):
        scatter_chunk(
            region, pools[:2], pools[2:], torch.tensor(pages), page_size, writers, backend=backend
        )
    for got, want in zip(pools, expected, strict=True):
        assert torch.equal(as_bytes(got), as_bytes(want))


@pytest.mark.parametrize("pattern", PAGE_PATTERNS)
@pytest.mark.parametrize("heads", [(0, 4), (1, 2)], ids=["all heads", "head slice"])
def test_gather_follows_the_layout_for_any_page_order(pattern: str, heads: tuple[int, int]) -> None:
    """Gathers the chunk's heads page by page in the chunk's order, runs or not."""
    generator = torch.Generator().manual_seed(7)
    pages = PAGE_PATTERNS[pattern]
    k = [random_bits((40, 4, 4), torch.float16, generator) for _ in range(2)]
    v = [random_bits((40, 4, 4), torch.float16, generator) for _ in range(2)]
    out = torch.zeros(1 << 12, dtype=torch.uint8)
    written = gather_chunk(k, v, torch.tensor(pages), 4, heads[0], heads[1], out)
    tokens = token_indices(pages, 4)
    expected = torch.cat(
        [as_bytes(pool[tokens][:, heads[0] : sum(heads)]).flatten() for pool in (*k, *v)]
    )
    assert torch.equal(out[:written], expected)
    assert not out[written:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_round_trip_at_odd_storage_offsets(dtype: torch.dtype) -> None:
    """Stays bit-exact when pools and staging bytes start at unaligned storage offsets."""
    generator = torch.Generator().manual_seed(3)
    backing = random_bits((1 + 2 * 12 * 2 * 4,), dtype, generator)
    k = [backing[1 : 1 + 96].view(12, 2, 4)]
    v = [backing[1 + 96 :].view(12, 2, 4)]
    staging = torch.zeros(1 + 2048, dtype=torch.uint8)
    out = staging[1:]
    written = gather_chunk(k, v, torch.tensor([2, 0]), 3, 1, 1, out)
    dst_k = [torch.zeros(12, 2, 4, dtype=dtype)]
    dst_v = [torch.zeros(12, 2, 4, dtype=dtype)]
    scatter_chunk(out[:written], dst_k, dst_v, torch.tensor([2, 0]), 3, [WriterPlacement(0, 1, 1)])
    tokens = token_indices([2, 0], 3)
    for got, want in ((dst_k[0], k[0]), (dst_v[0], v[0])):
        assert torch.equal(as_bytes(got[tokens, 1]), as_bytes(want[tokens, 1]))
        assert not as_bytes(got[tokens, 0]).any()


def test_pool_geometry_describes_pools() -> None:
    """Reports pages, heads, head_dim, element size and layers of the pools."""
    k = [torch.zeros(10, 3, 4, dtype=torch.float16)] * 2
    geometry = pool_geometry(k, k, 4)
    assert (geometry.pool_pages, geometry.num_heads, geometry.head_dim) == (2, 3, 4)
    assert (geometry.element_size, geometry.num_layers) == (2, 2)
    assert geometry.bytes_per_head_token == 8


POOL = torch.zeros(16, 2, 4, dtype=torch.float16)
PAGES = torch.tensor([1, 0])
OUT = torch.zeros(1024, dtype=torch.uint8)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gather_chunk([POOL], [], PAGES, 4, 0, 1, OUT), r"^1 K buffers but 0 V buffers$"),
        (lambda: gather_chunk([], [], PAGES, 4, 0, 1, OUT), r"^at least one layer of K and V "),
        (lambda: gather_chunk([POOL], [POOL], PAGES, 0, 0, 1, OUT), r"^page_size=0 must be >= 1$"),
        (
            lambda: gather_chunk([POOL], [POOL.float()], PAGES, 4, 0, 1, OUT),
            r"^V pool of layer 0 is \(16, 2, 4\) torch.float32, expected \(16, 2, 4\) "
            r"torch.float16",
        ),
        (
            lambda: gather_chunk([POOL[:, :, :2].contiguous()], [POOL], PAGES, 4, 0, 1, OUT),
            r"^V pool of layer 0 is \(16, 2, 4\) torch.float16, expected \(16, 2, 2\)",
        ),
        (
            lambda: gather_chunk([POOL[:, :1]], [POOL[:, :1]], PAGES, 4, 0, 1, OUT),
            r"^K pool of layer 0 is not contiguous$",
        ),
        (
            lambda: gather_chunk([POOL[0]], [POOL[0]], PAGES, 4, 0, 1, OUT),
            r"^KV pools must be \[pool_tokens, heads, head_dim\], got shape \(2, 4\)$",
        ),
        (
            lambda: gather_chunk([POOL], [POOL], PAGES, 32, 0, 1, OUT),
            r"^KV pools of shape \(16, 2, 4\) hold no whole page of page_size=32$",
        ),
        (
            lambda: gather_chunk([POOL], [POOL], PAGES.int(), 4, 0, 1, OUT),
            r"^page_indices must be a 1-D int64 tensor, got 1-D torch.int32$",
        ),
        (
            lambda: gather_chunk([POOL], [POOL], PAGES[:0], 4, 0, 1, OUT),
            r"^page_indices is empty",
        ),
        (
            lambda: gather_chunk([POOL], [POOL], torch.tensor([4]), 4, 0, 1, OUT),
            r"^page_indices range over \[4, 4\], the pools hold pages \[0, 3\]$",
        ),
        (
            lambda: gather_chunk([POOL], [POOL], torch.tensor([-1]), 4, 0, 1, OUT),
            r"^page_indices range over \[-1, -1\]",
        ),
        (
            lambda: gather_chunk([POOL], [POOL], PAGES, 4, 1, 2, OUT),
            r"^head_start=1 with num_heads=2 does not fit the pools' 2 heads$",
        ),
        (
            lambda: gather_chunk([POOL], [POOL], PAGES, 4, 0, 0, OUT),
            r"^num_heads=0 must be >= 1 \(for head_start\)$",
        ),
        (
            lambda: gather_chunk([POOL], [POOL], PAGES, 4, 0, 1, OUT.view(32, 32)),
            r"^out must be a contiguous 1-D uint8 tensor, got 2-D torch.uint8$",
        ),
        (
            lambda: gather_chunk([POOL], [POOL], PAGES, 4, 0, 1, OUT.float()),
            r"^out must be a contiguous 1-D uint8 tensor, got 1-D torch.float32$",
        ),
        (
            lambda: gather_chunk([POOL], [POOL], PAGES, 4, 0, 1, OUT[:127]),
            r"^out holds 127 bytes, the chunk needs 128$",
        ),
        (
            lambda: gather_chunk([POOL], [POOL], PAGES, 4, 0, 1, OUT[::2]),
            r"^out must be a contiguous 1-D uint8 tensor, got 1-D torch.uint8 \(not contiguous\)$",
        ),
    ],
)
def test_gather_rejects_bad_arguments(call: object, message: str) -> None:
    """Rejects inconsistent pools, pages, heads and output buffers with a clear ValueError."""
    assert callable(call)
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    ("writers", "region_bytes", "message"),
    [
        ([], 1024, r"^writers must name at least one writer$"),
        ([WriterPlacement(0, 1, 2)], 1024, r"^writers\[0\].dst_head_start=1 with num_heads=2 "),
        ([WriterPlacement(-1, 0, 1)], 1024, r"^writers\[0\] needs bytes \[-1, 127\) but region "),
        (
            [WriterPlacement(0, 0, 1), WriterPlacement(128, 1, 1)],
            255,
            r"^writers\[1\] needs bytes \[128, 256\) but region holds 255 bytes$",
        ),
    ],
)
def test_scatter_rejects_bad_writers(
    writers: list[WriterPlacement], region_bytes: int, message: str
) -> None:
    """Rejects writers that do not fit the pools' heads or the region."""
    region = torch.zeros(region_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        scatter_chunk(region, [POOL], [POOL], PAGES, 4, writers)


def test_stream_rejected_for_cpu_tensors() -> None:
    """Rejects a stream when the pools are on the CPU."""
    fake_stream: torch.cuda.Stream = object()  # type: ignore[assignment]
    with pytest.raises(
        ValueError, match=r"^stream is for CUDA tensors only, the pools are on cpu$"
    ):
        gather_chunk([POOL], [POOL], PAGES, 4, 0, 1, OUT, stream=fake_stream)


def test_backend_must_be_typed() -> None:
    """Rejects a backend given as a string instead of a KernelBackend."""
    with pytest.raises(ValueError, match=r"^backend must be a KernelBackend, got 'torch'$"):
        gather_chunk([POOL], [POOL], PAGES, 4, 0, 1, OUT, backend="torch")  # type: ignore[arg-type]
    assert gather_chunk([POOL], [POOL], PAGES, 4, 0, 1, OUT, backend=KernelBackend.TORCH) == 128


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.int64])
def test_cuda_round_trip_on_stream(dtype: torch.dtype) -> None:
    """Round-trips bit-exact on CUDA, enqueued on a side stream that waits on the current one."""
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(4)
    k = [random_bits((64, 4, 8), dtype, generator).to(device) for _ in range(3)]
    v = [random_bits((64, 4, 8), dtype, generator).to(device) for _ in range(3)]
    pages = torch.tensor([5, 1, 6], device=device)
    out = torch.zeros(1 << 16, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # untyped in torch
    written = gather_chunk(k, v, pages, 4, 2, 2, out, stream=stream)
    dst_k = [torch.zeros_like(t) for t in k]
    dst_v = [torch.zeros_like(t) for t in v]
    scatter_chunk(out, dst_k, dst_v, pages, 4, [WriterPlacement(0, 2, 2)], stream=stream)
    stream.synchronize()
    assert written == 12 * 2 * 8 * k[0].element_size() * 6
    tokens = token_indices([5, 1, 6], 4).to(device)
    for got, want in zip((*dst_k, *dst_v), (*k, *v), strict=True):
        assert torch.equal(as_bytes(got[tokens, 2:]), as_bytes(want[tokens, 2:]))
        assert not as_bytes(got[tokens, :2]).any()
