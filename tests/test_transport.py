"""ZMQ plumbing: non-blocking peer sockets and a listener that survives its dispatch."""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest
import zmq

from staging_contracts._control.transport import (
    MAX_FRAME_BYTES,
    Listener,
    LogThrottle,
    PeerSockets,
    open_socket_count,
)
from staging_contracts._control.wire import MAX_MESSAGE_BYTES, MalformedMessage


def wait_for(predicate: object, timeout: float = 5.0) -> bool:
    """Poll a predicate until it holds or the timeout passes."""
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return bool(predicate())


def test_listener_dispatches_and_keeps_serving_after_errors() -> None:
    """Malformed messages and dispatch bugs are counted; later messages are still handled."""
    seen: list[list[bytes]] = []

    def dispatch(frames: list[bytes]) -> None:
        if frames[0] == b"bad":
            raise MalformedMessage("bad frame", 0, "type")
        if frames[0] == b"bug":
            raise RuntimeError("a bug in a dispatch")
        seen.append(frames)

    listener = Listener(dispatch, name="test-listener")
    peers = PeerSockets()
    with listener:
        for kind in (b"bad", b"ok", b"bug", b"ok"):
            assert peers.send(listener.endpoint, [kind, b"x"])
        assert wait_for(lambda: len(seen) == 2)
        stats = listener.stats()
        assert (stats.received, stats.malformed, stats.errors) == (4, 1, 1)
        assert listener.alive
    peers.close()
    assert not listener.alive


def test_listener_runs_idle_work_and_survives_its_failures() -> None:
    """The idle hook runs repeatedly; an exception in it does not stop the thread."""
    calls: list[int] = []

    def idle() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("idle bug")

    with Listener(
        lambda frames: None, name="idle-listener", idle=idle, poll_interval_s=0.001
    ) as lst:
        assert wait_for(lambda: len(calls) >= 5)
        assert lst.stats().errors >= 1


