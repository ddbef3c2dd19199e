"""Head-slice gathers by both CPU paths: token rows (the default on CPU) and page rows (the
CUDA path, ``KernelBackend.TORCH_ONLY``) write the same bytes, those of the SPEC layout."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from staging_contracts._staging.kernels import KernelBackend, PagedKVPools
from tests.test_kernels import as_bytes, random_bits, token_indices

PAGE_SIZE, POOL_PAGES, LAYERS = 4, 9, 2
PAGES = [6, 0, 3, 8]

# (dtype, heads, head_dim, head_start, num_heads): words of 8, 4, 2 and 1 bytes, slices at
# the start, the middle and the end of a token row, and every head (whole page rows).
SLICES = [
    (torch.bfloat16, 4, 8, 1, 2),
    (torch.float32, 2, 2, 1, 1),
    (torch.float16, 4, 3, 0, 2),
    (torch.float8_e4m3fn, 2, 3, 1, 1),
    (torch.bfloat16, 4, 8, 0, 4),
]


def pools_for(
    fused: bool, dtype: torch.dtype, heads: int, head_dim: int
) -> tuple[PagedKVPools, list[torch.Tensor]]:
    """K then V pools of random bytes (views of one allocation, or one allocation each),
    prepared and as the list of K pools then V pools."""
    generator = torch.Generator().manual_seed(11)
    shape = (POOL_PAGES * PAGE_SIZE, heads, head_dim)
    if fused:
        backing = random_bits((2, LAYERS, *shape), dtype, generator)
        k, v = list(backing[0].unbind()), list(backing[1].unbind())
    else:
        k = [random_bits(shape, dtype, generator) for _ in range(LAYERS)]
        v = [random_bits(shape, dtype, generator) for _ in range(LAYERS)]
    return PagedKVPools(k, v, PAGE_SIZE), [*k, *v]


@pytest.mark.parametrize("fused", [True, False], ids=["one allocation", "one per pool"])
@pytest.mark.parametrize(
    "backend", [KernelBackend.TORCH, KernelBackend.TORCH_ONLY], ids=["token rows", "page rows"]
)
@pytest.mark.parametrize("case", SLICES, ids=lambda c: f"{c[0]}-{c[3]}+{c[4]}of{c[1]}")
def test_head_slice_gather_follows_the_layout(
    fused: bool, backend: KernelBackend, case: tuple[torch.dtype, int, int, int, int]
) -> None:
    """K of every layer, then V, each [tokens, slice heads, head_dim] in page order, and no
    byte after them, by either path and for every word size."""
    dtype, heads, head_dim, head_start, num_heads = case
    pools, every = pools_for(fused, dtype, heads, head_dim)
    if fused:
        assert pools.fused() is not None
    out = torch.zeros(1 << 12, dtype=torch.uint8)
    written = pools.gather(torch.tensor(PAGES), head_start, num_heads, out, backend=backend)
    tokens = token_indices(PAGES, PAGE_SIZE)
    end = head_start + num_heads
    expected = torch.cat([as_bytes(pool[tokens][:, head_start:end]).flatten() for pool in every])
    assert written == expected.numel()
    assert torch.equal(out[:written], expected)
    assert not out[written:].any()


@pytest.mark.parametrize("fused", [True, False], ids=["one allocation", "one per pool"])
@pytest.mark.parametrize(
    ("backend", "heads", "dims"),
    [
        (KernelBackend.TORCH, (1, 2), 2),
        (KernelBackend.TORCH_ONLY, (1, 2), 3),
        (KernelBackend.TORCH, (0, 4), 2),
    ],
    ids=["slice on cpu: token rows", "slice, torch only: page rows", "every head: flat pages"],
)
def test_gather_indexes_token_rows_only_for_a_cpu_head_slice(
    monkeypatch: pytest.MonkeyPatch,
    fused: bool,
    backend: KernelBackend,
    heads: tuple[int, int],
    dims: int,
) -> None:
    """A head slice on CPU indexes 2-D token rows (one memcpy per token's heads); the
    torch-only (CUDA) path keeps 3-D page rows; every head keeps flat page rows (2-D, one
    row per page)."""
    pools, _ = pools_for(fused, torch.bfloat16, 4, 8)
    seen: list[tuple[int, int]] = []
    real: Callable[..., torch.Tensor] = torch.index_select

    def recording(source: torch.Tensor, dim: int, index: torch.Tensor, **kw: object) -> object:
        seen.append((source.dim(), index.numel()))
        return real(source, dim, index, **kw)

    monkeypatch.setattr(torch, "index_select", recording)
    out = torch.zeros(1 << 12, dtype=torch.uint8)
    pools.gather(torch.tensor(PAGES), heads[0], heads[1], out, backend=backend)
    pools_per_op = 2 * LAYERS if fused else 1
    rows = len(PAGES) * pools_per_op * (PAGE_SIZE if dims == 2 and heads[1] < 4 else 1)
    assert seen == [(dims, rows)] * (1 if fused else 2 * LAYERS)
