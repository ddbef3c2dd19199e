"""The soak around a rank restart, without processes or timing luck.

Found by an outside tester: ``staging-contracts soak --faults kill-prefill`` failed in 2 runs
of 3 with ``rank error prefill 1: RuntimeError: a room before the decode ranks are known``
and ``2 hung rooms`` (61 s instead of 13). The restarted rank's ``ready`` event made the
driver count it as up, and the same pump step issued it a room, before the driver had sent
it its peers; the rank raised, never reported the room, and the room hung until the bound.

These tests drive the two halves the race was between, one event at a time:

* the driver (:class:`~staging_contracts._cluster.soak._Driver`), its events fed by hand and
  its commands recorded: a rank gets no room before it answered ``peers``;
* a rank's command handling (:class:`~staging_contracts._cluster.soak_rank.CommandLoop`,
  with a fake side and a hand-moved clock): a room that comes before the peers waits for
  them, or fails with a reason once ``peers_wait_s`` passed; a room that cannot be opened
  fails with a reason; every room command is answered by one ``room`` event.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from staging_contracts._cluster import soak
from staging_contracts._cluster._messages import (
    AskStatus,
    OpenRoom,
    Peers,
    PeersTaken,
    RankError,
    RankStatus,
    RoomEnded,
    Serving,
    Stop,
)
from staging_contracts._cluster.bootstrap import RankInfo
from staging_contracts._cluster.soak_rank import CommandLoop, RankSettings
from staging_contracts._cluster.soak_report import (
    KillRecord,
    SoakConfig,
    format_summary,
    reason_group,
)
from staging_contracts._run._codec import Message, encode
from tests.test_soak import passing_result

Key = tuple[str, int]


# --------------------------------------------------------------------------- the driver


class FakeProcess:
    """Stands in for a rank process: alive until killed, never started."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.exitcode = -9

    def join(self, timeout: float | None = None) -> None:
        del timeout


def _name(command: Message) -> str:
    """A command's name as the tests say it: ``peers``, ``room``, ..."""
    return {Peers: "peers", OpenRoom: "room"}.get(type(command), type(command).__name__)


class Harness:
    """A driver with fake rank processes; its commands are recorded, its events given."""

    def __init__(self, config: SoakConfig) -> None:
        self.driver = soak._Driver(config, None)
        self.sent: list[tuple[Key, int, Message]] = []
        """Every command the driver sent: ``(key, pid, command)``, in order."""
        self.next_pid = 100
        self.refusing: set[Key] = set()
        """Ranks whose commands cannot be sent (``zmq.Again``)."""
        self.driver._send = self._record  # type: ignore[method-assign]
        for key in self.driver.keys:
            self.start(key)

    def _record(self, rank: soak._Rank, command: Message) -> bool:
        if rank.commands is None or rank.gone or rank.key in self.refusing:
            return False
        self.sent.append((rank.key, rank.pid or 0, command))
        return True

    def start(self, key: Key) -> soak._Rank:
        """A new process for ``key`` (what ``_spawn`` does, without the process)."""
        self.next_pid += 1
        process = FakeProcess(self.next_pid)
        rank = soak._Rank(key, process, pid=self.next_pid)  # type: ignore[arg-type]
        self.driver.ranks[key] = rank
        return rank

    def event(self, key: Key, event: Message) -> None:
        self.driver._event(encode(event, *key, self.driver.ranks[key].pid))

    def ready(self, key: Key) -> None:
        role, rank = key
        info = RankInfo(role, rank, f"tcp://127.0.0.1:{9000 + rank}", f"s-{role}-{rank}", b"m")
        # Nothing listens there: the driver's PUSH socket connects lazily and sends nothing.
        self.event(key, Serving(info, "tcp://127.0.0.1:1"))

    def pump(self) -> None:
        """What one driver step does after its events: issue rooms."""
        self.driver._top_up()

    def commands(self, key: Key, pid: int | None = None) -> list[str]:
        """The names of the commands ``key`` (its process ``pid``) was sent, in order."""
        return [_name(d) for k, p, d in self.sent if k == key and (pid is None or p == pid)]

    def report_all(self, state: str = "ok") -> None:
        """Every rank reports every unsettled room it was sent."""
        for room in list(self.driver._unsettled()):
            for key, pid in room.expected.items():
                if key in room.reports or key in room.lost:
                    continue
                if self.driver.ranks[key].pid != pid:
                    continue
                reason = f"{key[0]} {key[1]} failed it" if state == "failed" else ""
                verified = state == "ok" and key[0] == "decode"
                self.event(key, RoomEnded(room.room, 0, state, 0.0, reason, verified))

    def close(self) -> None:
        for rank in self.driver.ranks.values():
            if rank.commands is not None:
                rank.commands.close(linger=0)
        self.driver.inbox.close(linger=0)


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness(SoakConfig(faults=("kill-prefill",), rooms_in_flight=2))
    try:
        yield h
    finally:
        h.close()


