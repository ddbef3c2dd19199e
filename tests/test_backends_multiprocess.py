"""Real backends moving real bytes between real processes: Mooncake (TCP) and NIXL (UCX)."""

from __future__ import annotations

import multiprocessing

import pytest

from staging_contracts._cluster.runner import ClusterResult, run_cluster
from staging_contracts._run.workload import TransferConfig
from staging_contracts.engines import engine_available

ENGINES = [
    pytest.param(
        "mooncake",
        marks=[
            pytest.mark.mooncake,
            pytest.mark.skipif(
                not engine_available("mooncake")[0], reason=engine_available("mooncake")[1]
            ),
        ],
    ),
    pytest.param(
        "nixl",
        marks=[
            pytest.mark.nixl,
            pytest.mark.skipif(not engine_available("nixl")[0], reason=engine_available("nixl")[1]),
        ],
    ),
]
TP_PAIRS = [
    pytest.param(4, 2, 8, id="P4-D2-8heads"),
    pytest.param(1, 4, 2, id="P1-D4-2heads-gqa"),
    pytest.param(2, 4, 8, id="P2-D4-8heads"),
    pytest.param(4, 1, 2, id="P4-D1-2heads"),
]


def small_config(
    backend: str, prefill_tp: int, decode_tp: int, heads: int, page_size: int, **kw: object
) -> TransferConfig:
    """Multi-chunk requests small enough for a 2-core machine; a ring that must wrap."""
    return TransferConfig(
        backend=backend,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        kv_heads=heads,
        layers=2,
        head_dim=16,
        tokens=48,
        page_size=page_size,
        requests=3,
        chunk_tokens=16,
        ring_chunks=2,
        **kw,  # type: ignore[arg-type]  # fields of TransferConfig
    )


def assert_clean(result: ClusterResult) -> None:
    """Every rank exited 0 and left no ring region or registered memory behind."""
    for report in result.reports:
        assert report.ok, (report.role, report.rank, report.fields.trace)
        assert report.exitcode == 0, (report.role, report.rank, report.exitcode)
        assert report.fields.registered_after == 0, (report.role, report.rank)
    for report in result.ranks("decode"):
        assert report.fields.ring_live_after == 0
        assert report.fields.malformed == 0
    assert multiprocessing.active_children() == []


# Every TP pair with 16-token pages; token-sized pages (one page per token, the most
# regions per chunk) on the two pairs that gather (P > D) and scatter (P < D) the most.
PAGED_PAIRS = [pytest.param(16, *pair.values, id=f"16-{pair.id}") for pair in TP_PAIRS] + [
    pytest.param(1, *pair.values, id=f"1-{pair.id}")
    for pair in TP_PAIRS
    if pair.id in ("P4-D2-8heads", "P1-D4-2heads-gqa")
]


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize(("page_size", "prefill_tp", "decode_tp", "heads"), PAGED_PAIRS)
def test_staged_transfer_between_processes_is_bit_exact(
    backend: str, prefill_tp: int, decode_tp: int, heads: int, page_size: int
) -> None:
    """Three concurrent multi-chunk requests land bit-exact in every decode rank's pool."""
    config = small_config(backend, prefill_tp, decode_tp, heads, page_size)
    result = run_cluster(config, timeout_s=180)
    assert_clean(result)
    assert result.verified, [r.fields.problems for r in result.ranks("decode")]
    assert result.failed_requests == frozenset()
    chunks_per_request = -(-config.num_pages // config.chunk_pages)
    assert chunks_per_request >= 2
    assert result.chunks == config.requests * chunks_per_request * decode_tp
    expected = config.requests * config.request_bytes
    assert result.bytes_moved >= expected  # replicated heads (GQA) are sent more than once


@pytest.mark.parametrize("backend", ENGINES)
def test_pools_allocated_layer_by_layer_transfer_bit_exact(backend: str) -> None:
    """Pools allocated one per layer and K/V (the kernels' per-layer path, SGLang's layout)
    land as bit-exact as views of one KV cache allocation."""
    config = small_config(backend, 2, 4, 8, 16, separate_layers=True)
    result = run_cluster(config, timeout_s=180)
    assert_clean(result)
    assert result.verified, [r.fields.problems for r in result.ranks("decode")]


@pytest.mark.parametrize("backend", ENGINES)
def test_engine_write_error_fails_that_request_only(backend: str) -> None:
    """A prefill write outside the decode ring fails request 1; requests 0 and 2 verify."""
    config = small_config(backend, 2, 1, 4, 16, fail_rooms=(1,))
    result = run_cluster(config, timeout_s=180)
    assert_clean(result)
    assert result.failed_requests == frozenset({1})
    (decode,) = result.ranks("decode")
    assert decode.fields.succeeded == (0, 2)
    assert decode.fields.verified
    assert "prefill failed the room" in str(decode.fields.failed[1])
    prefill0 = result.ranks("prefill")[0]
    assert "engine write failed" in str(prefill0.fields.failed[1])
    assert not result.verified
