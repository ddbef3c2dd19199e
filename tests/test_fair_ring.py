"""A fair ring (issue 24, finding 8, decode side): regions a prefill instance reserves and never
writes are taken back within a bound, so another tenant waits at most about 20 s (30 s is the
promise), whatever the defaults."""

from __future__ import annotations

from staging_contracts._control.liveness import PeerLiveness
from staging_contracts._decode.handler import DecodeStagingHandler, RoomStatus
from staging_contracts._staging.allocator import StagingAllocator
from tests.local_cluster import Geometry
from tests.test_decode_handler import (
    ME,
    P0,
    P1,
    REGION,
    SID,
    Clock,
    RecordingSockets,
    plan,
)

VICTIM_BOUND_S = 30.0
"""The longest another tenant may wait for ring space a non-writing instance holds."""


def default_handler(ring_bytes: int) -> tuple[DecodeStagingHandler, Clock, StagingAllocator]:
    """A handler with every bound at its default, and a liveness in which every peer stays
    alive (it answers PINGs: its clock never moves)."""
    clock = Clock()
    geometry = Geometry(1, 1, 2)
    allocator = StagingAllocator(ring_bytes)
    liveness = PeerLiveness(RecordingSockets(), ME, clock=Clock())
    handler = DecodeStagingHandler(
        allocator=allocator,
        kv_buffers=geometry.empty_pool(1, 0),
        decode_tp=1,
        decode_rank=0,
        total_kv_heads=2,
        session_id=SID,
        sender=RecordingSockets(),
        clock=clock,
        endpoint=ME,
        liveness=liveness,
    )
    return handler, clock, allocator


def req(handler: DecodeStagingHandler, room: int, chunk: int = 0) -> None:
    handler.handle_staging_req(room, chunk, num_pages=2, session_id=SID, pp_rank=None)


def test_an_instance_that_reserves_and_never_writes_delays_another_tenant_at_most_30s() -> None:
    """An instance reserves regions four rounds ahead (one per room) and never writes nor
    answers ROOM_FENCE, but stays alive: the tenant behind it waited for good on main (one
    stall per round, 60 s then 30 s each, and then fences the writer never answers held the
    regions); now its region is writable within 30 s, the instance's rooms fail with a reason
    that says why, and the tenant's room succeeds."""
    handler, clock, allocator = default_handler(REGION)
    hog_rooms = [1, 2, 3, 4]
    for room in hog_rooms:
        handler.register_room(plan(room, pages=2, endpoints=(P0,)))
        req(handler, room)  # each in its own round: the ring holds one region
    handler.register_room(plan(9, pages=2, endpoints=(P1,)))
    req(handler, 9)
    victim = handler._rooms[9].regions[0].allocation
    start = clock.now
    while not allocator.is_ready(victim) and clock.now - start < 600:
        clock.now += 0.5
        handler.progress()
    waited = clock.now - start
    assert waited <= VICTIM_BOUND_S, f"the tenant waited {waited}s for ring space"
    assert handler.room_failure(1) == "no progress for 10.0s while holding a writable region"
    for room in hog_rooms[1:]:
        assert (handler.room_failure(room) or "").startswith("taken back with room 1: ")
    assert handler.poll_room(9) is RoomStatus.TRANSFERRING
    handler.handle_chunk_arrival(9, 0, page_start=0, num_pages=2, session_id=SID, writer_rank=0)
    assert handler.poll_room(9) is RoomStatus.SUCCESS
    for room in [*hog_rooms, 9]:
        handler.release_room(room)
    assert allocator.live_count == 0
    assert handler.fenced_rooms == {}


def test_a_fence_a_live_writer_never_answers_frees_its_regions_after_its_bound() -> None:
    """A writer that stays alive and never answers ROOM_FENCE held the fenced regions for
    good on main; now they are freed ``fence_timeout_s`` (10 s) after the fence was set up."""
    handler, clock, allocator = default_handler(4 * REGION)
    handler.register_room(plan(1, pages=2, endpoints=(P0,)))
    req(handler, 1)
    handler.fail_room(1, "prefill failed the room")
    assert handler.fenced_rooms == {1: frozenset({0})}
    clock.now += 10.0
    handler.progress()
    assert allocator.live_count == 1  # not before the bound
    clock.now += 0.01
    handler.progress()
    assert handler.fenced_rooms == {}
    assert allocator.live_count == 0


def test_only_the_stalled_instance_s_never_written_rooms_are_taken_back() -> None:
    """When a room stalls, its instance's rooms that had an arrival, or hold a region reserved
    less than ``stall_timeout_s`` ago, stay; so do every other instance's rooms."""
    handler, clock, _ = default_handler(64 * REGION)
    handler.register_room(plan(1, pages=2, endpoints=(P0,)))  # will stall
    handler.register_room(plan(2, pages=4, endpoints=(P0,)))  # writes its first chunk
    handler.register_room(plan(3, pages=2, endpoints=(P1,)))  # another instance, idle
    for room in (1, 2, 3):
        req(handler, room)
    req(handler, 2, 1)
    clock.now += 5.0
    handler.handle_chunk_arrival(2, 0, page_start=0, num_pages=2, session_id=SID, writer_rank=0)
    clock.now += 4.0
    handler.register_room(plan(4, pages=2, endpoints=(P0,)))  # reserved only now
    req(handler, 4)
    clock.now += 1.01
    handler.progress()
    assert handler.poll_room(1) is RoomStatus.FAILED
    # Room 3 is another instance's: its own stall (same bound, same start) fails it, not
    # room 1's; room 2 had an arrival and room 4 is young: both live on.
    assert handler.room_failure(3) == "no progress for 10.0s while holding a writable region"
    assert handler.poll_room(2) is RoomStatus.TRANSFERRING
    assert handler.poll_room(4) is RoomStatus.TRANSFERRING


def test_registrations_per_prefill_instance_are_capped_without_keeping_the_refused() -> None:
    """Main kept every registered room, without a cap; now past ``max_rooms_per_peer`` of one
    instance a room is refused with a reason, keeps no state (a flood of refusals leaves the
    room table as it was), other instances still register, and a released room makes room."""
    handler, _, _ = default_handler(4 * REGION)
    handler._max_rooms_per_peer = 3  # the default, DEFAULT_MAX_ROOMS_PER_PEER, is 1024
    for room in (1, 2, 3):
        assert handler.register_room(plan(room, pages=2, endpoints=(P0,))) is RoomStatus.REGISTERED
    for room in range(100, 5100):
        assert handler.register_room(plan(room, pages=2, endpoints=(P0,))) is RoomStatus.FAILED
    assert handler.live_rooms == 3
    assert handler.poll_room(5099) is None
    assert handler.room_failure(5099) == (
        f"registration refused: prefill instance {P0} already has 3 rooms registered "
        "(max_rooms_per_peer=3)"
    )
    assert len(handler._refused) <= 1024
    assert handler.register_room(plan(7, pages=2, endpoints=(P1,))) is RoomStatus.REGISTERED
    handler.release_room(5099)  # a refused room: nothing to tear down
    handler.release_room(1)
    assert handler.register_room(plan(8, pages=2, endpoints=(P0,))) is RoomStatus.REGISTERED
    assert handler.register_room(plan(9, pages=2, endpoints=(P0,))) is RoomStatus.FAILED
    for room in (2, 3, 7, 8):
        handler.release_room(room)
    assert handler.live_rooms == 0
    assert handler._rooms_per_peer == {}