def kill(h: Harness, victim: Key) -> soak._Rank:
    """``victim``'s process dies (what ``_died`` does with the driver's state) and a new
    one starts; returns the new one (not ready yet)."""
    old = h.driver.ranks[victim]
    old.gone = True
    if old.commands is not None:
        old.commands.close(linger=0)
        old.commands = None
    for room in h.driver._unsettled():
        if victim in room.waiting():
            room.lost.add(victim)
    return h.start(victim)


def start_soak(h: Harness) -> None:
    """Every rank ready, peers out and answered, rooms issued (``run``'s start)."""
    for key in h.driver.keys:
        h.ready(key)
    h.driver._send_peers()
    h.driver.peering = True
    h.driver.issuing = True
    h.pump()
    assert h.sent
    assert all(isinstance(doc, Peers) for _, _, doc in h.sent)  # no answer yet: no room
    for key in h.driver.keys:
        h.event(key, PeersTaken(1))
    h.pump()
    for key in h.driver.keys:
        assert h.commands(key)[0] == "peers"
        assert "room" in h.commands(key), key


def test_a_rank_gets_rooms_only_after_it_answered_its_peers(harness: Harness) -> None:
    start_soak(harness)


def test_a_restarted_rank_gets_no_room_before_its_peers(harness: Harness) -> None:
    """The outside tester's race, step by step: prefill 1 restarts, a room is free when its
    ``ready`` comes, and the driver's next step issues rooms. The new process must be sent
    ``peers`` first and no room until it answered; then rooms reach it again."""
    h = harness
    start_soak(h)
    victim = ("prefill", 1)
    new = kill(h, victim)
    h.report_all("failed")  # the rooms in flight end: slots are free for the next step
    h.pump()  # while it is down, rooms go to the survivors only
    assert all(k != victim for k, p, doc in h.sent if p == new.pid)
    h.report_all("failed")

    h.ready(victim)  # the restarted rank is ready ...
    h.pump()  # ... and the same step issues rooms: the race
    assert h.commands(victim, new.pid) == ["peers"]
    assert [_name(d) for k, p, d in h.sent if k == ("decode", 0)][-1] == "peers"
    assert not new.peered
    assert len(h.driver._unsettled()) == 0  # no room at all while it answers

    h.event(victim, PeersTaken(1))
    h.pump()
    sent = h.commands(victim, new.pid)
    assert sent[0] == "peers"
    assert sent.count("room") == 2  # both free slots, now that it knows its peers
    for room in h.driver._unsettled():
        assert room.expected[victim] == new.pid
        assert victim not in room.lost


