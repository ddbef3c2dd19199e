"""ZMQ plumbing: non-blocking peer sockets and a listener that survives its dispatch."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from staging_contracts.control.transport import Listener, PeerSockets, open_socket_count
from staging_contracts.control.wire import MalformedMessage


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
