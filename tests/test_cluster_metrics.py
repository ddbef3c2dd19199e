"""Per-request clocks and memory of a run: what each rank held as the transfer ended (peak
RSS from the timed requests to the done barrier, RSS then, the CUDA allocator's peak),
prefill's first STAGING_REQ and decode's completion of every room, and what ClusterResult
derives from them."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

import pytest
import torch

from staging_contracts._cluster._messages import RankMemory, RankSummary, RequestDone
from staging_contracts._cluster.rank import (
    FirstRequestClock,
    TransferMemory,
    _wait_all,
    peak_rss_bytes,
    reset_peak_rss,
    rss_status,
)
from staging_contracts._cluster.runner import ClusterResult, RankReport, run_cluster
from staging_contracts._control.transport import PeerSockets
from staging_contracts._control.wire import StagingReq, WatermarkUpdate
from staging_contracts._run._codec import Message
from staging_contracts._run.workload import TransferConfig
from staging_contracts.backends._kv_requests import KVPoll
from staging_contracts.engines import engine_available

NIXL_OK, NIXL_WHY = engine_available("nixl")


def small_config(**kw: object) -> TransferConfig:
    """Two prefill ranks, two decode ranks, three multi-chunk requests."""
    return TransferConfig(
        backend="nixl",
        prefill_tp=2,
        decode_tp=2,
        kv_heads=4,
        layers=2,
        head_dim=16,
        tokens=48,
        page_size=16,
        requests=3,
        chunk_tokens=16,
        ring_chunks=2,
        **kw,  # type: ignore[arg-type]  # fields of TransferConfig
    )


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_every_rank_reports_its_peak_rss_and_every_request_its_clocks() -> None:
    """A real run: peak RSS per rank, a first-request stamp per room on every prefill rank,
    a done stamp per room on every decode rank, and latencies that lie inside the run."""
    config = small_config()
    result = run_cluster(config, timeout_s=180)
    assert result.verified, [r.fields.trace for r in result.reports]
    for role in ("prefill", "decode"):
        rss = result.peak_rss_bytes(role)
        assert sorted(rss) == [0, 1]
        assert all(value > 50 << 20 for value in rss.values())  # torch alone is more
        memory = result.transfer_memory(role)
        assert sorted(memory) == [0, 1]
        for rank, held in memory.items():
            assert held.rss_at_done_bytes is not None
            assert 50 << 20 < held.rss_at_done_bytes <= held.peak_rss_before_verify_bytes
            assert held.peak_rss_before_verify_bytes <= rss[rank]
            assert held.cuda_max_allocated_bytes is None
    indexes = list(range(config.requests))
    for report in result.reports:
        fields = report.fields
        stamps = fields.room_first_request_s if report.role == "prefill" else fields.room_done_s
        assert sorted(stamps) == indexes
        assert fields.start is not None
        assert fields.end is not None
        assert all(fields.start <= t <= fields.end for t in stamps.values())
    latencies = result.request_latencies_s()
    assert sorted(latencies) == list(range(config.requests))
    assert all(0 < s <= result.elapsed_s for s in latencies.values())
    peaks = result.ring_peaks()
    assert sorted(peaks) == [0, 1]
    assert all(peak > 0 and size > 0 for peak, size in peaks.values())


def test_latencies_take_the_earliest_request_and_the_latest_completion() -> None:
    """Per request: latest decode stamp minus earliest prefill stamp; failed requests and
    requests a rank did not stamp are left out."""
    config = TransferConfig(requests=3)
    prefill = [
        RankReport("prefill", 0, True, RankSummary(room_first_request_s={0: 10.0, 1: 11.0}), 0),
        RankReport(
            "prefill", 1, True, RankSummary(room_first_request_s={0: 9.5, 1: 11.5, 2: 12.0}), 0
        ),
    ]
    decode = [
        RankReport("decode", 0, True, RankSummary(room_done_s={0: 12.0, 1: 14.0, 2: 15.0}), 0),
        RankReport("decode", 1, True, RankSummary(room_done_s={0: 12.5, 1: 13.0, 2: 16.0}), 0),
    ]
    result = ClusterResult(config, (*decode, *prefill), 7.0)
    assert result.request_latencies_s() == {0: 3.0, 1: 3.0}
    failed = ClusterResult(config, (*decode, *prefill), 7.0, frozenset({1}))
    assert failed.request_latencies_s() == {0: 3.0}
    assert ClusterResult(config, tuple(decode), 7.0, side="decode").request_latencies_s() == {}


def test_peak_rss_and_ring_peaks_by_rank() -> None:
    """Ranks that did not report a figure (a dead rank) are left out."""
    config = TransferConfig()
    reports = (
        RankReport("decode", 1, True, RankSummary(peak_rss_bytes=300, ring_peak=5, ring_size=8), 0),
        RankReport("decode", 0, False, RankSummary(error="died"), -9),
        RankReport("prefill", 0, True, RankSummary(peak_rss_bytes=200), 0),
    )
    result = ClusterResult(config, reports, 1.0)
    assert result.peak_rss_bytes("decode") == {1: 300}
    assert result.peak_rss_bytes("prefill") == {0: 200}
    assert result.ring_peaks() == {1: (5, 8)}


def test_transfer_memory_by_rank() -> None:
    """What each rank reported at the done barrier, by rank; ranks without it are left out."""
    config = TransferConfig()
    reports = (
        RankReport(
            "decode",
            0,
            True,
            RankSummary(memory=RankMemory(300, "timed requests", 250, 70)),
            0,
        ),
        RankReport("decode", 1, False, RankSummary(error="died"), -9),
        RankReport("prefill", 0, True, RankSummary(memory=RankMemory(200, "process start")), 0),
    )
    result = ClusterResult(config, reports, 1.0)
    assert result.transfer_memory("decode") == {0: RankMemory(300, "timed requests", 250, 70)}
    assert result.transfer_memory("prefill") == {0: RankMemory(200, "process start", None, None)}


def _touch(nbytes: int) -> bytearray:
    block = bytearray(nbytes)
    block[:: 1 << 12] = b"\x01" * len(block[:: 1 << 12])  # touch every page
    return block


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_the_transfer_peak_leaves_out_what_was_freed_before_the_timed_requests() -> None:
    """A 256 MiB temporary (as filling a pool or the raw source's concatenation makes) freed
    before the timed requests begin counts in the whole-life peak, not in the peak the rank
    reports at the done barrier; memory held across the transfer does count."""
    if not reset_peak_rss():
        pytest.skip("cannot reset the peak RSS here")
    held = _touch(32 << 20)
    temporary = _touch(256 << 20)
    del temporary
    _, before = rss_status()  # the peak so far: the temporary's
    assert before is not None
    memory = TransferMemory(TransferConfig())
    fields = memory.at_done()
    rss, _ = rss_status()
    assert rss is not None
    assert fields.peak_rss_from == "timed requests"
    assert fields.rss_at_done_bytes is not None
    assert fields.rss_at_done_bytes >= len(held)
    assert fields.peak_rss_before_verify_bytes < before - (128 << 20)
    assert fields.peak_rss_before_verify_bytes < rss + (128 << 20)
    assert fields.cuda_max_allocated_bytes is None
    del held


def test_on_cuda_the_allocator_peak_is_reset_at_the_start_and_read_at_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stand-in for a GPU: the allocator's peak of the rank's device is reset as the timed
    requests begin and read at the done barrier."""
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(TransferConfig, "torch_device", property(lambda self: "cuda:3"))
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda device: calls.append(("reset", device))
    )

    def max_allocated(device: object) -> int:
        calls.append(("max", device))
        return 7 << 20

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", max_allocated)
    memory = TransferMemory(TransferConfig(device="cuda"))
    assert calls == [("reset", "cuda:3")]
    assert memory.at_done().cuda_max_allocated_bytes == 7 << 20
    assert calls == [("reset", "cuda:3"), ("max", "cuda:3")]


