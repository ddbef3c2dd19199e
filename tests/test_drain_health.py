"""Operators: ``manager.health()`` and ``manager.close(drain_s=...)`` on real transfers
(LocalKVManagers, ZMQ on loopback, the local engine's copies)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from staging_contracts.backends._common import CommonKVManager
from staging_contracts.backends._drain import DRAINING_REFUSAL, DrainResult
from staging_contracts.backends._kv_requests import KVPoll, KVReceiver, KVSender
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.outcomes import FailureReason
from tests.local_cluster import Geometry, Request, Sides, pools_equal, sides, wait_for, wait_states

CHUNK_PAGES = 2
ROOM_PAGES = 6


def _start_room(s: Sides, room: int, seed: int) -> tuple[Request, KVReceiver, KVSender]:
    """Register a room on decode, open it on prefill and queue every chunk but the last."""
    c = s.cluster
    request = c.add_request(room, num_pages=ROOM_PAGES, chunk_pages=CHUNK_PAGES, seed=seed)
    c.handlers[0].release_room(room)  # registered again through the receiver
    receiver = KVReceiver(s.decode[0], room)
    receiver.init(request.decode_pages, chunk_pages=CHUNK_PAGES)
    receiver.send_metadata()
    sender = KVSender(s.prefill[0], room)
    sender.init(ROOM_PAGES, c.targets)
    for chunk in request.chunks()[:-1]:
        sender.send(chunk.pages)
    return request, receiver, sender


def _send_last(request: Request, sender: KVSender) -> None:
    sender.send(request.chunks()[-1].pages, last=True)


class _Closer:
    """``manager.close(drain_s=...)`` on a thread of its own (it blocks while it drains)."""

    def __init__(self, manager: CommonKVManager, drain_s: float) -> None:
        self.result: DrainResult | None = None
        self._thread = threading.Thread(target=self._run, args=(manager, drain_s))
        self._thread.start()

    def _run(self, manager: CommonKVManager, drain_s: float) -> None:
        self.result = manager.close(drain_s=drain_s)

    def join(self) -> DrainResult:
        self._thread.join(30)
        assert not self._thread.is_alive()
        assert self.result is not None
        return self.result


def _draining(manager: CommonKVManager) -> Callable[[], bool]:
    return lambda: manager.health().draining


def test_decode_drain_lets_rooms_in_flight_finish_and_refuses_new_ones() -> None:
    """Rooms in flight when decode drains finish (bit exact); a room registered during the
    drain fails at once with reason draining; the result says which is which."""
    with sides(Geometry(1, 1, 2)) as s:
        c = s.cluster
        decode = c.decode[0]
        started = [_start_room(s, room, seed=room) for room in (10, 11)]
        assert decode.health().rooms_in_flight == 2
        closer = _Closer(decode, drain_s=30.0)
        assert wait_for(_draining(decode))
        late = c.add_request(12, num_pages=ROOM_PAGES, chunk_pages=CHUNK_PAGES, seed=12)
        c.requests.remove(late)  # never lands: not part of the expected pool
        refused = KVReceiver(s.decode[0], 12)
        refused.init(late.decode_pages, chunk_pages=CHUNK_PAGES)
        assert refused.poll() is KVPoll.Failed
        record = refused.failure_record()
        assert record is not None
        assert record.reason is FailureReason.DRAINING
        assert record.detail == DRAINING_REFUSAL
        for request, _, sender in started:
            _send_last(request, sender)
        result = closer.join()
        assert result.finished == (10, 11)
        assert result.failed == ()
        assert 12 in result.refused
        assert result.clean
        assert wait_states([r for _, r, _ in started]) == [KVPoll.Success] * 2
        assert pools_equal(c.decode_pools[0], c.expected_decode_pool(0))
        health = decode.health()
        assert health.closed
        assert not health.listener_alive
        assert health.draining


def test_a_room_that_cannot_finish_within_drain_s_fails_with_reason_draining() -> None:
    """One room finishes during the drain, the other never gets its last chunk: it fails
    with reason draining on decode, and prefill hears of it (ROOM_FAILED)."""
    with sides(Geometry(1, 1, 2)) as s:
        decode = s.cluster.decode[0]
        done_request, done_receiver, done_sender = _start_room(s, 20, seed=1)
        _, stuck_receiver, stuck_sender = _start_room(s, 21, seed=2)
        _send_last(done_request, done_sender)
        assert wait_states([done_receiver]) == [KVPoll.Success]
        result = decode.close(drain_s=0.3)
        assert result.failed == (21,)
        assert result.finished == ()  # room 20 had ended before the drain began
        assert not result.clean
        assert stuck_receiver.poll() is KVPoll.Failed
        record = stuck_receiver.failure_record()
        assert record is not None
        assert record.reason is FailureReason.DRAINING
        assert wait_states([stuck_sender]) == [KVPoll.Failed]
        prefill_record = stuck_sender.failure_record()
        assert prefill_record is not None
        assert prefill_record.reason is FailureReason.DRAINING


def test_prefill_drain_refuses_new_rooms_and_finishes_those_in_flight() -> None:
    """On prefill, a room opened during the drain fails at once (reason draining); the one in
    flight finishes on both sides."""
    with sides(Geometry(1, 1, 2)) as s:
        c = s.cluster
        prefill = c.prefill[0]
        request, receiver, sender = _start_room(s, 30, seed=3)
        assert prefill.health().rooms_in_flight == 1
        closer = _Closer(prefill, drain_s=30.0)
        assert wait_for(_draining(prefill))
        late = KVSender(s.prefill[0], 31)
        late.init(ROOM_PAGES, c.targets)
        assert late.poll() is KVPoll.Failed
        record = late.failure_record()
        assert record is not None
        assert record.reason is FailureReason.DRAINING
        _send_last(request, sender)
        result = closer.join()
        assert result.finished == (30,)
        assert result.refused == (31,)
        assert result.failed == ()
        assert wait_states([receiver]) == [KVPoll.Success]
        assert sender.poll() is KVPoll.Success


def test_close_without_drain_s_is_unchanged_and_a_bad_drain_s_closes_nothing() -> None:
    """``close()`` returns ``None`` and may be called again; a negative ``drain_s`` raises
    before anything is closed."""
    with sides(Geometry(1, 1, 2)) as s:
        decode = s.cluster.decode[0]
        with pytest.raises(ValueError, match="drain_s"):
            decode.close(drain_s=-1.0)
        assert decode.health().listener_alive
        assert not decode.health().draining
        decode.close()
        assert decode.close() is None
        assert decode.close(drain_s=1.0) == DrainResult(1.0, 0.0)
        with pytest.raises(ValueError, match="drain_s"):
            decode.close(drain_s=float("nan"))


def test_health_reports_listener_peers_ring_and_rooms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode's snapshot: its listener runs, it watches the room's prefill writer, which is
    declared dead once its listener stopped (liveness shortened through its environment
    variables); the ring's capacity and reservation; the room in flight; prefill has no
    ring."""
    monkeypatch.setenv("STAGING_CONTRACTS_LIVENESS_TIMEOUT_S", "0.3")
    monkeypatch.setenv("STAGING_CONTRACTS_LIVENESS_INTERVAL_S", "0.05")
    with sides(Geometry(1, 1, 2), ring_bytes=1 << 16) as s:
        c = s.cluster
        decode, prefill = c.decode[0], c.prefill[0]
        assert isinstance(decode, LocalKVManager)
        _start_room(s, 40, seed=4)
        # prefill prefetches the room's regions once it has its ROOM_META
        assert wait_for(lambda: (decode.health().ring_reserved_bytes or 0) > 0)
        health = decode.health()
        assert health.role == "decode"
        assert health.endpoint == decode.endpoint
        assert health.listener_alive
        assert not health.closed
        assert not health.draining
        assert health.peers == frozenset({prefill.endpoint})
        assert health.dead_peers == frozenset()
        assert health.rooms_in_flight == 1
        assert health.ring_capacity_bytes == 1 << 16
        assert health.ring_reserved_bytes is not None
        assert health.ring_reserved_bytes > 0
        assert health.ring_use is not None
        assert health.ring_use > 0
        assert health.ok
        side = prefill.health()
        assert side.role == "prefill"
        assert side.ring_capacity_bytes is None
        assert side.ring_use is None
        assert side.rooms_in_flight == 1
        prefill.listener.stop()  # the writer goes silent (its manager is still open)
        assert not prefill.health().listener_alive
        assert not prefill.health().closed
        assert wait_for(lambda: decode.health().dead_peers == {prefill.endpoint})
        # the room depended on the dead writer: it failed, nothing is in flight
        assert wait_for(lambda: decode.health().rooms_in_flight == 0)
        assert not decode.health().ok