def test_peer_sockets_drop_instead_of_blocking_on_a_dead_peer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Sends to a peer nobody serves return False once its queue is full, without blocking."""
    peers = PeerSockets(hwm=2)
    # A blocking send would hang here (pytest-timeout ends it); these return at once.
    results = [peers.send("tcp://127.0.0.1:9", [b"x"]) for _ in range(50)]
    assert not all(results)
    assert peers.dropped == results.count(False)
    assert caplog.text.count("is not keeping up") == 1
    peers.close()


def test_sockets_are_counted_and_closed() -> None:
    """open_socket_count goes back to where it was once everything is closed."""
    before = open_socket_count()
    listener = Listener(lambda frames: None, name="count-listener")
    peers = PeerSockets()
    peers.send(listener.endpoint, [b"x"])
    assert open_socket_count() == before + 2
    peers.forget(listener.endpoint)
    assert open_socket_count() == before + 1
    listener.stop()
    listener.stop()
    peers.close()
    peers.close()
    assert open_socket_count() == before


def test_send_after_close_is_an_error() -> None:
    """A closed PeerSockets refuses to send."""
    peers = PeerSockets()
    peers.close()
    with pytest.raises(RuntimeError, match=r"^PeerSockets is closed$"):
        peers.send("tcp://127.0.0.1:9", [b"x"])


def test_listener_binds_a_given_port_and_reports_busy_ports() -> None:
    """A listener binds the port it is given; a second one on the same port fails cleanly."""
    first = Listener(lambda frames: None, name="port-a")
    port = int(first.endpoint.rsplit(":", 1)[1])
    before = open_socket_count()
    with pytest.raises(zmq.ZMQError):
        Listener(lambda frames: None, name="port-b", port=port)
    assert open_socket_count() == before
    first.stop()


def test_stop_from_another_thread_joins_the_listener() -> None:
    """stop() may be called from any thread and joins the listener thread."""
    listener = Listener(lambda frames: None, name="stopper")
    listener.start()
    stopper = threading.Thread(target=listener.stop)
    stopper.start()
    stopper.join(5)
    assert not listener.alive


def test_log_throttle_logs_a_burst_then_one_summary_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Past the burst, events are only counted; the summary says how many, once per interval."""
    now = [0.0]
    log = logging.getLogger("test.throttle")
    throttle = LogThrottle(log, "bad things", burst=2, interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.throttle"):
        assert [throttle.admit() for _ in range(5)] == [True, True, False, False, False]
        now[0] = 9.9
        throttle.tick()
        assert not caplog.records
        now[0] = 10.0
        throttle.tick()
        assert caplog.messages == ["bad things: 3 more not logged one by one in the last 10.0s"]
        assert throttle.suppressed == 0
        now[0] = 10.5
        assert throttle.admit()
        throttle.flush()  # nothing left out: no line
        assert len(caplog.records) == 1
    with pytest.raises(ValueError, match=r"^burst=-1 must be >= 0 and interval_s=0 > 0$"):
        LogThrottle(log, "x", burst=-1, interval_s=0)


def test_malformed_messages_are_counted_exactly_and_logged_sparingly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Thousands of bad messages: exact counts, a few lines per interval and summaries."""
    caplog.set_level(logging.WARNING, logger="staging_contracts._control.transport")

    def dispatch(frames: list[bytes]) -> None:
        raise MalformedMessage("bad frame", 0, "type")

    burst, interval_s, batches, per_batch = 2, 0.05, 6, 500
    listener = Listener(
        dispatch, name="noisy", log_burst=burst, log_interval_s=interval_s, poll_interval_s=0.001
    )
    peers = PeerSockets()
    started = time.monotonic()
    with listener:
        for _ in range(batches):
            for n in range(per_batch):
                assert peers.send(listener.endpoint, [b"junk", b"%d" % n])
            time.sleep(interval_s * 1.2)
        assert wait_for(lambda: listener.stats().received == batches * per_batch)
    elapsed = time.monotonic() - started
    peers.close()
    stats = listener.stats()
    assert stats.malformed == batches * per_batch
    one_by_one = [m for m in caplog.messages if "malformed message dropped" in m]
    summaries = [
        re.fullmatch(r"noisy: malformed messages: (\d+) more not logged one by one .*", m)
        for m in caplog.messages
        if "more not logged" in m
    ]
    assert summaries
    assert all(summaries)
    summarised = sum(int(m.group(1)) for m in summaries if m)
    assert len(one_by_one) + summarised == stats.malformed
    intervals = elapsed / interval_s + 1
    assert len(one_by_one) <= burst * intervals
    assert len(summaries) <= intervals + 1


def test_listener_refuses_bounds_that_are_not_positive() -> None:
    """A listener with a zero batch or interval is a ValueError, and binds nothing."""
    before = open_socket_count()
    with pytest.raises(ValueError, match=r"^drain_batch=0, max_frame_bytes=8192 and max_frames=32"):
        Listener(lambda frames: None, name="bad", drain_batch=0)
    with pytest.raises(ValueError, match=r"^poll_interval_s=0.005 and idle_interval_s=0 must"):
        Listener(lambda frames: None, name="bad", idle_interval_s=0)
    assert open_socket_count() == before


def test_listener_sets_a_message_size_cap_on_its_socket() -> None:
    """The PULL socket carries ZMQ_MAXMSGSIZE, the documented bound above the codec's."""
    assert MAX_FRAME_BYTES >= MAX_MESSAGE_BYTES
    with Listener(lambda frames: None, name="capped", max_frame_bytes=1000) as listener:
        assert listener._socket.getsockopt(zmq.MAXMSGSIZE) == 1000
    with Listener(lambda frames: None, name="capped") as listener:
        assert listener._socket.getsockopt(zmq.MAXMSGSIZE) == MAX_FRAME_BYTES