def test_peak_rss_of_this_process_is_in_bytes() -> None:
    """At least the memory this process holds right now (KiB from getrusage are scaled)."""
    block = bytearray(64 << 20)
    block[:: 1 << 12] = b"\x01" * len(block[:: 1 << 12])  # touch every page
    assert peak_rss_bytes() > len(block)


class _Gate:
    """A request that ends (with ``state``) when the test opens its gate."""

    def __init__(self, state: KVPoll) -> None:
        self.state = state
        self.gate = threading.Event()

    def wait(self, timeout_s: float) -> KVPoll:
        return self.state if self.gate.wait(timeout_s) else KVPoll.Transferring


def test_each_request_is_stamped_when_it_ends_not_when_its_turn_comes() -> None:
    """Requests ending in reverse order are reported and stamped in that order: the stamp of
    request 0 (waited for first by index) is the last, not the first."""
    requests = {0: _Gate(KVPoll.Success), 1: _Gate(KVPoll.Failed), 2: _Gate(KVPoll.Success)}
    events: list[int] = []

    def report(event: Message) -> None:
        assert isinstance(event, RequestDone)
        events.append(event.index)
        if len(events) < len(requests):  # open the next gate only once this one is reported
            requests[2 - len(events)].gate.set()

    requests[2].gate.set()
    outcome, at = _wait_all(requests, report, timeout_s=30)
    assert events == [2, 1, 0]
    assert outcome == {0: KVPoll.Success, 1: KVPoll.Failed, 2: KVPoll.Success}
    assert at[2] <= at[1] <= at[0]


