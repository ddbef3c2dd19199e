"""The seeded workload: pages, data, and the verification that catches any wrong bit."""

from __future__ import annotations

import pytest
import torch

from staging_contracts._run.workload import (
    TransferConfig,
    fill_prefill_pool,
    rank_heads,
    request_plans,
    verify_decode_pool,
)
from staging_contracts._staging.kernels import PagedKVPools


def test_rank_heads_split_and_replicate() -> None:
    """Ranks share heads contiguously, or replicate them when heads are fewer than ranks."""
    assert rank_heads(8, 4, 1) == [2, 3]
    assert rank_heads(2, 4, 0) == rank_heads(2, 4, 1) == [0]
    assert rank_heads(2, 4, 3) == [1]


def test_request_plans_are_disjoint_and_reproducible() -> None:
    """Requests occupy disjoint pages; the same seed gives the same plans."""
    config = TransferConfig(requests=3, tokens=40, page_size=8)
    plans = request_plans(config)
    pages = [p for plan in plans for p in plan.prefill_pages]
    assert len(pages) == len(set(pages)) == 3 * 5
    assert request_plans(config) == plans
    assert request_plans(TransferConfig(requests=3, tokens=40, page_size=8, seed=1)) != plans


def test_verification_accepts_the_right_heads_and_catches_one_wrong_bit() -> None:
    """A pool filled with the expected heads verifies; one flipped element is reported."""
    config = TransferConfig(
        prefill_tp=2,
        decode_tp=2,
        kv_heads=4,
        layers=2,
        head_dim=8,
        tokens=32,
        page_size=4,
        requests=2,
    )
    # With P == D, a decode rank expects exactly what the same prefill rank holds, but on
    # decode's pages: copy page by page.
    plans = request_plans(config)
    for rank in range(2):
        prefill = config.empty_pool(2, rank)
        fill_prefill_pool(prefill, config, rank)
        decode = config.empty_pool(2, rank)
        for plan in plans:
            for src, dst in zip(plan.prefill_pages, plan.decode_pages, strict=True):
                rows_src = slice(src * 4, src * 4 + 4)
                rows_dst = slice(dst * 4, dst * 4 + 4)
                for layer in range(2):
                    decode.k_buffers[layer][rows_dst] = prefill.k_buffers[layer][rows_src]
                    decode.v_buffers[layer][rows_dst] = prefill.v_buffers[layer][rows_src]
        assert verify_decode_pool(decode, config, rank) == []
        row = plans[1].decode_pages[0] * 4
        bits = decode.v_buffers[1].view(torch.int16)
        bits[row, 0, 0] ^= 1
        assert verify_decode_pool(decode, config, rank) == [
            f"request 1 layer 1 V head {2 * rank}: 1 elements differ"
        ]
        assert verify_decode_pool(decode, config, rank, requests={0}) == []


@pytest.mark.parametrize("separate", [False, True], ids=["one allocation", "per layer"])
def test_empty_pool_is_one_allocation_unless_layers_are_separate(separate: bool) -> None:
    """Every K and V pool is a view of one zeroed buffer, or each its own allocation."""
    config = TransferConfig(layers=3, tokens=32, page_size=8, separate_layers=separate)
    pool = config.empty_pool(4, 1)
    every = [*pool.k_buffers, *pool.v_buffers]
    storages = {t.untyped_storage().data_ptr() for t in every}
    assert len(storages) == (6 if separate else 1)
    assert all(t.shape == (config.pool_pages * 8, 2, 128) and not t.any() for t in every)
    assert (PagedKVPools(pool.k_buffers, pool.v_buffers, 8).fused() is None) == separate


def test_invalid_config_is_rejected() -> None:
    """Non-positive sizes and unknown dtypes are ValueErrors naming the field."""
    with pytest.raises(ValueError, match=r"^tokens=0 must be >= 1$"):
        TransferConfig(tokens=0)
    with pytest.raises(ValueError, match=r"^dtype='fp8' is not one of"):
        TransferConfig(dtype="fp8")  # type: ignore[arg-type]  # the mistake under test