def test_closing_prefill_without_a_drain_fails_its_room_and_the_worker_lives_on() -> None:
    """``close()`` with a room in flight: its next chunk fails on the closed engine, the room
    fails, and telling decode (sockets closed) no longer kills the transfer worker (it raised
    ``RuntimeError: PeerSockets is closed`` on the worker thread before)."""
    with sides(Geometry(1, 1, 2)) as s:
        request, _, sender = _start_room(s, 50, seed=5)
        worker = s.prefill[0]._thread
        assert wait_states([sender], timeout=0.2) == [KVPoll.Transferring]
        s.cluster.prefill[0].close()
        _send_last(request, sender)
        assert wait_states([sender]) == [KVPoll.Failed]
        assert worker.is_alive()
        other = KVSender(s.prefill[0], 51)
        other.init(ROOM_PAGES, s.cluster.targets)  # the worker still takes rooms
        assert other.poll() is not KVPoll.Failed
        other.release()


def test_polling_a_room_after_closing_decode_fails_it_without_raising() -> None:
    """``close()`` on decode with a room in flight fails the room; the poll that then tells
    prefill finds the sockets closed and returns ``Failed`` instead of raising
    ``RuntimeError: PeerSockets is closed`` on the polling thread (a demo rank's waiter
    thread died of it when a signal stopped the run)."""
    with sides(Geometry(1, 1, 2)) as s:
        _, receiver, _ = _start_room(s, 52, seed=6)
        s.cluster.decode[0].close()
        s.cluster.handlers[0].fail_room(52, "its writer went too")
        assert receiver.poll() is KVPoll.Failed
        assert receiver.failure() is not None


def test_polling_a_refused_room_after_decode_closed_does_not_raise() -> None:
    """A room decode refused (it holds no opening for it) is told to prefill by a plain send
    when first polled; polled only once decode has closed, it fails without raising
    ``SocketsClosed`` on the polling thread."""
    with sides(Geometry(1, 1, 2)) as s:
        c, decode = s.cluster, s.cluster.decode[0]
        request, _, sender = _start_room(s, 20, seed=20)
        closer = _Closer(decode, drain_s=30.0)  # waits for room 20
        assert wait_for(_draining(decode))
        late = c.add_request(21, num_pages=ROOM_PAGES, chunk_pages=CHUNK_PAGES, seed=21)
        c.requests.remove(late)  # never lands: not part of the expected pool
        refused = KVReceiver(s.decode[0], 21)
        refused.init(late.decode_pages, chunk_pages=CHUNK_PAGES)
        _send_last(request, sender)
        assert closer.join().finished == (20,)
        assert decode.health().closed
        assert refused.poll() is KVPoll.Failed