def test_a_request_that_does_not_end_times_out() -> None:
    """The bound holds: a request still transferring at the timeout raises."""
    with pytest.raises(TimeoutError, match=r"\[0\]"):
        _wait_all({0: _Gate(KVPoll.Success)}, lambda kind, **f: None, timeout_s=0.05)


class _Raising:
    """A request whose wait raises (a closed manager's, say)."""

    def wait(self, timeout_s: float) -> KVPoll:
        raise RuntimeError("PeerSockets is closed")


def test_a_request_whose_wait_raises_is_reported_failed_and_the_others_still_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A waiter thread survives its request's exception: the request counts as failed (with
    the traceback logged), instead of the rank waiting for it until the timeout."""
    ends = _Gate(KVPoll.Success)
    ends.gate.set()
    requests: dict[int, _Raising | _Gate] = {0: _Raising(), 1: ends}
    reported: list[tuple[int, bool]] = []

    def report(event: Message) -> None:
        assert isinstance(event, RequestDone)
        reported.append((event.index, event.ok))

    outcome, _ = _wait_all(requests, report, timeout_s=30)
    assert outcome == {0: KVPoll.Failed, 1: KVPoll.Success}
    assert sorted(reported) == [(0, False), (1, True)]
    assert "waiting for request 0 raised" in caplog.text


class _Recorder(PeerSockets):
    """Peer sockets that record instead of sending."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, list[bytes]]] = []

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool:
        self.sent.append((endpoint, list(frames)))
        return True


def test_first_request_clock_stamps_each_rooms_first_staging_req_once() -> None:
    """Only STAGING_REQ stamps, once per room; every message still goes out unchanged."""
    peers = _Recorder()
    clock = FirstRequestClock(peers)
    first = StagingReq(1001, 0, 4, "decode-0").to_frames()
    other = WatermarkUpdate(3, 100, "decode-0").to_frames()
    peers.send("tcp://a", other)
    assert clock.first == {}
    peers.send("tcp://a", first)
    stamp = clock.first[1001]
    peers.send("tcp://b", StagingReq(1001, 1, 4, "decode-1").to_frames())
    peers.send("tcp://b", StagingReq(1002, 0, 4, "decode-1").to_frames())
    assert clock.first[1001] == stamp
    assert sorted(clock.first) == [1001, 1002]
    assert [frames for _, frames in peers.sent][:2] == [other, first]
    assert len(peers.sent) == 4
    peers.close()
