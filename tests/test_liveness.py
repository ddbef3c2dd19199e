"""Peer liveness: PING to watched peers, PONG back, silence declared dead once; and the
prefill writer's per-target switch that leaves a rank unwatched (issue 17)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest

from staging_contracts._control.liveness import PeerLiveness
from staging_contracts._control.room_messages import Ping, Pong
from staging_contracts._control.transport import PeerSockets
from staging_contracts._prefill.books import RegionAnswerTable, WatermarkTracker
from staging_contracts._prefill.writer import (
    ChunkSpec,
    DecodeTarget,
    PrefillTimeouts,
    StagingFailed,
    StagingWriter,
)
from staging_contracts.protocols import Notification, Transfer
from tests.local_cluster import Geometry


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
    with pytest.raises(
        ValueError, match=r"^the liveness interval \(interval_s=1.0\) .* \(timeout_s=1.0\)$"
    ):
        PeerLiveness(RecordingSender(), "e", interval_s=1.0, timeout_s=1.0)


def test_bad_bounds_from_the_environment_name_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interval that came from the environment is named by its variable (the operator set
    it there, not in code), the timeout by its argument."""
    monkeypatch.setenv("STAGING_CONTRACTS_LIVENESS_INTERVAL_S", "4")
    with pytest.raises(ValueError, match="liveness interval") as caught:
        PeerLiveness(RecordingSender(), "e", timeout_s=3.0)
    assert "STAGING_CONTRACTS_LIVENESS_INTERVAL_S=4" in str(caught.value)
    assert "timeout_s=3.0" in str(caught.value)


# --------------------------------------------------------------------------- the per-peer switch
# A decode rank given as DecodeTarget(..., liveness=False) (the reference's decode, which never
# answers PING) is never watched by the prefill writer: never pinged, never declared dead, and
# no room of it fails for its silence; the chunk deadline still bounds every wait on it.


class SilentEngine:
    """A transfer engine that writes nothing (the switch never reaches the engine)."""

    session_id = "prefill-engine"
    supports_notifications = False

    def metadata(self) -> bytes:
        return b""

    def add_peer(self, session_id: str, metadata: bytes) -> None:
        del session_id, metadata

    def register(self, ptr: int, length: int) -> None:
        del ptr, length

    def deregister(self, ptr: int) -> None:
        del ptr

    def write(self, peer: str, transfers: Sequence[Transfer], notify: bytes | None = None) -> None:
        del peer, transfers, notify

    def poll_notifications(self) -> list[Notification]:
        return []

    def close(self) -> None:
        pass


GEOMETRY = Geometry(1, 1, 2)
OURS = DecodeTarget(0, "decode-ours", "tcp://ours:1", 1_000_000, 1 << 16)
THEIRS = DecodeTarget(0, "decode-theirs", "tcp://theirs:1", 1_000_000, 1 << 16, liveness=False)


@dataclass
class WriterSide:
    writer: StagingWriter
    liveness: PeerLiveness
    sender: RecordingSender
    clock: Clock
    lost: list[tuple[int, str]]

    def pings_to(self, endpoint: str) -> int:
        return sum(1 for e, frames in self.sender.sent if e == endpoint and frames[0] == b"PING")

    def tick_past_timeout(self) -> list[str]:
        """Advance the fake clock past the timeout an interval at a time, ticking each time."""
        dead: list[str] = []
        for _ in range(int(self.liveness.timeout_s / self.liveness.interval_s) + 2):
            self.clock.now += self.liveness.interval_s
            dead += self.liveness.tick()
        return dead


def writer_side(*, deadline_s: float = 30.0) -> WriterSide:
    """A 1 -> 1 writer wired to a liveness on a fake clock, as enable_prefill_staging does."""
    liveness, sender, clock, _ = make()
    writer = StagingWriter(
        kv_buffers=GEOMETRY.empty_pool(1, 0),
        engine=SilentEngine(),
        sender=sender,
        watermarks=WatermarkTracker(),
        regions=RegionAnswerTable(),
        prefill_tp=1,
        prefill_rank=0,
        total_kv_heads=GEOMETRY.total_heads,
        max_chunk_pages=4,
        timeouts=PrefillTimeouts(answer_s=0.05, ready_s=0.05, deadline_s=deadline_s),
        liveness=liveness,
    )
    liveness.subscribe(writer.peer_dead)
    lost: list[tuple[int, str]] = []
    writer.on_room_lost(lambda room, reason: lost.append((room, reason)))
    return WriterSide(writer, liveness, sender, clock, lost)


