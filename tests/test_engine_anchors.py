"""The benchmark's engine anchors: raw bulk writes and per-token slices, bytes checked."""

from __future__ import annotations

import pytest
import torch

from staging_contracts.bench import _anchor_peers as peers
from staging_contracts.bench.anchor_geometry import BENCH_GEOMETRY, AnchorGeometry
from staging_contracts.bench.engine_anchors import (
    ENGINE_ENV,
    ENGINE_OPTIONS,
    MOONCAKE_MAX_TRANSFERS_PER_WRITE,
    AnchorJob,
    default_tokens,
    measure_anchor,
    per_token_batch,
    per_token_seconds,
    raw_write_seconds,
)
from staging_contracts.engines import engine_available

MOONCAKE_OK, MOONCAKE_WHY = engine_available("mooncake")
NIXL_OK, NIXL_WHY = engine_available("nixl")

ENGINES = [
    pytest.param("local", id="local"),
    pytest.param(
        "mooncake",
        marks=[pytest.mark.mooncake, pytest.mark.skipif(not MOONCAKE_OK, reason=MOONCAKE_WHY)],
        id="mooncake",
    ),
    pytest.param(
        "nixl",
        marks=[pytest.mark.nixl, pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)],
        id="nixl",
    ),
]

# Two layers, a partial last page: P > D (2 heads into 4) and P < D (4 heads into 2).
SMALL_P_GT_D = AnchorGeometry(2, 2, 4, 16, 2, tokens=40, page_size=4)
SMALL_P_LT_D = AnchorGeometry(2, 4, 2, 16, 2, tokens=40, page_size=4)
TIMEOUT_S = 60.0


def test_bench_geometry_is_the_request_share() -> None:
    """The bench geometry sends 512-byte slices at head offset 2, 128 MiB per prefill rank."""
    assert BENCH_GEOMETRY.slice_bytes == 512
    assert BENCH_GEOMETRY.head_offsets_bytes == (0, 512)
    assert BENCH_GEOMETRY.share_bytes() == 128 << 20
    assert 4 * BENCH_GEOMETRY.share_bytes() == 512 << 20
    assert SMALL_P_LT_D.head_offsets_bytes == (64, 0)


def test_geometry_rejects_heads_that_do_not_divide() -> None:
    """Head counts where neither divides the other, and empty sizes, raise ValueError."""
    with pytest.raises(ValueError, match="multiple of the smaller"):
        AnchorGeometry(2, 3, 4, 16, 2, tokens=8)
    with pytest.raises(ValueError, match=r"^layers=0 must be >= 1$"):
        AnchorGeometry(0, 2, 4, 16, 2, tokens=8)


def test_per_token_plan_writes_each_slice_once() -> None:
    """The plan has one slice per (K/V, layer, token), to distinct rows, in calls of N."""
    job = AnchorJob(
        "local", "per-token", 1, geometry=SMALL_P_GT_D, tokens=37, transfers_per_write=10
    )
    writes = peers.plan_writes(job, 1 << 20, 1 << 30)
    transfers = [t for call in writes for t in call]
    assert [len(call) for call in writes] == [10] * 14 + [8]
    assert len(transfers) == 2 * 2 * 37
    assert {t.length for t in transfers} == {SMALL_P_GT_D.slice_bytes}
    assert len({t.remote for t in transfers}) == len(transfers)
    assert all((t.remote - (1 << 30)) % SMALL_P_GT_D.decode_row_bytes == 64 for t in transfers)


def test_batching_and_default_tokens_per_engine() -> None:
    """NIXL sends the whole request in one call; Mooncake a subset, a call per layer buffer."""
    assert per_token_batch("nixl", 4096) == 0
    assert per_token_batch("mooncake", 512) == 512
    assert per_token_batch("mooncake", 4096) == MOONCAKE_MAX_TRANSFERS_PER_WRITE
    assert per_token_batch("local", 300) == 300
    assert default_tokens("nixl") == default_tokens("local") == BENCH_GEOMETRY.tokens
    assert default_tokens("mooncake") == 512
    assert default_tokens("mooncake", SMALL_P_GT_D) == SMALL_P_GT_D.tokens


def test_check_target_finds_a_wrong_byte() -> None:
    """The receiver's check accepts the expected pool and rejects one changed byte."""
    job = AnchorJob("local", "per-token", 1, geometry=SMALL_P_GT_D, tokens=37, verify=True)
    target = peers.expected_target(job).clone()
    assert peers.check_target(job, target)
    written = int(torch.nonzero(target).flatten()[0])
    target[written] ^= 0xFF
    assert not peers.check_target(job, target)


@pytest.mark.parametrize("engine", ENGINES)
def test_raw_write_lands_and_times(engine: str) -> None:
    """A raw bulk write of a few MiB returns positive seconds, its bytes verified."""
    seconds = raw_write_seconds(
        engine, 3 << 20, repeats=2, verify=True, max_transfer_bytes=1 << 20, timeout_s=TIMEOUT_S
    )
    assert seconds > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_per_token_slices_land_in_the_decode_rows(engine: str) -> None:
    """Per-token slices land at the right decode rows and head offset, bytes counted."""
    job = AnchorJob(
        engine,
        "per-token",
        repeats=2,
        geometry=SMALL_P_GT_D,
        tokens=37,
        transfers_per_write=per_token_batch(engine, 37),
        verify=True,
        options=ENGINE_OPTIONS[engine],
        env=ENGINE_ENV.get(engine, {}),
        timeout_s=TIMEOUT_S,
    )
    found = measure_anchor(job)
    assert found.verified is True
    assert found.seconds > 0
    assert found.nbytes == SMALL_P_GT_D.share_bytes(37) == 2 * 2 * 37 * 64
    assert found.transfers == 2 * 2 * 37
    assert found.writes == (1 if engine == "nixl" else 4)


def test_per_token_with_more_heads_on_prefill_verifies() -> None:
    """With P < D the slice comes from a head offset of the prefill row, bytes verified."""
    seconds, nbytes = per_token_seconds(
        "local", SMALL_P_LT_D, tokens=40, repeats=1, verify=True, timeout_s=TIMEOUT_S
    )
    assert seconds > 0
    assert nbytes == SMALL_P_LT_D.share_bytes()


@pytest.mark.mooncake
@pytest.mark.skipif(not MOONCAKE_OK, reason=MOONCAKE_WHY)
def test_a_failing_child_raises_with_its_reason() -> None:
    """A child that cannot build its engine makes the anchor raise RuntimeError with why."""
    with pytest.raises(RuntimeError, match=r"(?s)raw anchor over mooncake: the \w+ failed.*bogus"):
        raw_write_seconds("mooncake", 4096, repeats=1, options={"bogus": 1}, timeout_s=TIMEOUT_S)


def test_unknown_engine_is_a_value_error() -> None:
    """An engine the anchors do not know raises ValueError before anything starts."""
    with pytest.raises(ValueError, match="unknown engine 'ucx'"):
        raw_write_seconds("ucx", 4096)
