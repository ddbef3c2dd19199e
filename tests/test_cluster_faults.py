"""run_cluster when a rank dies: the others are stopped at once and the result says who died,
how, and what the others had done."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from staging_contracts._cluster._messages import RankSummary, Ready, RequestDone
from staging_contracts._cluster.runner import ClusterResult, RankExit, RankReport, run_cluster
from staging_contracts._run._codec import RankEvent
from staging_contracts._run.workload import TransferConfig
from staging_contracts.engines import engine_available

NIXL_OK, NIXL_WHY = engine_available("nixl")


def tiny_config() -> TransferConfig:
    """One prefill and one decode rank, one small request: the run is mostly start-up."""
    return TransferConfig(
        backend="nixl",
        prefill_tp=1,
        decode_tp=1,
        kv_heads=2,
        layers=1,
        head_dim=16,
        tokens=32,
        page_size=16,
        requests=1,
        chunk_tokens=16,
        ring_chunks=2,
    )


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_a_rank_killed_mid_run_is_named_and_the_survivor_is_stopped_at_once() -> None:
    """SIGKILL one rank as soon as it is ready: run_cluster returns within seconds, names
    that rank and its signal, and holds the survivor's own report of where it stopped."""
    killed_at: list[float] = []

    def kill_decode_when_ready(got: RankEvent) -> None:
        if isinstance(got.message, Ready) and got.role == "decode" and not killed_at:
            os.kill(got.pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    result = run_cluster(tiny_config(), progress=kill_decode_when_ready, timeout_s=60)
    returned_after_s = time.monotonic() - killed_at[0]

    assert returned_after_s < 8.0  # REPORT_GRACE_S + the survivor's own shutdown, not 30 s+
    death = result.first_death
    assert death is not None
    assert (death.role, death.rank, death.exitcode, death.signal) == ("decode", 0, -9, "SIGKILL")
    assert death.reason == "killed by SIGKILL without a report"
    assert result.stopped == (("prefill", 0),)
    assert result.killed == ()
    assert not result.timed_out
    assert not result.all_ok

    (decode,) = result.ranks("decode")
    assert not decode.ok
    assert decode.signal == "SIGKILL"
    assert decode.fields.error == "no report (the process died or timed out)"
    (prefill,) = result.ranks("prefill")
    assert prefill.stopped
    assert prefill.exitcode == 0  # it closed its engine and returned
    assert prefill.fields.error == "RankStopped: stopped by the driver (SIGTERM)"
    assert prefill.fields.phase == "running requests"
    assert multiprocessing.active_children() == []


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_a_rank_killed_after_the_transfer_leaves_the_survivors_report_whole() -> None:
    """SIGKILL the prefill rank once decode finished its request: the decode rank's own
    report (verified pages, or where it stopped) is in the result, not lost."""
    killed_at: list[float] = []
    prefill_pid: list[int] = []

    def kill_prefill_after_the_room(got: RankEvent) -> None:
        if isinstance(got.message, Ready) and got.role == "prefill":
            prefill_pid.append(got.pid)
        if isinstance(got.message, RequestDone) and got.role == "decode" and not killed_at:
            os.kill(prefill_pid[0], signal.SIGKILL)
            killed_at.append(time.monotonic())

    result = run_cluster(tiny_config(), progress=kill_prefill_after_the_room, timeout_s=60)

    assert time.monotonic() - killed_at[0] < 8.0
    death = result.first_death
    assert death is not None
    assert (death.role, death.rank, death.signal) == ("prefill", 0, "SIGKILL")
    (decode,) = result.ranks("decode")
    assert decode.fields.error != "no report (the process died or timed out)"
    if decode.ok:  # it finished before the driver saw the death
        assert decode.fields.verified
        assert decode.fields.succeeded == (0,)
    else:  # it was told to stop while closing: it says what it had done
        assert decode.stopped
        assert decode.fields.rooms == {0: True}
    assert multiprocessing.active_children() == []


def test_rank_exit_says_why_a_rank_died() -> None:
    """A death reads as its signal, its exit code, or the failure the rank reported."""
    assert RankExit("decode", 1, -9, None).reason == "killed by SIGKILL without a report"
    assert RankExit("decode", 1, -15, None).signal == "SIGTERM"
    assert RankExit("prefill", 0, 3, None).reason == "exited with code 3 without a report"
    assert RankExit("prefill", 0, 3, None).signal is None
    failed = RankExit("prefill", 0, 0, "TimeoutError: rooms")
    assert failed.reason == "reported a failure: TimeoutError: rooms"
    report = RankReport("decode", 0, False, RankSummary(stopped=True), -6)
    assert report.stopped
    assert report.signal == "SIGABRT"
    assert RankReport("decode", 0, True, RankSummary(), 0).signal is None


def test_a_result_without_a_death_says_so() -> None:
    """The new fields default to a run in which no rank died."""
    result = ClusterResult(tiny_config(), (), 0.0)
    assert result.first_death is None
    assert (result.stopped, result.killed, result.timed_out) == ((), (), False)
