"""Issue 24, findings 3 and 9: nothing of a closed room is kept or used by a later one.

* A ``STAGING_RSP`` that arrives after its room closed is dropped (the answer table stays
  bounded under a flood), and a room id used again gets a fresh answer, never the late one.
* A fence kept for a write in flight is dropped when the write returns (the room id used
  again is not refused); ``forget_room`` racing ``track_room`` leaves no orphan watch.
"""

from __future__ import annotations

import threading
import types

import pytest

from staging_contracts._control.liveness import PeerLiveness
from staging_contracts._control.wire import StagingRsp
from staging_contracts._decode.rooms import RoomStatus
from staging_contracts._prefill import writer as writer_module
from staging_contracts._prefill.books import RegionAnswerTable
from staging_contracts._prefill.writer import ChunkSpec
from staging_contracts.protocols import PrefillStagingContext
from tests.local_cluster import Geometry, local_cluster, pools_equal, wait_for
from tests.test_prefill_writer import Clock, RecordingSockets, Rig, make_rig


@pytest.fixture
def writer_clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The fake clock the writer module reads as time.monotonic (as test_prefill_writer's)."""
    fake = Clock()
    monkeypatch.setattr(writer_module, "time", types.SimpleNamespace(monotonic=fake))
    return fake


def _prefill_table(cluster_prefill: object) -> RegionAnswerTable:
    ctx = getattr(cluster_prefill, "_staging_ctx", None)
    if not isinstance(ctx, PrefillStagingContext) or not isinstance(ctx.regions, RegionAnswerTable):
        raise AssertionError("the prefill rank has no region table")
    return ctx.regions


def test_a_flood_of_late_answers_leaves_the_answer_table_bounded() -> None:
    """Authenticated STAGING_RSP for rooms this prefill rank does not have open (closed, or
    never opened), delivered as the listener delivers them: none is kept (main kept every
    one: 200k of them, +57 MiB)."""
    with local_cluster(Geometry(1, 1, 2)) as c:
        request = c.add_request(7, num_pages=2, chunk_pages=2)
        assert c.send_all([request]) == []
        assert c.wait_rooms([7]) == {7: [RoomStatus.SUCCESS]}
        c.release([7])
        manager = c.prefill[0]
        table = _prefill_table(manager)
        session = c.targets[0].session_id
        for room in range(5000):
            frames = StagingRsp(room % 50, room // 50, 0, 1, 64, session).to_frames()
            manager._handle_staging_rsp(frames)
        assert len(table) == 0


def test_a_room_id_used_again_after_a_late_answer_gets_a_fresh_answer() -> None:
    """Room 7 closes; a late STAGING_RSP of it (naming a region that another tenant now
    holds) arrives; room 7 is then used again: its chunk goes to the region decode assigns
    the new opening and lands bit-exact (main used the late answer: the write went to the
    old region and decode scattered a region nobody wrote, reporting SUCCESS with wrong
    bytes)."""
    with local_cluster(Geometry(1, 1, 2)) as c:
        first = c.add_request(7, num_pages=2, chunk_pages=2, seed=1)
        assert c.send_all([first]) == []
        c.wait_rooms([7])
        c.release([7])
        other = c.add_request(8, num_pages=2, chunk_pages=2, seed=2)
        # Room 8 (another tenant) asks first and gets its region.
        c.writers[0].prefetch(8, [(0, 2)], c.targets)
        manager = c.prefill[0]
        table = _prefill_table(manager)
        session = c.targets[0].session_id
        assert wait_for(lambda: table.get(8, 0, session) is not None)
        theirs = table.get(8, 0, session)
        assert theirs is not None
        again = c.add_request(7, num_pages=2, chunk_pages=2, seed=3)
        c.writers[0].track_room(7, c.targets)  # room 7 opens again on prefill
        # The late answer of the first opening, naming the region room 8 holds now.
        late = StagingRsp(7, 0, theirs.offset, theirs.round, theirs.end, session)
        manager._handle_staging_rsp(late.to_frames())
        assert c.send_all([again, other]) == []
        assert c.wait_rooms([7, 8]) == {7: [RoomStatus.SUCCESS], 8: [RoomStatus.SUCCESS]}
        assert pools_equal(c.decode_pools[0], c.expected_decode_pool(0))


def test_a_fence_of_a_write_in_flight_is_cleared_so_the_room_id_works_again(
    writer_clock: Clock,
) -> None:
    """Decode fences room 1 while its write runs, the room is closed meanwhile, then opened
    again: its chunk is written (main kept the fence for good and refused the room)."""
    r = make_rig(writer_clock)
    r.answer(1, 0, 0, 1024)

    def during() -> None:
        r.fence(1, "aborted")
        r.writer.forget_room(1)

    r.engine.during = during
    r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    r.engine.during = None
    r.writer.track_room(1, r.targets)
    r.answer(1, 0, 0, 1024)
    assert r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets) == 1024
    assert len(r.engine.writes) == 2


class _RacingLiveness(PeerLiveness):
    """A liveness whose first ``watch`` lets a ``forget_room`` of the room run on another
    thread before the watch is counted (the interleaving that left an orphan watch)."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(RecordingSockets(), "tcp://prefill:0", timeout_s=5.0, clock=clock)
        self.race: threading.Thread | None = None

    def watch(self, endpoint: str) -> None:
        race, self.race = self.race, None
        if race is not None:
            race.start()
            # Until forget_room is done, or it is blocked behind the writer's lock (then it
            # unwatches after this watch): either way the interleaving is fixed by now.
            race.join(0.5)
        super().watch(endpoint)


def test_forget_room_racing_track_room_leaves_no_orphan_watch(writer_clock: Clock) -> None:
    """track_room takes its watch while forget_room of the same room runs: once both
    returned, nothing is watched (main counted the watch after forget_room's unwatch: an
    orphan watch that pinged the rank for good)."""
    r: Rig = make_rig(writer_clock)
    liveness = _RacingLiveness(Clock())
    r.writer._liveness = liveness
    liveness.race = threading.Thread(target=r.writer.forget_room, args=(1,))
    race = liveness.race
    r.writer.track_room(1, r.targets)
    race.join(5)
    assert not race.is_alive()
    assert liveness.watched == frozenset()
    assert 1 not in r.writer._room_targets