def test_liveness_is_on_by_default_for_a_decode_target() -> None:
    """A target made without the switch is watched: pinged, declared dead when silent, and
    its room is lost with the reason; a chunk of it then fails at once."""
    assert DecodeTarget(0, "s", "tcp://e:1", 0, 1).liveness is True
    side = writer_side()
    side.writer.prefetch(7, [(0, 2)], [OURS])
    assert side.liveness.watched == frozenset({OURS.endpoint})
    assert side.tick_past_timeout() == [OURS.endpoint]
    assert side.pings_to(OURS.endpoint) >= 2
    assert side.lost == [(7, f"decode rank at {OURS.endpoint} is dead")]
    assert side.writer.chunk_ready(7, 0, [OURS])  # it would fail at once, not wait
    with pytest.raises(StagingFailed, match=r"chunk 0: decode rank 0 at tcp://ours:1 is dead"):
        side.writer.send_chunk(7, ChunkSpec(0, 0, (1, 2)), [OURS])


def test_a_target_without_liveness_is_never_pinged_nor_declared_dead() -> None:
    """liveness=False: the room is tracked (its session authorised) but the rank is not
    watched, so however long the room lasts it gets no PING, is never dead and the room is
    never lost for its silence."""
    side = writer_side()
    side.writer.prefetch(7, [(0, 2)], [THEIRS])
    assert side.liveness.watched == frozenset()
    assert side.tick_past_timeout() == []
    assert side.tick_past_timeout() == []
    assert side.pings_to(THEIRS.endpoint) == 0
    assert not side.liveness.is_dead(THEIRS.endpoint)
    assert side.lost == []
    assert not side.writer.chunk_ready(7, 0, [THEIRS])  # still waits for its region
    assert side.writer.authorize(
        [b"STAGING_RSP", b"7", b"0", b"0", b"0", b"1", b"decode-theirs"], THEIRS.endpoint
    )


def test_the_switch_is_per_target_and_a_dead_verdict_does_not_reach_an_unwatched_room() -> None:
    """Room 7 watches a rank, room 8 reaches the same rank without liveness: when the rank is
    declared dead only room 7 is lost, and a chunk of room 8 does not fail for it."""
    side = writer_side()
    watched = DecodeTarget(0, "decode-x", "tcp://x:1", 1_000_000, 1 << 16)
    unwatched = DecodeTarget(0, "decode-x", "tcp://x:1", 1_000_000, 1 << 16, liveness=False)
    side.writer.prefetch(7, [(0, 2)], [watched])
    side.writer.prefetch(8, [(0, 2)], [unwatched])
    assert side.tick_past_timeout() == ["tcp://x:1"]
    assert side.lost == [(7, "decode rank at tcp://x:1 is dead")]
    assert side.writer.chunk_ready(7, 0, [watched])
    assert not side.writer.chunk_ready(8, 0, [unwatched])


def test_forgetting_rooms_unwatches_only_what_was_watched() -> None:
    """Forgetting a room without liveness drops no other room's watch of the same rank."""
    side = writer_side()
    side.writer.prefetch(7, [(0, 2)], [OURS])
    side.writer.prefetch(8, [(0, 2)], [replace(OURS, liveness=False)])
    side.writer.forget_room(8)
    assert side.liveness.watched == frozenset({OURS.endpoint})
    side.writer.forget_room(7)
    assert side.liveness.watched == frozenset()


def test_without_liveness_a_chunk_still_fails_at_its_deadline() -> None:
    """Turning liveness off removes no bound: a chunk whose region is never answered fails at
    deadline_s, having asked again meanwhile."""
    side = writer_side(deadline_s=0.2)
    with pytest.raises(StagingFailed, match=r"no STAGING_RSP for chunk 0 before the deadline"):
        side.writer.send_chunk(7, ChunkSpec(0, 0, (1, 2)), [THEIRS])
    requests = [f for e, f in side.sender.sent if e == THEIRS.endpoint and f[0] == b"STAGING_REQ"]
    assert len(requests) >= 2
    assert side.pings_to(THEIRS.endpoint) == 0