def test_a_rank_that_never_answers_its_peers_pauses_rooms_only_for_a_bound(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No room while a ready rank has not answered ``peers`` (the others know it already),
    but only for ``PEERS_S``: then it counts as down and rooms go to the others."""
    h = harness
    start_soak(h)
    victim = ("prefill", 0)
    new = kill(h, victim)
    h.report_all("failed")
    h.ready(victim)
    h.pump()
    assert not h.driver._unsettled()
    assert new.peers_sent is not None
    new.peers_sent -= soak.PEERS_S  # its answer is overdue
    h.pump()
    rooms = h.driver._unsettled()
    assert rooms
    assert all(victim in room.lost and victim not in room.expected for room in rooms)
    assert "room" not in h.commands(victim, new.pid)


def test_a_room_a_rank_could_not_open_fails_with_its_reason_not_hung(harness: Harness) -> None:
    h = harness
    start_soak(h)
    room = h.driver._unsettled()[0]
    reason = "rank error: opening the room failed: RuntimeError: boom"
    h.event(("decode", 0), RoomEnded(room.room, 0, "failed", 0.0, reason))
    h.event(("prefill", 0), RoomEnded(room.room, 0, "failed", 0.0, "decode failed it"))
    h.event(("prefill", 1), RoomEnded(room.room, 0, "failed", 0.0, "decode failed it"))
    assert (room.outcome, room.reason) == ("failed", reason)
    assert reason_group(room.reason) == "rank error"
    result = h.driver.result()
    assert result.hung == 0
    assert result.failed_by_reason == {"rank error": 1}


def test_a_room_command_that_cannot_be_sent_fails_the_room_on_that_rank(
    harness: Harness,
) -> None:
    h = harness
    start_soak(h)
    h.report_all("ok")
    h.refusing.add(("prefill", 1))
    h.pump()
    for room in h.driver._unsettled():
        report = room.reports[("prefill", 1)]
        assert report.state == "failed"
        assert "could not be sent" in report.reason
    h.report_all("failed")
    assert not h.driver._unsettled()


def test_every_wait_for_rooms_ends_when_the_last_of_them_would_be_hung(
    harness: Harness,
) -> None:
    h = harness
    start_soak(h)
    rooms = h.driver._unsettled()
    bound = h.driver.config.room_bound_s + soak.HUNG_SLACK_S
    assert 0 < h.driver._until_hung(rooms) <= bound + 2 * soak._PUMP_S
    for room in rooms:
        room.issued -= bound  # issued long ago: hung now
    assert h.driver._until_hung(rooms) <= 2 * soak._PUMP_S
    h.driver._step(0.001)
    assert all(room.outcome == "hung" for room in rooms)
    assert h.driver._until_hung([]) == 0.0


def test_progress_lines_and_records_use_one_clock(harness: Harness) -> None:
    """A progress line is stamped with its fault's start in seconds since the soak started,
    the ``at_s`` the summary gives, not with the time the line was written."""
    lines: list[str] = []
    h = harness
    h.driver.progress = lines.append
    h.driver.start = 1000.0
    h.driver._say(1004.7, "killed prefill 1")
    assert lines == ["   4.7 s  killed prefill 1"]
    text = format_summary(
        passing_result(kills=(KillRecord("prefill", 1, 4.7, 3, 3, 2.9, 5.6, served_after=7),))
    )
    assert "prefill 1 at 4.7 s:" in text
    assert "back in 5.6 s, then in 7 rooms that succeeded" in text
    assert "seconds since the soak started" in text


# --------------------------------------------------------------------------- a rank


class FakeSide(CommandLoop):
    """A rank's command handling over a fake side: rooms open instantly and end when the
    test says."""

    def __init__(self, clock: Callable[[], float], fail_open: bool = False) -> None:
        self.sent: list[Message] = []
        self.lock = threading.Lock()
        super().__init__(self, RankSettings(SoakConfig().transfer(), peers_wait_s=5.0), clock=clock)
        self.peers: list[RankInfo] | None = None
        self.opened: list[int] = []
        self.fail_open = fail_open
        self.end = threading.Event()

    def send(self, event: Message) -> None:  # the EventSink
        with self.lock:
            self.sent.append(event)

    def peers_known(self) -> bool:
        return self.peers is not None

    def on_peers(self, ranks: list[RankInfo]) -> None:
        self.peers = ranks

    def open_room(self, room: int, index: int) -> Callable[[], RoomEnded]:
        if self.peers is None:
            raise RuntimeError("a room before the decode ranks are known")
        if self.fail_open:
            raise RuntimeError("boom")
        self.opened.append(room)

        def finish() -> RoomEnded:
            if not self.end.wait(10.0):
                return RoomEnded(room, index, "hung", 0.0, "the test never ended it")
            return RoomEnded(room, index, "ok", 0.0)

        return finish

    def status(self, ask: AskStatus) -> RankStatus:
        return RankStatus(ask.id, True)

    def finish_rooms(self) -> None:
        self.end.set()
        for thread in self.threads:
            thread.join(10.0)
            assert not thread.is_alive()

    def rooms(self) -> dict[int, RoomEnded]:
        with self.lock:
            return {e.room: e for e in self.sent if isinstance(e, RoomEnded)}


PEERS = encode(Peers((RankInfo("decode", 0, "tcp://127.0.0.1:9", "s", b"m"),)))


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_a_room_before_the_peers_waits_for_them_then_opens() -> None:
    clock = Clock()
    side = FakeSide(clock)
    assert side.command(encode(OpenRoom(7, 1)))
    assert side.opened == []
    assert side.waiting_rooms == [(7, 1, 55.0)]
    assert side.sent == []  # no error: it waits
    clock.now = 54.9
    side.expire()
    assert side.sent == []
    assert side.command(PEERS)
    assert side.sent[0] == PeersTaken(1)
    assert side.opened == [7]
    assert side.waiting_rooms == []
    side.finish_rooms()
    assert side.rooms() == {7: RoomEnded(7, 1, "ok", 0.0)}
    assert [type(event) for event in side.sent] == [PeersTaken, RoomEnded]


def test_a_room_whose_peers_never_come_fails_with_a_reason_at_its_bound() -> None:
    clock = Clock()
    side = FakeSide(clock)
    side.command(encode(OpenRoom(7, 1)))
    side.command(encode(OpenRoom(8, 2)))
    clock.now = 55.0
    side.expire()
    rooms = side.rooms()
    assert sorted(rooms) == [7, 8]
    for event in rooms.values():
        assert event.state == "failed"
        assert event.reason == "no peers known 5 s after the room came"
    assert side.waiting_rooms == []
    side.command(PEERS)  # too late for them: nothing opens twice
    assert side.opened == []
    assert len(side.rooms()) == 2


def test_a_room_that_cannot_be_opened_fails_with_the_error() -> None:
    side = FakeSide(Clock(), fail_open=True)
    side.command(PEERS)
    assert side.command(encode(OpenRoom(9, 0)))  # the rank lives on
    (event,) = side.rooms().values()
    assert event.state == "failed"
    assert event.reason == "rank error: opening the room failed: RuntimeError: boom"
    errors = [e for e in side.sent if isinstance(e, RankError)]
    assert errors == [RankError("room 9: RuntimeError: boom")]


def test_a_room_waiting_for_peers_that_cannot_open_fails_too() -> None:
    side = FakeSide(Clock(), fail_open=True)
    side.command(encode(OpenRoom(3, 0)))
    side.command(PEERS)
    (event,) = side.rooms().values()
    assert event.state == "failed"
    assert "opening the room failed" in event.reason


def test_stop_and_a_bad_command() -> None:
    side = FakeSide(Clock())
    assert side.command(b"not json")
    assert isinstance(side.sent[-1], RankError)
    assert side.command(encode(PeersTaken(1)))  # an event is no command
    last = side.sent[-1]
    assert isinstance(last, RankError)
    assert "not a command: PeersTaken" in last.error
    assert side.close_s == 10.0
    assert not side.command(encode(Stop(close_s=0.5)))
    assert side.close_s == 0.5  # an interrupted soak gives the worker a quarter of its grace
