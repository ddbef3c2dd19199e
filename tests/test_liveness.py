"""Peer liveness: PING to watched peers, PONG back, silence declared dead once."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from staging_contracts.control.liveness import PeerLiveness
from staging_contracts.control.room_messages import Ping, Pong
from staging_contracts.control.transport import PeerSockets


class RecordingSender(PeerSockets):
    """Records what would be sent instead of opening sockets."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, list[bytes]]] = []

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool:
        self.sent.append((endpoint, list(frames)))
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[PeerLiveness, RecordingSender, Clock, list[str]]:
    sender, clock = RecordingSender(), Clock()
    dead: list[str] = []
    liveness = PeerLiveness(sender, "tcp://me:1", interval_s=0.5, timeout_s=2.0, clock=clock)
    liveness.subscribe(dead.append)
    return liveness, sender, clock, dead


def test_watched_peers_are_pinged_every_interval() -> None:
    """A watched peer gets a PING carrying our endpoint, once per interval."""
    liveness, sender, clock, _ = make()
    liveness.watch("tcp://a:1")
    liveness.tick()
    liveness.tick()
    assert sender.sent == [("tcp://a:1", [b"PING", b"tcp://me:1"])]
    clock.now += 0.5
    liveness.tick()
    assert len(sender.sent) == 2


def test_a_silent_peer_is_declared_dead_once() -> None:
    """Past the timeout without a word the peer is dead; subscribers hear it once."""
    liveness, _, clock, dead = make()
    liveness.watch("tcp://a:1")
    clock.now += 2.0
    assert liveness.tick() == []
    clock.now += 0.01
    assert liveness.tick() == ["tcp://a:1"]
    assert liveness.tick() == []
    assert dead == ["tcp://a:1"]
    assert liveness.is_dead("tcp://a:1")


def test_a_pong_keeps_a_peer_alive_and_revives_a_dead_one() -> None:
    """Any PONG (or PING) from the peer resets its silence, even after it was dead."""
    liveness, _, clock, dead = make()
    liveness.watch("tcp://a:1")
    for _ in range(5):
        clock.now += 1.5
        liveness.on_pong(Pong("tcp://a:1").to_frames())
        assert liveness.tick() == []
    clock.now += 3
    assert liveness.tick() == ["tcp://a:1"]
    liveness.on_ping(Ping("tcp://a:1").to_frames())
    assert not liveness.is_dead("tcp://a:1")
    assert dead == ["tcp://a:1"]


def test_a_ping_is_answered_whether_or_not_we_watch() -> None:
    """PING gets a PONG with our endpoint at the sender's."""
    liveness, sender, _, _ = make()
    liveness.on_ping([b"PING", b"tcp://b:2"])
    assert sender.sent == [("tcp://b:2", [b"PONG", b"tcp://me:1"])]


def test_watches_are_counted() -> None:
    """A peer stays watched until every holder unwatched it; an unwatched one never dies."""
    liveness, _, clock, _ = make()
    liveness.watch("tcp://a:1")
    liveness.watch("tcp://a:1")
    liveness.unwatch("tcp://a:1")
    assert liveness.watched == frozenset({"tcp://a:1"})
    liveness.unwatch("tcp://a:1")
    assert liveness.watched == frozenset()
    clock.now += 10
    assert liveness.tick() == []


def test_a_failing_subscriber_does_not_stop_the_others() -> None:
    """One subscriber raising is logged; the next is still told."""
    liveness, _, clock, dead = make()

    def broken(endpoint: str) -> None:
        raise RuntimeError(endpoint)

    liveness.subscribe(broken)
    liveness.subscribe(dead.append)
    liveness.watch("tcp://a:1")
    clock.now += 3
    liveness.tick()
    assert dead == ["tcp://a:1", "tcp://a:1"]


def test_bad_bounds_are_refused() -> None:
    """The timeout must exceed the interval."""
    with pytest.raises(ValueError, match=r"^interval_s=1.0 must be > 0 and timeout_s=1.0"):
        PeerLiveness(RecordingSender(), "e", interval_s=1.0, timeout_s=1.0)
