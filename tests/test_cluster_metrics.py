"""Per-request clocks and memory of a run: each rank's peak RSS, prefill's first STAGING_REQ
and decode's completion of every room, and what ClusterResult derives from them."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from staging_contracts.backends.kv_requests import KVPoll
from staging_contracts.cluster.rank import FirstRequestClock, _wait_all, peak_rss_bytes
from staging_contracts.cluster.runner import ClusterResult, RankReport, run_cluster
from staging_contracts.cluster.workload import TransferConfig
from staging_contracts.control.transport import PeerSockets
from staging_contracts.control.wire import StagingReq, WatermarkUpdate
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
    assert result.verified, [r.fields.get("trace") for r in result.reports]
    for role in ("prefill", "decode"):
        rss = result.peak_rss_bytes(role)
        assert sorted(rss) == [0, 1]
        assert all(value > 50 << 20 for value in rss.values())  # torch alone is more
    indexes = [str(i) for i in range(config.requests)]
    for report in result.ranks("prefill"):
        stamps = report.fields["room_first_request_s"]
        assert sorted(stamps) == indexes
        assert all(report.fields["start"] <= t <= report.fields["end"] for t in stamps.values())
    for report in result.ranks("decode"):
        stamps = report.fields["room_done_s"]
        assert sorted(stamps) == indexes
        assert all(report.fields["start"] <= t <= report.fields["end"] for t in stamps.values())
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
        RankReport("prefill", 0, True, {"room_first_request_s": {"0": 10.0, "1": 11.0}}, 0),
        RankReport(
            "prefill", 1, True, {"room_first_request_s": {"0": 9.5, "1": 11.5, "2": 12.0}}, 0
        ),
    ]
    decode = [
        RankReport("decode", 0, True, {"room_done_s": {"0": 12.0, "1": 14.0, "2": 15.0}}, 0),
        RankReport("decode", 1, True, {"room_done_s": {"0": 12.5, "1": 13.0, "2": 16.0}}, 0),
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
        RankReport("decode", 1, True, {"peak_rss_bytes": 300, "ring_peak": 5, "ring_size": 8}, 0),
        RankReport("decode", 0, False, {"error": "died"}, -9),
        RankReport("prefill", 0, True, {"peak_rss_bytes": 200}, 0),
    )
    result = ClusterResult(config, reports, 1.0)
    assert result.peak_rss_bytes("decode") == {1: 300}
    assert result.peak_rss_bytes("prefill") == {0: 200}
    assert result.ring_peaks() == {1: (5, 8)}


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

    def report(kind: str, **fields: object) -> None:
        assert kind == "room"
        events.append(int(str(fields["index"])))
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
