"""DecodeStagingHandler in isolation: a recording sender, a fake clock, a fake liveness clock.

Every test drives the handler directly (no listener thread) and checks what it decided: the
outcome, the room's status and failure, the ring's allocations, and the exact frames it sent
to each prefill peer.
"""

from __future__ import annotations

import logging
import threading
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import pytest
import torch

from staging_contracts import ArrivalOutcome, StagingReqOutcome
from staging_contracts._control.liveness import PeerLiveness
from staging_contracts._control.room_messages import RoomFailed, RoomFence, RoomFenced
from staging_contracts._control.transport import PeerSockets
from staging_contracts._control.wire import ChunkReady, StagingReq, StagingRsp, WatermarkUpdate
from staging_contracts._decode import handler as handler_module
from staging_contracts._decode.handler import (
    DEFAULT_FENCE_RESEND_S,
    WAIT_SLICE_S,
    DecodeStagingHandler,
    PrefillPeer,
    RoomPlan,
    RoomStatus,
    peers_for,
)
from staging_contracts._decode.rooms import ChunkRegion
from staging_contracts._staging.allocator import StagingAllocator
from staging_contracts._staging.ordering import HostOrdering
from staging_contracts.outcomes import FailureReason, RoomFailure
from staging_contracts.protocols import Allocation, KVBufferTensors
from tests.local_cluster import Geometry

SID = "decode-0"
"""The handler's session id."""
ME = "tcp://decode:1"
"""The handler's own endpoint (where fences are answered)."""
P0, P1, P2, P3 = (f"tcp://prefill:{rank}" for rank in range(4))
REGION = 1024
"""Bytes of a two-page chunk region for Geometry(1, 1, 2) (and of each writer pair below)."""


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class RecordingSockets(PeerSockets):
    """PeerSockets that record every message instead of sending it."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, list[bytes]]] = []
        self.full: set[str] = set()
        """Endpoints whose queue is full: sends to them are refused."""

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool:
        if endpoint in self.full:
            return False
        self.sent.append((endpoint, list(frames)))
        return True

    def forget(self, endpoint: str) -> None:
        self.full.discard(endpoint)

    def take(self) -> list[tuple[str, list[bytes]]]:
        """The messages sent since the last call."""
        out, self.sent = self.sent, []
        return out


@dataclass
class Rig:
    """A handler with its fakes."""

    handler: DecodeStagingHandler
    sender: RecordingSockets
    clock: Clock
    liveness: PeerLiveness | None
    allocator: StagingAllocator
    live_clock: Clock = field(default_factory=Clock)

    def watermark(self) -> list[bytes]:
        """The ring's current watermark as the handler encodes it."""
        mark = self.allocator.get_watermark()
        return WatermarkUpdate(mark.round, mark.tail, SID).to_frames()

    def req(
        self, room: int, chunk: int, pages: int = 2, *, session: str = SID, pp: int | None = None
    ) -> StagingReqOutcome:
        return self.handler.handle_staging_req(
            room, chunk, num_pages=pages, session_id=session, pp_rank=pp
        )

    def arrive(
        self,
        room: int,
        chunk: int,
        writer: int | None,
        *,
        page_start: int | None = None,
        pages: int = 2,
        session: str = SID,
    ) -> ArrivalOutcome:
        start = chunk * 2 if page_start is None else page_start
        return self.handler.handle_chunk_arrival(
            room, chunk, page_start=start, num_pages=pages, session_id=session, writer_rank=writer
        )

    def watches(self) -> dict[str, int]:
        assert self.liveness is not None
        return dict(self.liveness._watchers)

    def kill(self, *endpoints: str) -> None:
        """Declare ``endpoints`` dead in the liveness (they must be watched); the other
        watched peers are heard from."""
        assert self.liveness is not None
        self.live_clock.now += self.liveness.timeout_s + 1
        for other in self.liveness.watched - set(endpoints):
            self.liveness.heard(other)
        self.liveness.tick()
        assert all(self.liveness.is_dead(endpoint) for endpoint in endpoints)


def rig(
    prefill_tp: int = 1,
    decode_tp: int = 1,
    heads: int = 2,
    *,
    decode_rank: int = 0,
    ring_bytes: int = 1 << 16,
    stall_timeout_s: float = 60.0,
    fence_resend_s: float = DEFAULT_FENCE_RESEND_S,
    liveness: bool = True,
    accept_anonymous: bool = False,
    ring_share: float = 1.0,
) -> Rig:
    """A handler for the geometry, its recording sender, fake clocks and liveness."""
    geometry = Geometry(prefill_tp, decode_tp, heads)
    sender = RecordingSockets()
    clock = Clock()
    live_clock = Clock()
    watcher = (
        PeerLiveness(RecordingSockets(), ME, interval_s=1.0, timeout_s=5.0, clock=live_clock)
        if liveness
        else None
    )
    allocator = StagingAllocator(ring_bytes)
    handler = DecodeStagingHandler(
        allocator=allocator,
        kv_buffers=geometry.empty_pool(decode_tp, decode_rank),
        decode_tp=decode_tp,
        decode_rank=decode_rank,
        total_kv_heads=heads,
        session_id=SID,
        sender=sender,
        stall_timeout_s=stall_timeout_s,
        clock=clock,
        endpoint=ME,
        liveness=watcher,
        fence_resend_s=fence_resend_s,
        accept_anonymous_arrivals=accept_anonymous,
        ring_share=ring_share,
    )
    return Rig(handler, sender, clock, watcher, allocator, live_clock)


def plan(
    room: int,
    pages: int = 4,
    *,
    chunk_pages: int = 2,
    prefill_tp: int = 1,
    endpoints: Sequence[str] = (P0,),
    prefix_tokens: int = 0,
) -> RoomPlan:
    """A room of ``pages`` decode pages starting at page 10, one peer per endpoint."""
    peers = tuple(PrefillPeer(rank, endpoint) for rank, endpoint in enumerate(endpoints))
    return RoomPlan(
        room, tuple(range(10, 10 + pages)), chunk_pages, prefill_tp, peers, prefix_tokens
    )


def rooms_checked(r: Rig, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one for each room a progress pass looks at from now on."""
    checked: list[int] = []
    look = r.handler._idle_too_long

    def counted(state: object, now: float) -> bool:
        checked.append(1)
        return look(state, now)  # type: ignore[arg-type]

    monkeypatch.setattr(r.handler, "_idle_too_long", counted)
    return checked


def raw_status(r: Rig, room: int) -> RoomStatus:
    """A room's status without the progress pass of poll_room."""
    return r.handler._rooms[room].status


def bounded_waits(r: Rig, step: float) -> list[float | None]:
    """Replace the handler's condition wait: each call is recorded and moves the handler's
    clock by ``step``; a hundred calls fail the test (a wait loop that never ends)."""
    waits: list[float | None] = []

    def wait(timeout: float | None = None) -> bool:
        assert len(waits) < 100, "the wait loop never ends"
        waits.append(timeout)
        r.clock.now += step
        return False

    r.handler._idle.wait = wait  # type: ignore[method-assign]
    return waits


def rsp(room: int, chunk: int, alloc: tuple[int, int, int]) -> list[bytes]:
    offset, alloc_round, end = alloc
    return StagingRsp(room, chunk, offset, alloc_round, end, SID).to_frames()


def refusal(room: int, chunk: int, session: str = SID) -> list[bytes]:
    return StagingRsp.oversized(room, chunk, session).to_frames()


def fence(room: int, reason: str) -> list[bytes]:
    return RoomFence(room, SID, ME, reason).to_frames()


class FakeEvent:
    """A CUDA-like scatter event that completes when told."""

    def __init__(self) -> None:
        self.done = False
        self.synchronized = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


# --------------------------------------------------------------------------- construction


def test_properties_report_the_rank_and_its_ring() -> None:
    """decode_tp, decode_rank, allocator and session_id are what the handler was built with."""
    r = rig(2, 2, 4, decode_rank=1)
    assert (r.handler.decode_tp, r.handler.decode_rank) == (2, 1)
    assert r.handler.allocator is r.allocator
    assert r.handler.session_id == SID
    assert r.handler.live_rooms == 0
    assert r.handler.fenced_rooms == {}


def test_defaults_are_the_documented_ones() -> None:
    """The fence resend default is half a second; waits re-check every 10 ms."""
    assert DEFAULT_FENCE_RESEND_S == 0.5
    assert WAIT_SLICE_S == 0.01


def test_peers_for_names_the_writers_of_each_decode_rank() -> None:
    """peers_for picks the prefill ranks that feed a decode rank, with their endpoints."""
    endpoints = [P0, P1, P2, P3]
    assert peers_for(endpoints, 4, 2, 1) == (PrefillPeer(2, P2), PrefillPeer(3, P3))
    assert peers_for(endpoints, 4, 2, 0) == (PrefillPeer(0, P0), PrefillPeer(1, P1))
    assert peers_for(endpoints[:1], 1, 2, 1) == (PrefillPeer(0, P0),)


# --------------------------------------------------------------------------- register_room


def test_a_good_room_registers_watches_its_peers_and_sends_nothing() -> None:
    """A valid plan is REGISTERED, counted live, its peers watched once each."""
    r = rig(2, 1, 4)
    status = r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    assert status is RoomStatus.REGISTERED
    assert r.handler.poll_room(1) is RoomStatus.REGISTERED
    assert r.handler.room_failure(1) is None
    assert r.handler.live_rooms == 1
    assert r.watches() == {P0: 1, P1: 1}
    assert r.sender.sent == []


def test_registering_twice_keeps_the_first_registration() -> None:
    """A second registration returns the room's status and changes nothing, not even watches."""
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 0)
    assert r.handler.register_room(plan(1, endpoints=(P1,))) is RoomStatus.TRANSFERRING
    assert r.watches() == {P0: 1}
    assert r.allocator.live_count == 1


@pytest.mark.parametrize(
    ("room_plan", "reason"),
    [
        (plan(1, prefix_tokens=3), "decode prefix of 3 tokens is not aligned to page_size=4"),
        (plan(1, prefix_tokens=2), "decode prefix of 2 tokens is not aligned to page_size=4"),
        (plan(1, chunk_pages=0), "empty transfer or chunk_pages=0 < 1"),
        (plan(1, pages=0), "empty transfer or chunk_pages=2 < 1"),
        (
            RoomPlan(1, (10, 64), 2, 1, (PrefillPeer(0, P0),)),
            "page indices outside the pool of 64 pages",
        ),
        (
            RoomPlan(1, (-1, 10), 2, 1, (PrefillPeer(0, P0),)),
            "page indices outside the pool of 64 pages",
        ),
        (
            RoomPlan(1, (10, 11), 2, 1, (PrefillPeer(0, P0, 0), PrefillPeer(0, P1, 1))),
            "a pipeline-parallel prefill (peers of several pp ranks) is not supported by the "
            "staging path yet: each writer must carry every layer",
        ),
        (
            plan(1, prefill_tp=2, endpoints=(P0,)),
            "no endpoint registered for prefill writer ranks [1]",
        ),
        (
            RoomPlan(1, (10, 11), 2, 4, (PrefillPeer(1, P1),)),
            "no endpoint registered for prefill writer ranks [0, 2, 3]",
        ),
    ],
    ids=[
        "prefix-3",
        "prefix-2",
        "chunk-pages-0",
        "no-pages",
        "page-past-pool",
        "negative-page",
        "pipeline",
        "missing-writer",
        "missing-writers",
    ],
)
def test_a_bad_plan_fails_its_room_with_the_reason(room_plan: RoomPlan, reason: str) -> None:
    """Every kind of bad plan fails the room at registration and says why: a refusal
    (typed there, whatever the wording), also in the room tally the metrics export."""
    r = rig(4, 1, 4)
    assert r.handler.register_room(room_plan) is RoomStatus.FAILED
    assert r.handler.room_failure(1) == reason
    assert r.handler.room_failure_record(1) == RoomFailure(FailureReason.REFUSED, reason)
    assert r.handler.room_tally().ended == (("failed", str(FailureReason.REFUSED), 1),)
    assert r.handler.poll_room(1) is RoomStatus.FAILED
    assert r.handler.live_rooms == 1
    assert r.handler.fenced_rooms == {}


def test_a_tp_pair_that_cannot_split_the_heads_fails_the_room() -> None:
    """validate_tp_pair's complaint becomes the room's failure."""
    r = rig(1, 1, 2)
    assert r.handler.register_room(plan(1, prefill_tp=3)) is RoomStatus.FAILED
    assert r.handler.room_failure(1) == "total_kv_heads=2 and prefill_tp=3 must divide one another"


def test_plans_at_the_edges_are_accepted() -> None:
    """An aligned prefix, one page per chunk and the pool's first and last pages are fine."""
    r = rig()
    good = [
        plan(1, prefix_tokens=8),
        plan(2, chunk_pages=1),
        RoomPlan(3, (0, 63), 2, 1, (PrefillPeer(0, P0),)),
        RoomPlan(4, (10, 11), 2, 1, (PrefillPeer(0, P0, 1), PrefillPeer(0, P1, 1))),
    ]
    assert [r.handler.register_room(p) for p in good] == [RoomStatus.REGISTERED] * 4


def test_the_stall_timer_starts_when_the_first_region_is_allocated() -> None:
    """Time before the room's first region does not count towards a stall."""
    r = rig(stall_timeout_s=5.0)
    r.handler.register_room(plan(1))
    r.clock.now += 30
    r.handler.progress()
    assert r.handler.poll_room(1) is RoomStatus.REGISTERED
    r.req(1, 0)
    r.clock.now += 5
    r.handler.progress()
    assert r.handler.poll_room(1) is RoomStatus.TRANSFERRING
    r.clock.now += 0.5
    r.handler.progress()
    assert r.handler.poll_room(1) is RoomStatus.FAILED


# --------------------------------------------------------------------------- STAGING_REQ


def test_unknown_room_is_dropped_without_an_answer() -> None:
    """A STAGING_REQ for no registered room returns UNKNOWN_ROOM and sends nothing."""
    r = rig()
    assert r.req(5, 0) is StagingReqOutcome.UNKNOWN_ROOM
    assert r.sender.sent == []


def test_first_request_allocates_and_answers_every_peer_with_the_watermark() -> None:
    """ALLOCATED: each peer gets STAGING_RSP of the region, then the current WATERMARK."""
    r = rig(2, 1, 4)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    assert r.req(1, 1) is StagingReqOutcome.ALLOCATED
    assert r.handler.poll_room(1) is RoomStatus.TRANSFERRING
    assert r.allocator.live_count == 1
    answer = rsp(1, 1, (0, 0, REGION * 2))
    mark = r.watermark()
    assert r.sender.take() == [(P0, answer), (P0, mark), (P1, answer), (P1, mark)]
    assert r.handler._publisher.subscribers == (P0, P1)


def test_second_request_shares_the_region_and_forces_the_watermark() -> None:
    """SHARED: the same region is re-announced and the watermark re-sent even if unchanged."""
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 0)
    r.sender.take()
    assert r.req(1, 0) is StagingReqOutcome.SHARED
    assert r.allocator.live_count == 1
    assert r.sender.take() == [(P0, rsp(1, 0, (0, 0, REGION))), (P0, r.watermark())]


def test_a_new_region_skips_a_watermark_the_peer_already_has() -> None:
    """ALLOCATED does not re-send an unchanged watermark to a peer that has it."""
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 0)
    r.sender.take()
    assert r.req(1, 1) is StagingReqOutcome.ALLOCATED
    assert r.sender.take() == [(P0, rsp(1, 1, (REGION, 0, 2 * REGION)))]


def test_the_last_chunk_gets_a_region_of_its_own_size() -> None:
    """A short last chunk is sized by its own page count and placed after the others."""
    r = rig()
    r.handler.register_room(plan(1, pages=3))
    assert r.req(1, 1, pages=1) is StagingReqOutcome.ALLOCATED
    assert r.sender.take()[0] == (P0, rsp(1, 1, (0, 0, REGION // 2)))
    assert r.arrive(1, 1, 0, page_start=2, pages=1) is ArrivalOutcome.COMPLETE


def test_the_answer_goes_only_to_peers_of_the_requesting_stage() -> None:
    """With pp_rank given, only peers of that pipeline stage are answered and subscribed."""
    r = rig(2, 1, 4)
    peers = (PrefillPeer(0, P0, 1), PrefillPeer(1, P1, 1))
    r.handler.register_room(RoomPlan(1, (10, 11), 2, 2, peers))
    assert r.req(1, 0, pp=0) is StagingReqOutcome.ALLOCATED
    assert r.sender.take() == []
    assert r.handler._publisher.subscribers == ()
    assert r.req(1, 0, pp=1) is StagingReqOutcome.SHARED
    assert [endpoint for endpoint, _ in r.sender.take()] == [P0, P0, P1, P1]


def test_request_for_another_session_is_refused_without_failing_the_room() -> None:
    """A STAGING_REQ naming another decode session gets the -2 answer; the room lives on."""
    r = rig()
    r.handler.register_room(plan(1))
    assert r.req(1, 0, session="other") is StagingReqOutcome.REJECTED
    assert r.sender.take() == [(P0, refusal(1, 0, "other"))]
    assert r.handler.poll_room(1) is RoomStatus.REGISTERED
    assert r.handler.room_failure(1) is None
    assert r.allocator.live_count == 0


def test_request_for_a_failed_room_is_refused() -> None:
    """Once the room failed, every STAGING_REQ gets the -2 answer, the room's ROOM_FAILED
    (its cause) going first, once: the writer fails the room for that cause, not as a
    refusal."""
    r = rig()
    r.handler.register_room(plan(1))
    opening = r.handler.opening(1)
    assert opening is not None
    r.handler.fail_room(1, "gone")
    r.sender.take()
    assert r.req(1, 0) is StagingReqOutcome.REJECTED
    sent = r.sender.take()
    assert [endpoint for endpoint, _ in sent] == [P0, P0]
    assert RoomFailed.from_frames(sent[0][1]) == RoomFailed(1, "gone", opening, ME)
    assert sent[1][1] == refusal(1, 0)
    assert r.req(1, 0) is StagingReqOutcome.REJECTED
    assert r.sender.take() == [(P0, refusal(1, 0))]
    assert r.handler.room_failure(1) == "gone"


def test_request_beyond_the_last_chunk_is_refused() -> None:
    """Chunk num_chunks is one too far; num_chunks - 1 is the last one."""
    r = rig()
    r.handler.register_room(plan(1, pages=3))
    assert r.req(1, 2, pages=1) is StagingReqOutcome.REJECTED
    assert r.sender.take() == [(P0, refusal(1, 2))]
    assert r.handler.poll_room(1) is RoomStatus.REGISTERED
    assert r.req(1, 1, pages=1) is StagingReqOutcome.ALLOCATED


def test_request_for_a_consumed_chunk_is_refused() -> None:
    """A chunk already scattered is refused; the room is not failed."""
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 0)
    assert r.arrive(1, 0, 0) is ArrivalOutcome.COMPLETE
    r.sender.take()
    assert r.req(1, 0) is StagingReqOutcome.REJECTED
    assert r.sender.take() == [(P0, refusal(1, 0))]
    assert r.handler.poll_room(1) is RoomStatus.TRANSFERRING
    assert r.allocator.live_count == 0


def test_page_count_disagreement_fails_the_room_and_refuses() -> None:
    """A STAGING_REQ whose page count differs from the plan fails the room with both counts."""
    r = rig()
    r.handler.register_room(plan(1))
    assert r.req(1, 1, pages=3) is StagingReqOutcome.REJECTED
    assert r.handler.room_failure(1) == "chunk 1: STAGING_REQ says 3 pages, decode registered 2"
    assert r.sender.take() == [(P0, refusal(1, 1))]


def test_a_chunk_larger_than_the_ring_is_oversized() -> None:
    """OVERSIZED: the room fails naming both sizes and every peer gets the -2 answer."""
    r = rig(2, 1, 4, ring_bytes=REGION)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    assert r.req(1, 0) is StagingReqOutcome.OVERSIZED
    assert r.handler.room_failure(1) == f"chunk 0 needs {2 * REGION} bytes, the ring has {REGION}"
    assert r.sender.take() == [(P0, refusal(1, 0)), (P1, refusal(1, 0))]
    assert r.allocator.live_count == 0


def test_a_chunk_that_exactly_fills_the_ring_is_allocated() -> None:
    """A region of exactly the ring's size fits."""
    r = rig(ring_bytes=REGION)
    r.handler.register_room(plan(1))
    assert r.req(1, 0) is StagingReqOutcome.ALLOCATED


def test_request_while_closing_is_dropped() -> None:
    """A room being released takes no more STAGING_REQ."""
    r = rig()
    r.handler.register_room(plan(1))
    r.handler._rooms[1].closing = True
    assert r.req(1, 0) is StagingReqOutcome.UNKNOWN_ROOM
    assert r.sender.sent == []


def test_a_request_sends_due_fences() -> None:
    """Handling a STAGING_REQ also re-sends fences that are due."""
    r = rig(2, 1, 4)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    r.handler.register_room(plan(2))
    r.req(1, 0)
    r.handler.fail_room(1, "x")
    r.sender.take()
    r.clock.now += DEFAULT_FENCE_RESEND_S
    r.req(2, 0)
    sent = r.sender.take()
    assert (P0, fence(1, "x")) in sent
    assert (P1, fence(1, "x")) in sent


# --------------------------------------------------------------------------- arrivals


def test_arrivals_wait_for_every_writer_then_scatter_and_free() -> None:
    """WAITING until the last writer, then COMPLETE: region freed, watermark broadcast."""
    r = rig(2, 1, 4)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    r.req(1, 0)
    r.sender.take()
    assert r.arrive(1, 0, 1) is ArrivalOutcome.WAITING
    assert r.arrive(1, 0, 1) is ArrivalOutcome.DUPLICATE
    assert r.allocator.live_count == 1
    assert r.sender.sent == []
    assert r.arrive(1, 0, 0) is ArrivalOutcome.COMPLETE
    assert r.allocator.live_count == 0
    assert r.sender.take() == [(P0, r.watermark()), (P1, r.watermark())]
    assert r.arrive(1, 0, 0) is ArrivalOutcome.DUPLICATE
    assert r.handler.poll_room(1) is RoomStatus.TRANSFERRING
    r.req(1, 1)
    assert r.arrive(1, 1, 0) is ArrivalOutcome.WAITING
    assert r.arrive(1, 1, 1) is ArrivalOutcome.COMPLETE
    assert r.handler.poll_room(1) is RoomStatus.SUCCESS


def test_arrival_scatters_the_staged_bytes_into_the_plan_pages() -> None:
    """The complete chunk's ring bytes land in the decode pool at the plan's pages."""
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 1)
    r.allocator.buffer[:REGION] = torch.arange(REGION, dtype=torch.int64).to(torch.uint8)
    assert r.arrive(1, 1, 0) is ArrivalOutcome.COMPLETE
    pool = r.handler._scatterer._kv
    rows = torch.tensor([p * 4 + t for p in (12, 13) for t in range(4)])
    touched = pool.k_buffers[0][rows]
    assert bool(touched.view(torch.int16).ne(0).any())
    others = torch.ones(64 * 4, dtype=torch.bool)
    others[rows] = False
    assert not bool(pool.k_buffers[0][others].view(torch.int16).ne(0).any())


def test_arrival_for_an_unknown_room_or_chunk_is_unknown() -> None:
    """No room, or no region for the chunk, is UNKNOWN and changes nothing."""
    r = rig()
    assert r.arrive(9, 0, 0) is ArrivalOutcome.UNKNOWN
    r.handler.register_room(plan(1))
    assert r.arrive(1, 0, 0) is ArrivalOutcome.UNKNOWN
    assert r.handler.poll_room(1) is RoomStatus.REGISTERED


def test_arrival_for_a_closing_or_failed_room_is_unknown() -> None:
    """A room being released or already failed ignores arrivals."""
    r = rig()
    r.handler.register_room(plan(1))
    r.handler.register_room(plan(2))
    r.req(1, 0)
    r.req(2, 0)
    r.handler._rooms[1].closing = True
    assert r.arrive(1, 0, 0) is ArrivalOutcome.UNKNOWN
    r.handler.fail_room(2, "x")
    assert r.arrive(2, 0, 0) is ArrivalOutcome.UNKNOWN


def test_arrival_for_another_session_fails_the_room() -> None:
    """An arrival naming another decode session is REJECTED and fails the room."""
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 0)
    assert r.arrive(1, 0, 0, session="other") is ArrivalOutcome.REJECTED
    assert r.handler.room_failure(1) == "arrival for session 'other', this rank is 'decode-0'"


@pytest.mark.parametrize(
    ("page_start", "pages", "reason"),
    [
        (0, 2, "arrival covers pages [0, 2), the region holds [2, 4)"),
        (2, 1, "arrival covers pages [2, 3), the region holds [2, 4)"),
    ],
    ids=["other-start", "fewer-pages"],
)
def test_arrival_with_other_pages_fails_the_room(page_start: int, pages: int, reason: str) -> None:
    """An arrival's page range must be the region's."""
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 1)
    assert r.arrive(1, 1, 0, page_start=page_start, pages=pages) is ArrivalOutcome.REJECTED
    assert r.handler.room_failure(1) == reason


def test_a_rejected_arrival_fences_and_broadcasts() -> None:
    """REJECTED sends ROOM_FENCE to the writers not landed, then the watermark."""
    r = rig(2, 1, 4)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    r.req(1, 0)
    r.arrive(1, 0, 0)
    r.sender.take()
    assert r.arrive(1, 0, 1, pages=1) is ArrivalOutcome.REJECTED
    assert r.handler.fenced_rooms == {1: frozenset({1})}
    reason = "arrival covers pages [0, 1), the region holds [0, 2)"
    assert r.sender.take() == [(P1, fence(1, reason)), (P0, r.watermark()), (P1, r.watermark())]
    assert r.allocator.live_count == 1


def test_arrival_from_a_writer_not_feeding_this_rank_fails_the_room() -> None:
    """A writer rank outside the rank's writers fails the room."""
    r = rig(4, 2, 8, decode_rank=1)
    r.handler.register_room(plan(1, prefill_tp=4, endpoints=(P0, P1, P2, P3)))
    r.req(1, 0)
    assert r.arrive(1, 0, 1) is ArrivalOutcome.REJECTED
    assert r.handler.room_failure(1) == "writer rank 1 does not feed decode rank 1"


def test_an_anonymous_arrival_in_a_shared_region_fails_the_room() -> None:
    """Without a writer rank, an arrival in a region of two writers is refused."""
    r = rig(2, 1, 4)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    r.req(1, 0)
    assert r.arrive(1, 0, None) is ArrivalOutcome.REJECTED
    assert r.handler.room_failure(1) == (
        "an arrival without a writer rank in a region of 2 writers cannot be told from a duplicate"
    )
    assert r.handler.fenced_rooms == {1: frozenset({0, 1})}


def test_anonymous_arrivals_count_when_accepted() -> None:
    """With accept_anonymous_arrivals, two anonymous arrivals complete a two-writer region."""
    r = rig(2, 1, 4, accept_anonymous=True)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    r.req(1, 0)
    assert r.arrive(1, 0, None) is ArrivalOutcome.WAITING
    assert r.arrive(1, 0, None) is ArrivalOutcome.COMPLETE


def test_an_anonymous_arrival_fences_every_writer() -> None:
    """After an anonymous arrival, a failure fences every writer: any may still write."""
    r = rig(2, 1, 4, accept_anonymous=True)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    r.req(1, 0)
    r.arrive(1, 0, None)
    r.handler.fail_room(1, "x")
    assert r.handler.fenced_rooms == {1: frozenset({0, 1})}


def test_an_anonymous_single_writer_completes_its_region() -> None:
    """One writer, no rank given: the region completes; a repeat is a duplicate."""
    r = rig()
    r.handler.register_room(plan(1, pages=2))
    r.req(1, 0)
    assert r.arrive(1, 0, None) is ArrivalOutcome.COMPLETE
    assert r.arrive(1, 0, None) is ArrivalOutcome.DUPLICATE
    assert r.handler.poll_room(1) is RoomStatus.SUCCESS


def test_an_arrival_is_progress_for_the_stall_timer() -> None:
    """Each arrival restarts the room's stall timer."""
    r = rig(2, 1, 4, stall_timeout_s=5.0)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    r.req(1, 0)
    r.clock.now += 4
    r.arrive(1, 0, 0)
    r.clock.now += 4
    r.handler.progress()
    assert r.handler.poll_room(1) is RoomStatus.TRANSFERRING
    r.clock.now += 2
    r.handler.progress()
    assert r.handler.poll_room(1) is RoomStatus.FAILED


def test_a_failed_scatter_fails_the_room_frees_and_broadcasts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scatter that raises: REJECTED, the reason recorded, the region freed at once."""
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 0)
    r.sender.take()

    def boom(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(r.handler._scatterer, "scatter", boom)
    assert r.arrive(1, 0, 0) is ArrivalOutcome.REJECTED
    assert r.handler.room_failure(1) == "scatter of chunk 0 failed: boom"
    assert r.allocator.live_count == 0
    assert r.handler._rooms[1].scattering == 0
    assert r.handler.fenced_rooms == {}
    assert r.sender.take() == [(P0, r.watermark())]
    r.handler.release_room(1, timeout=0.0)
    assert r.handler.live_rooms == 0


def test_an_asynchronous_scatter_frees_its_region_when_its_event_completes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scatter that returns an event holds its region until progress sees it done."""
    r = rig()
    r.handler.register_room(plan(1, pages=2))
    r.req(1, 0)
    r.sender.take()
    event = FakeEvent()
    monkeypatch.setattr(r.handler._scatterer, "scatter", lambda *args: event)
    assert r.arrive(1, 0, 0) is ArrivalOutcome.COMPLETE
    assert r.sender.take() == []
    assert r.allocator.live_count == 1
    r.handler.progress()
    assert r.handler.poll_room(1) is RoomStatus.TRANSFERRING
    assert r.allocator.live_count == 1
    assert r.sender.sent == []
    event.done = True
    assert r.handler.poll_room(1) is RoomStatus.SUCCESS
    assert r.allocator.live_count == 0
    assert r.sender.take() == [(P0, r.watermark())]


def test_a_poll_reaps_its_own_room_at_once_and_the_full_pass_once_per_slice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scheduler polling many rooms pays one pass over every room per wait slice, not one
    per poll; the polled room's own finished scatter is still reaped by its poll at once."""
    r = rig()
    r.handler.register_room(plan(1, pages=2))
    r.handler.register_room(plan(2, pages=2))
    r.req(1, 0)
    r.sender.take()
    event = FakeEvent()
    monkeypatch.setattr(r.handler._scatterer, "scatter", lambda *args: event)
    r.arrive(1, 0, 0)
    passes = rooms_checked(r, monkeypatch)
    for _ in range(100):
        assert r.handler.poll_room(2) is RoomStatus.REGISTERED
    assert len(passes) == 2  # one pass (two rooms), then none while the clock stands
    event.done = True
    assert r.handler.poll_room(1) is RoomStatus.SUCCESS  # no pass due: reaped by its poll
    assert len(passes) == 2
    assert r.sender.take() == [(P0, r.watermark())]
    r.clock.now += handler_module.WAIT_SLICE_S
    r.handler.poll_room(2)
    assert len(passes) == 4  # a slice later, one more pass


def test_release_waits_for_pending_events_and_frees_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """release_room polls a pending scatter event (never synchronizes it: a hung device would
    hold the caller and the listener's lock for good) until it completed, then frees it."""
    r = rig()
    r.handler.register_room(plan(1, pages=2))
    r.req(1, 0)
    event = FakeEvent()
    monkeypatch.setattr(r.handler._scatterer, "scatter", lambda *args: event)
    r.arrive(1, 0, 0)
    waits = fake_waits(r, monkeypatch, {2: lambda: setattr(event, "done", True)})
    r.handler.release_room(1)
    assert event.synchronized == 0
    assert waits.waits == [handler_module.WAIT_SLICE_S] * 2
    assert r.allocator.live_count == 0
    assert r.handler.fenced_rooms == {}
    assert r.handler.live_rooms == 0


# --------------------------------------------------------------------------- success


def test_a_room_succeeds_only_when_every_chunk_is_consumed() -> None:
    """SUCCESS needs every chunk scattered; wait_room returns it at once."""
    r = rig()
    r.handler.register_room(plan(1, pages=4))
    r.req(1, 0)
    r.arrive(1, 0, 0)
    assert r.handler.wait_room(1, 0.0) is RoomStatus.TRANSFERRING
    r.req(1, 1)
    r.arrive(1, 1, 0)
    assert r.handler.wait_room(1, 5.0) is RoomStatus.SUCCESS


def test_wait_room_of_an_unknown_room_is_none() -> None:
    """wait_room and poll_room return None for a room never registered."""
    r = rig()
    assert r.handler.wait_room(3, 5.0) is None
    assert r.handler.poll_room(3) is None
    assert r.handler.room_failure(3) is None


def test_wait_room_returns_a_failure_at_once() -> None:
    """A failed room ends the wait with FAILED."""
    r = rig()
    r.handler.register_room(plan(1))
    r.handler.fail_room(1, "x")
    assert r.handler.wait_room(1, 5.0) is RoomStatus.FAILED


def test_wait_room_is_woken_by_the_completing_arrival() -> None:
    """A waiter blocked in wait_room returns SUCCESS as soon as the last arrival scatters."""
    r = rig()
    r.handler.register_room(plan(1, pages=2))
    r.req(1, 0)
    result: list[RoomStatus | None] = []
    waiter = threading.Thread(target=lambda: result.append(r.handler.wait_room(1, 5.0)))
    waiter.start()
    r.arrive(1, 0, 0)
    waiter.join(5)
    assert result == [RoomStatus.SUCCESS]


def test_many_waiters_share_one_progress_pass_per_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fifty threads in wait_room make about one progress pass per wait slice between them,
    not one each: a pass per waiter per slice (a demo rank's 150 waiters) held the handler's
    lock so often that the listener thread starved and live peers were declared dead."""
    r = rig()
    monkeypatch.setattr(r.handler, "_clock", time.monotonic)  # slices pass in real time
    r.handler.register_room(plan(1))
    passes = rooms_checked(r, monkeypatch)
    waiters = [threading.Thread(target=r.handler.wait_room, args=(1, 0.3)) for _ in range(50)]
    for waiter in waiters:
        waiter.start()
    for waiter in waiters:
        waiter.join(5)
    slices = 0.3 / handler_module.WAIT_SLICE_S
    assert raw_status(r, 1) is RoomStatus.REGISTERED  # every waiter waited its 0.3 s
    assert 1 <= len(passes) <= 3 * slices, len(passes)  # 50 waiters each: ~1,500


def test_wait_room_times_out_with_the_current_status() -> None:
    """A room still transferring after the bound is returned as it stands."""
    r = rig()
    r.handler.register_room(plan(1))
    assert r.handler.wait_room(1, 0.02) is RoomStatus.REGISTERED


# --------------------------------------------------------------------------- fail_room


def test_fail_room_without_regions_frees_nothing_and_fences_nothing() -> None:
    """A room with no region fails; nothing is fenced; the watermark is broadcast."""
    r = rig()
    r.handler.register_room(plan(1))
    r.handler.fail_room(1, "aborted")
    assert r.handler.room_failure(1) == "aborted"
    assert r.handler.fenced_rooms == {}
    assert r.sender.sent == []  # no subscriber yet


def test_fail_room_fences_the_writers_that_did_not_land() -> None:
    """Writers that arrived are not fenced; the others get ROOM_FENCE and hold the regions."""
    r = rig(2, 1, 4)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    r.req(1, 0)
    r.req(1, 1)
    r.arrive(1, 0, 0)
    r.arrive(1, 1, 0)
    r.sender.take()
    r.handler.fail_room(1, "aborted")
    assert r.handler.fenced_rooms == {1: frozenset({1})}
    assert r.handler._fences[1].allocations == [0, 1]
    assert r.allocator.live_count == 2
    assert r.sender.take() == [(P1, fence(1, "aborted")), (P0, r.watermark()), (P1, r.watermark())]
    assert r.watches() == {P0: 1, P1: 2}


def test_fail_room_twice_keeps_the_first_reason() -> None:
    """A second failure of a failed room changes nothing."""
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 0)
    r.handler.fail_room(1, "first")
    r.handler.fail_room(1, "second")
    assert r.handler.room_failure(1) == "first"
    assert r.handler._fences[1].reason == "first"


def test_fail_room_of_an_unknown_room_does_nothing() -> None:
    """Failing a room never registered is a no-op."""
    r = rig()
    r.handler.fail_room(7, "x")
    assert r.handler.live_rooms == 0
    assert r.sender.sent == []


def test_a_writer_already_dead_is_not_fenced() -> None:
    """A dead writer is not waited for: with no live writer left, the regions free at once."""
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 0)
    r.kill(P0)
    r.sender.take()
    r.handler.fail_room(1, "x")
    assert r.handler.fenced_rooms == {}
    assert r.allocator.live_count == 0


def test_a_failed_room_without_liveness_still_fences() -> None:
    """Without liveness, writers are fenced and answered as usual."""
    r = rig(liveness=False)
    r.handler.register_room(plan(1))
    r.req(1, 0)
    r.handler.fail_room(1, "x")
    assert r.handler.fenced_rooms == {1: frozenset({0})}
    r.handler.writer_fenced(1, SID, 0)
    assert r.handler.fenced_rooms == {}
    assert r.allocator.live_count == 0


# --------------------------------------------------------------------------- fences


def test_a_fence_answer_frees_the_regions_and_broadcasts() -> None:
    """Once every fenced writer answered, the regions free and the watermark is broadcast."""
    r = rig(2, 1, 4)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    r.req(1, 0)
    r.handler.fail_room(1, "x")
    r.sender.take()
    r.handler.writer_fenced(1, SID, 0)
    assert r.handler.fenced_rooms == {1: frozenset({1})}
    assert r.allocator.live_count == 1
    assert r.sender.sent == []
    r.handler.writer_fenced(1, SID, 1)
    assert r.handler.fenced_rooms == {}
    assert r.allocator.live_count == 0
    assert r.sender.take() == [(P0, r.watermark()), (P1, r.watermark())]
    assert r.watches() == {P0: 1, P1: 1}


def test_a_fence_answer_for_another_session_or_room_is_ignored() -> None:
    """ROOM_FENCED of another session, an unknown room or an unfenced writer changes nothing."""
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 0)
    r.handler.fail_room(1, "x")
    r.sender.take()
    r.handler.writer_fenced(1, "other", 0)
    r.handler.writer_fenced(2, SID, 0)
    r.handler.writer_fenced(1, SID, 5)
    assert r.handler.fenced_rooms == {1: frozenset({0})}
    assert r.allocator.live_count == 1
    assert r.sender.sent == []
    assert r.watches() == {P0: 2}


def test_fences_are_resent_on_their_cadence() -> None:
    """An unanswered ROOM_FENCE goes again once fence_resend_s passed, not before."""
    r = rig(fence_resend_s=2.0)
    r.handler.register_room(plan(1))
    r.req(1, 0)
    r.sender.take()
    r.handler.fail_room(1, "x")
    assert r.sender.take()[0] == (P0, fence(1, "x"))
    r.clock.now += 1.5
    r.handler.progress()
    assert r.sender.take() == []
    r.clock.now += 0.5
    r.handler.progress()
    assert r.sender.take() == [(P0, fence(1, "x"))]
    r.clock.now += 1.9
    r.handler.progress()
    assert r.sender.take() == []


def test_a_second_failure_source_extends_the_fence_and_resends_it() -> None:
    """New regions of an already fenced room join its fence, which is sent again at once."""
    r = rig(2, 1, 4)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    r.req(1, 0)
    r.arrive(1, 0, 0)
    r.handler.fail_room(1, "x")
    assert r.handler.fenced_rooms == {1: frozenset({1})}
    r.sender.take()
    state = r.handler._rooms[1]
    with r.handler._lock:  # a region the room still held (a racing STAGING_REQ)
        alloc = r.allocator.assign(REGION)
        assert alloc is not None
        state.regions[1] = ChunkRegion(alloc, 2, 2, 2)
        r.handler._fail(state, "y")
    assert r.handler.fenced_rooms == {1: frozenset({0, 1})}
    assert r.handler._fences[1].allocations == [0, alloc.alloc_id]
    assert r.handler._fences[1].reason == "x"
    assert r.watches() == {P0: 2, P1: 2}
    r.handler.progress()
    sent = r.sender.take()
    assert sent == [(P1, fence(1, "x")), (P0, fence(1, "x"))]


def test_a_fence_outlives_the_release_of_its_room() -> None:
    """Releasing a fenced room keeps the fence; its answer still frees the regions."""
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 0)
    r.handler.release_room(1)
    assert r.handler.room_failure(1) is None
    assert r.handler.live_rooms == 0
    assert r.handler.fenced_rooms == {1: frozenset({0})}
    assert r.allocator.live_count == 1
    r.handler.writer_fenced(1, SID, 0)
    assert r.allocator.live_count == 0
    assert r.watches() == {}


# --------------------------------------------------------------------------- peer_dead


def test_a_dead_writer_fails_its_unfinished_rooms_only() -> None:
    """peer_dead fails rooms the endpoint writes into, skips finished ones and other peers."""
    r = rig(2, 1, 4)
    two = (P0, P1)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=two))
    r.handler.register_room(plan(2, prefill_tp=2, endpoints=two, pages=2))
    r.handler.register_room(plan(3, prefill_tp=2, endpoints=(P2, P3)))
    r.handler.register_room(plan(4, prefill_tp=2, endpoints=two))
    r.handler.fail_room(4, "earlier")
    r.req(2, 0)
    r.arrive(2, 0, 0)
    r.arrive(2, 0, 1)
    assert r.handler.poll_room(2) is RoomStatus.SUCCESS
    r.req(1, 0)
    r.sender.take()
    r.kill(P1)
    r.handler.peer_dead(P1)
    assert r.handler.room_failure(1) == f"prefill writer rank 1 ({P1}) is dead"
    assert r.handler.poll_room(2) is RoomStatus.SUCCESS
    assert r.handler.poll_room(3) is RoomStatus.REGISTERED
    assert r.handler.room_failure(4) == "earlier"
    assert r.handler.fenced_rooms == {1: frozenset({0})}
    sent = r.sender.take()
    assert sent[0] == (P0, fence(1, f"prefill writer rank 1 ({P1}) is dead"))
    assert (P0, r.watermark()) in sent


def test_a_dead_writer_no_longer_holds_a_fence() -> None:
    """peer_dead drops the endpoint from every fence and frees fences left with no writer."""
    r = rig(2, 1, 4)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    r.handler.register_room(plan(2, prefill_tp=2, endpoints=(P0, P1)))
    r.req(1, 0)
    r.req(2, 0)
    r.arrive(1, 0, 0)
    r.handler.fail_room(1, "x")
    r.handler.fail_room(2, "y")
    assert r.handler.fenced_rooms == {1: frozenset({1}), 2: frozenset({0, 1})}
    r.sender.take()
    r.handler.peer_dead(P1)
    assert r.handler.fenced_rooms == {2: frozenset({0})}
    assert r.allocator.live_count == 1
    assert r.sender.take() == [(P0, r.watermark()), (P1, r.watermark())]


def test_a_dead_peer_of_no_room_sends_nothing() -> None:
    """peer_dead for an endpoint nobody uses changes nothing and broadcasts nothing."""
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 0)
    r.sender.take()
    r.handler.peer_dead(P3)
    assert r.handler.poll_room(1) is RoomStatus.TRANSFERRING
    assert r.sender.sent == []


def test_a_dead_writer_of_a_room_without_regions_broadcasts_the_watermark() -> None:
    """Failing a room for a dead peer broadcasts the watermark even if it held no region."""
    r = rig()
    r.handler.register_room(plan(1))
    r.handler.register_room(plan(2, pages=2))
    r.req(2, 0)
    r.arrive(2, 0, 0)
    r.sender.take()
    r.handler.peer_dead(P0)
    assert r.handler.poll_room(1) is RoomStatus.FAILED
    assert r.sender.take() == [(P0, r.watermark())]


# --------------------------------------------------------------------------- release_room


def test_release_of_a_finished_room_frees_unwatches_and_unsubscribes() -> None:
    """A released successful room leaves no allocation, watch, subscription or fence."""
    r = rig()
    r.handler.register_room(plan(1, pages=2))
    r.req(1, 0)
    r.arrive(1, 0, 0)
    r.sender.take()
    r.handler.release_room(1)
    assert r.handler.live_rooms == 0
    assert r.handler.poll_room(1) is None
    assert r.watches() == {}
    assert r.handler._publisher.subscribers == ()
    assert r.handler.fenced_rooms == {}
    assert r.sender.sent == []
    r.handler.release_room(1)


def test_release_before_the_end_fences_with_a_reason() -> None:
    """Releasing a room with live regions fences them with 'released before it finished'."""
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 0)
    r.sender.take()
    r.handler.release_room(1)
    assert r.sender.take() == [(P0, fence(1, "released before it finished"))]
    assert r.handler.fenced_rooms == {1: frozenset({0})}


def test_release_waits_for_a_running_scatter() -> None:
    """release_room blocks while a scatter of the room runs and returns once it ended."""
    r = rig()
    r.handler.register_room(plan(1))
    state = r.handler._rooms[1]
    state.scattering = 1
    done = threading.Event()

    def release() -> None:
        r.handler.release_room(1)
        done.set()

    worker = threading.Thread(target=release)
    worker.start()
    assert not done.wait(0.05)
    assert state.closing
    with r.handler._lock:
        state.scattering = 0
        r.handler._idle.notify_all()
    assert done.wait(5)
    worker.join(5)
    assert r.handler.live_rooms == 0


def test_release_times_out_while_a_scatter_runs() -> None:
    """A scatter that never ends makes release_room raise; the room stays, closing."""
    r = rig()
    r.handler.register_room(plan(1))
    r.handler._rooms[1].scattering = 1
    waits = bounded_waits(r, step=1.0)
    with pytest.raises(TimeoutError, match=r"^room 1: a scatter did not finish in 0.0s$"):
        r.handler.release_room(1, timeout=0.0)
    assert waits == []
    assert r.handler.live_rooms == 1
    assert r.handler._rooms[1].closing


def test_release_times_out_once_the_clock_passes_the_deadline() -> None:
    """The release deadline is measured with the handler's clock."""
    r = rig()
    r.handler.register_room(plan(1))
    r.handler._rooms[1].scattering = 1
    waits = bounded_waits(r, step=1.0)
    with pytest.raises(TimeoutError, match=r"^room 1: a scatter did not finish in 2.5s$"):
        r.handler.release_room(1, timeout=2.5)
    assert waits == [2.5, 1.5, 0.5]


# --------------------------------------------------------------------------- progress


def test_a_stalled_room_fails_only_after_the_timeout() -> None:
    """A writable region without progress fails the room strictly after stall_timeout_s."""
    r = rig(stall_timeout_s=5.0)
    r.handler.register_room(plan(1))
    r.req(1, 0)
    r.sender.take()
    r.clock.now += 5.0
    r.handler.progress()
    assert r.handler.poll_room(1) is RoomStatus.TRANSFERRING
    r.clock.now += 0.001
    r.handler.progress()
    assert r.handler.room_failure(1) == "no progress for 5.0s while holding a writable region"
    assert r.sender.take() == [(P0, fence(1, r.handler.room_failure(1) or "")), (P0, r.watermark())]


def test_a_registered_room_without_regions_is_not_checked_for_stalls() -> None:
    """A room with no region (or not transferring) is not checked by the stall timeout; its
    own bound (room_timeout_s, 30 s by default) is longer here."""
    r = rig(stall_timeout_s=1.0)
    r.handler.register_room(plan(1))
    r.handler.register_room(plan(2, pages=4))
    r.req(2, 0)
    r.arrive(2, 0, 0)
    r.clock.now += 20
    r.handler.progress()
    assert r.handler.poll_room(1) is RoomStatus.REGISTERED
    assert r.handler.poll_room(2) is RoomStatus.TRANSFERRING


def test_waiting_for_ring_space_restarts_the_stall_timer() -> None:
    """A room whose regions all wait for space other rooms hold is not stalled; its timer
    starts once its region becomes writable. (Room 2 is another prefill instance's: a stalled
    instance's own never-written rooms are taken back with it, see test_fair_ring.)"""
    r = rig(stall_timeout_s=5.0, ring_bytes=REGION)
    r.handler.register_room(plan(1))
    r.handler.register_room(plan(2, endpoints=(P1,)))
    r.req(1, 0)
    r.req(2, 0)  # round 1: waits for room 1's region
    r.clock.now += 10
    r.handler.progress()
    assert r.handler.room_failure(1) == "no progress for 5.0s while holding a writable region"
    assert r.handler.poll_room(2) is RoomStatus.TRANSFERRING
    r.handler.writer_fenced(1, SID, 0)  # room 1's region returns: room 2's is writable
    r.clock.now += 5
    r.handler.progress()
    assert r.handler.poll_room(2) is RoomStatus.TRANSFERRING
    r.clock.now += 0.001
    r.handler.progress()
    assert r.handler.poll_room(2) is RoomStatus.FAILED


def test_progress_honours_its_minimum_interval() -> None:
    """progress(min_interval_s) does nothing if the last pass was more recent."""
    r = rig(stall_timeout_s=1.0, fence_resend_s=1.0)
    r.handler.register_room(plan(1))
    r.req(1, 0)
    r.handler.progress()
    r.clock.now += 2.0
    r.handler.progress(min_interval_s=2.5)
    assert r.handler.poll_room(1) is RoomStatus.FAILED  # poll_room's own pass
    r.handler.register_room(plan(2))
    r.req(2, 0)
    r.clock.now += 2.0
    r.handler.progress(min_interval_s=2.5)
    assert raw_status(r, 2) is RoomStatus.TRANSFERRING
    r.clock.now += 0.5
    r.handler.progress(min_interval_s=2.5)
    assert raw_status(r, 2) is RoomStatus.FAILED


# --------------------------------------------------------------------------- watermark sends


def test_watermark_frames_are_cached_until_the_watermark_moves() -> None:
    """The encoded watermark is reused while unchanged and rebuilt when it moves."""
    r = rig()
    first = r.handler._watermark_frames()
    assert first == r.watermark()
    assert r.handler._watermark_frames() is first
    alloc = r.allocator.assign(8)
    assert isinstance(alloc, Allocation)
    r.allocator.free(alloc.alloc_id)
    moved = r.handler._watermark_frames()
    assert moved == r.watermark()
    assert moved != first


def test_a_peer_that_stops_taking_messages_is_skipped() -> None:
    """A full peer's answers are dropped without blocking; the others still get theirs."""
    r = rig(2, 1, 4)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    r.sender.full.add(P0)
    assert r.req(1, 0) is StagingReqOutcome.ALLOCATED
    assert [endpoint for endpoint, _ in r.sender.take()] == [P1, P1]


# --------------------------------------------------------------------------- authorisation


def test_messages_of_no_room_are_not_judged() -> None:
    """Other kinds, too few frames, an unparsable or unknown room: let through."""
    r = rig()
    r.handler.register_room(plan(7))
    stranger = "tcp://stranger:1"
    for frames in (
        [],
        [b"WATERMARK", b"7", b"0"],
        [b"PING", b"7"],
        [b"STAGING_REQ"],
        [b"STAGING_REQ", b"x7", b"0", b"2", SID.encode()],
        [b"STAGING_REQ", b"-7", b"0", b"2", SID.encode()],
        StagingReq(8, 0, 2, SID).to_frames(),
        RoomFenced(8, SID, 0).to_frames(),
    ):
        assert r.handler.authorize(frames, stranger), frames


def test_room_messages_only_from_the_room_s_peers() -> None:
    """STAGING_REQ, ROOM_FAILED and a rank-less CHUNK_READY come from a peer of the room."""
    r = rig(2, 1, 4)
    r.handler.register_room(plan(7, prefill_tp=2, endpoints=(P0, P1)))
    messages = [
        StagingReq(7, 0, 2, SID).to_frames(),
        RoomFailed(7, "x").to_frames(),
        ChunkReady(7, 0, 0, 2, SID).to_frames(),
        [b"STAGING_REQ", b"7"],
        [b"STAGING_REQ", b"07", b"0"],
    ]
    for frames in messages:
        assert r.handler.authorize(frames, P0), frames
        assert r.handler.authorize(frames, P1), frames
        assert not r.handler.authorize(frames, P2), frames


def test_a_chunk_ready_naming_a_writer_comes_from_that_writer() -> None:
    """CHUNK_READY with a writer rank is accepted only from that rank's endpoint."""
    r = rig(2, 1, 4)
    r.handler.register_room(plan(7, prefill_tp=2, endpoints=(P0, P1)))
    frames = ChunkReady(7, 0, 0, 2, SID, 1).to_frames()
    assert r.handler.authorize(frames, P1)
    assert not r.handler.authorize(frames, P0)
    assert not r.handler.authorize(ChunkReady(7, 0, 0, 2, SID, 2).to_frames(), P0)
    assert not r.handler.authorize([*frames[:6], b"x"], P1)


def test_a_fence_answer_comes_from_the_writer_it_names_while_awaited() -> None:
    """ROOM_FENCED: without a fence, let through; with one, only the awaited rank's endpoint."""
    r = rig(2, 1, 4)
    r.handler.register_room(plan(7, prefill_tp=2, endpoints=(P0, P1)))
    assert r.handler.authorize(RoomFenced(7, SID, 1).to_frames(), P3)
    r.req(7, 0)
    r.arrive(7, 0, 0)
    r.handler.fail_room(7, "x")
    assert r.handler.fenced_rooms == {7: frozenset({1})}
    assert r.handler.authorize(RoomFenced(7, SID, 1).to_frames(), P1)
    assert not r.handler.authorize(RoomFenced(7, SID, 1).to_frames(), P0)
    assert not r.handler.authorize(RoomFenced(7, SID, 0).to_frames(), P0)
    assert not r.handler.authorize([RoomFenced.KIND, b"7", SID.encode()], P1)
    assert not r.handler.authorize([RoomFenced.KIND, b"7", SID.encode(), b"one"], P1)


def test_room_numbers_parse_as_plain_decimals_of_up_to_18_digits() -> None:
    """_room_of reads non-negative decimals of 1 to 18 digits, nothing else."""
    room_of = handler_module._room_of
    assert room_of(b"0") == 0
    assert room_of(b"0042") == 42
    assert room_of(b"9" * 18) == 10**18 - 1
    for bad in (b"", b"9" * 19, b"-1", b"+1", b" 1", b"1.0", b"x"):
        assert room_of(bad) is None, bad


def test_a_room_of_18_digits_is_judged_and_one_of_19_is_not() -> None:
    """The 18-digit bound applies to authorisation: a 19-digit room is not looked up."""
    r = rig()
    big, bigger = 10**17, 10**18
    r.handler.register_room(plan(big))
    r.handler.register_room(plan(bigger))
    assert not r.handler.authorize(StagingReq(big, 0, 2, SID).to_frames(), P1)
    assert r.handler.authorize(StagingReq(bigger, 0, 2, SID).to_frames(), P1)


# --------------------------------------------------------------------------- ring share


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_ring_share_outside_zero_to_one_is_refused(share: float) -> None:
    """ring_share must be in (0, 1]."""
    with pytest.raises(ValueError, match=rf"^ring_share={share!r} must be in \(0, 1\]$"):
        rig(ring_share=share)


def test_the_whole_ring_means_no_quota() -> None:
    """ring_share=1: every request is answered, however much one instance holds."""
    r = rig(ring_bytes=2 * REGION)
    assert r.handler._quota_bytes is None
    r.handler.register_room(plan(1, pages=8))
    assert [r.req(1, c) for c in range(4)] == [StagingReqOutcome.ALLOCATED] * 4


def test_an_instance_over_its_share_is_deferred_until_its_regions_free() -> None:
    """Past its share a prefill instance gets no region and no answer; after a free it does."""
    r = rig(ring_bytes=4 * REGION, ring_share=0.5)
    assert r.handler._quota_bytes == 2 * REGION
    r.handler.register_room(plan(1, pages=8))
    assert r.req(1, 0) is StagingReqOutcome.ALLOCATED
    assert r.req(1, 1) is StagingReqOutcome.ALLOCATED  # exactly the share
    r.sender.take()
    assert r.req(1, 2) is StagingReqOutcome.DEFERRED
    assert r.sender.take() == []
    assert r.allocator.live_count == 2
    assert r.handler.poll_room(1) is RoomStatus.TRANSFERRING
    assert r.handler._usage == {(P0,): 2 * REGION}
    r.arrive(1, 0, 0)
    assert r.handler._usage == {(P0,): REGION}
    assert r.req(1, 2) is StagingReqOutcome.ALLOCATED
    r.arrive(1, 1, 0)
    r.arrive(1, 2, 0)
    assert r.handler._usage == {}
    assert r.handler._owners == {}


def test_the_share_is_per_prefill_instance() -> None:
    """Rooms of the same writers share one quota; another instance has its own."""
    r = rig(2, 1, 4, ring_bytes=8 * REGION, ring_share=0.25)
    r.handler.register_room(plan(1, prefill_tp=2, endpoints=(P0, P1)))
    r.handler.register_room(plan(2, prefill_tp=2, endpoints=(P0, P1)))
    r.handler.register_room(RoomPlan(3, (20, 21), 2, 2, (PrefillPeer(1, P3), PrefillPeer(0, P2))))
    assert r.req(1, 0) is StagingReqOutcome.ALLOCATED
    assert r.req(2, 0) is StagingReqOutcome.DEFERRED
    assert r.req(3, 0) is StagingReqOutcome.ALLOCATED
    assert r.handler._usage == {(P0, P1): 2 * REGION, (P2, P3): 2 * REGION}


def test_an_instance_holding_nothing_always_gets_its_region() -> None:
    """A region larger than the share is still given to an instance that holds nothing."""
    r = rig(ring_bytes=4 * REGION, ring_share=0.1)
    r.handler.register_room(plan(1, pages=8))
    assert r.req(1, 0) is StagingReqOutcome.ALLOCATED
    assert r.req(1, 1) is StagingReqOutcome.DEFERRED


def test_a_failed_or_fenced_room_gives_its_share_back_when_freed() -> None:
    """Fenced regions count against the share until their writers answer."""
    r = rig(ring_bytes=4 * REGION, ring_share=0.5)
    r.handler.register_room(plan(1, pages=8))
    r.handler.register_room(plan(2, pages=8))
    r.req(1, 0)
    r.req(1, 1)
    r.handler.fail_room(1, "x")
    assert r.req(2, 0) is StagingReqOutcome.DEFERRED
    r.handler.writer_fenced(1, SID, 0)
    assert r.handler._usage == {}
    assert r.req(2, 0) is StagingReqOutcome.ALLOCATED


def test_a_deferred_request_still_sends_due_fences() -> None:
    """Handling a deferred STAGING_REQ re-sends fences that are due."""
    r = rig(ring_bytes=4 * REGION, ring_share=0.25)
    r.handler.register_room(plan(1, pages=8))
    r.handler.register_room(plan(2, pages=8, endpoints=(P1,)))
    r.req(1, 0)
    r.req(2, 0)
    r.handler.fail_room(2, "x")
    r.sender.take()
    r.clock.now += DEFAULT_FENCE_RESEND_S
    assert r.req(1, 1) is StagingReqOutcome.DEFERRED
    assert r.sender.take() == [(P1, fence(2, "x"))]


# --------------------------------------------------------------------------- logs and bounds


def handler_logs(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    """(level, message) of every record the handler logged."""
    return [
        (record.levelname, record.getMessage())
        for record in caplog.records
        if record.name == handler_module.__name__
    ]


def test_every_refusal_and_failure_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Dropped and refused requests, rejected arrivals and failed rooms are logged."""
    caplog.set_level(logging.WARNING, logger=handler_module.__name__)
    r = rig()
    r.req(9, 1)
    r.handler.register_room(plan(1))
    r.req(1, 5)
    r.req(1, 0)
    r.arrive(1, 0, 0, pages=1)
    r.handler.writer_fenced(1, "other", 0)
    assert handler_logs(caplog) == [
        ("WARNING", "STAGING_REQ for unknown room 9 chunk 1 dropped"),
        ("WARNING", "room 1: STAGING_REQ refused: chunk 5 is beyond the room's 2 chunks"),
        ("WARNING", "room 1 failed: arrival covers pages [0, 1), the region holds [0, 2)"),
        (
            "WARNING",
            "room 1 chunk 0: arrival rejected: arrival covers pages [0, 1), the region holds "
            "[0, 2)",
        ),
        ("WARNING", "ROOM_FENCED for session 'other' ignored (this rank is 'decode-0')"),
    ]


def test_a_failed_scatter_is_logged_with_its_exception(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scatter's exception is logged with its traceback, naming room and chunk."""
    caplog.set_level(logging.WARNING, logger=handler_module.__name__)
    r = rig()
    r.handler.register_room(plan(1))
    r.req(1, 1)

    def boom(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(r.handler._scatterer, "scatter", boom)
    r.arrive(1, 1, 0)
    assert handler_logs(caplog)[0] == ("ERROR", "room 1 chunk 1: scatter failed")
    assert caplog.records[0].exc_info is not None


def test_a_finished_room_before_an_unfinished_one_does_not_stop_peer_dead() -> None:
    """peer_dead skips finished rooms and still fails the unfinished ones after them."""
    r = rig()
    r.handler.register_room(plan(1, pages=2))
    r.handler.register_room(plan(2))
    r.handler.register_room(plan(3))
    r.req(1, 0)
    r.arrive(1, 0, 0)
    r.handler.fail_room(2, "earlier")
    r.handler.peer_dead(P0)
    assert r.handler.poll_room(1) is RoomStatus.SUCCESS
    assert r.handler.room_failure(2) == "earlier"
    assert r.handler.room_failure(3) == f"prefill writer rank 0 ({P0}) is dead"


def test_release_waits_ten_seconds_by_default() -> None:
    """release_room's default bound on a running scatter is 10 s of the handler's clock."""
    r = rig()
    r.handler.register_room(plan(1))
    r.handler._rooms[1].scattering = 1
    waits = bounded_waits(r, step=4.0)
    with pytest.raises(TimeoutError, match=r"^room 1: a scatter did not finish in 10.0s$"):
        r.handler.release_room(1)
    assert waits == [10.0, 6.0, 2.0]


class WaitClock:
    """Stands in for the handler module's ``time``: waits advance it by what they waited."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return self.now


def fake_waits(
    r: Rig, monkeypatch: pytest.MonkeyPatch, at_wait: dict[int, object] | None = None
) -> WaitClock:
    """Make wait_room's clock and condition waits fake; ``at_wait[n]()`` runs at wait n."""
    clock = WaitClock()
    monkeypatch.setattr(handler_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    actions = at_wait or {}

    def wait(timeout: float | None = None) -> bool:
        assert timeout is not None
        assert len(clock.waits) < 1000, "wait_room never ends"
        clock.waits.append(timeout)
        clock.now += max(timeout, 0.001)
        action = actions.get(len(clock.waits))
        if callable(action):
            r.handler._lock.release()
            try:
                action()
            finally:
                r.handler._lock.acquire()
        return False

    monkeypatch.setattr(r.handler._idle, "wait", wait)
    return clock


def test_wait_room_waits_in_slices_until_the_room_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """wait_room re-checks every WAIT_SLICE_S and returns once the room succeeded."""
    r = rig()
    r.handler.register_room(plan(1, pages=2))
    r.req(1, 0)
    clock = fake_waits(r, monkeypatch, {3: lambda: r.arrive(1, 0, 0)})
    assert r.handler.wait_room(1, 1.0) is RoomStatus.SUCCESS
    assert clock.waits == [WAIT_SLICE_S] * 3


def test_wait_room_s_last_slice_is_what_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last wait is cut to the time left; then the current status is returned."""
    r = rig()
    r.handler.register_room(plan(1))
    clock = fake_waits(r, monkeypatch)
    assert r.handler.wait_room(1, 0.25 * WAIT_SLICE_S) is RoomStatus.REGISTERED
    assert clock.waits == [0.25 * WAIT_SLICE_S]


def test_wait_room_with_no_time_left_does_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A zero bound returns the status at once."""
    r = rig()
    r.handler.register_room(plan(1))
    clock = fake_waits(r, monkeypatch)
    assert r.handler.wait_room(1, 0.0) is RoomStatus.REGISTERED
    assert clock.waits == []


# --------------------------------------------------------------------------- defaults and seams


def bare_handler(clock: Clock, sender: RecordingSockets) -> DecodeStagingHandler:
    """A handler built with every optional argument left at its default (but the clock)."""
    geometry = Geometry(1, 1, 2)
    return DecodeStagingHandler(
        allocator=StagingAllocator(1 << 16),
        kv_buffers=geometry.empty_pool(1, 0),
        decode_tp=1,
        decode_rank=0,
        total_kv_heads=2,
        session_id=SID,
        sender=sender,
        clock=clock,
    )


def test_the_default_stall_timeout_is_ten_seconds() -> None:
    """Without stall_timeout_s, a writable region stalls after 10 s, not before (issue 24:
    60 s let a non-writing instance hold the ring for minutes)."""
    clock, sender = Clock(), RecordingSockets()
    handler = bare_handler(clock, sender)
    handler.register_room(plan(1))
    handler.handle_staging_req(1, 0, num_pages=2, session_id=SID, pp_rank=None)
    clock.now += 10.0
    assert handler.poll_room(1) is RoomStatus.TRANSFERRING
    clock.now += 0.001
    handler.progress()  # the listener's pass: a poll makes one at most once per wait slice
    assert handler.poll_room(1) is RoomStatus.FAILED
    assert handler.room_failure(1) == "no progress for 10.0s while holding a writable region"


def test_by_default_fences_carry_no_reply_address_and_the_ring_has_no_quota() -> None:
    """Without endpoint, ROOM_FENCE names an empty reply address; without ring_share every
    request is answered."""
    clock, sender = Clock(), RecordingSockets()
    handler = bare_handler(clock, sender)
    handler.register_room(plan(1, pages=8))
    outcomes = [
        handler.handle_staging_req(1, c, num_pages=2, session_id=SID, pp_rank=None)
        for c in range(4)
    ]
    assert outcomes == [StagingReqOutcome.ALLOCATED] * 4
    sender.take()
    handler.fail_room(1, "x")
    assert sender.take()[0] == (P0, RoomFence(1, SID, "", "x").to_frames())


def test_the_first_progress_pass_runs_even_at_time_zero() -> None:
    """A clock that starts at 0 does not make the first pass look too recent."""
    r = rig(stall_timeout_s=0.25)
    r.clock.now = 0.0
    r.handler.register_room(plan(1))
    r.req(1, 0)
    r.clock.now = 0.5
    assert r.handler.poll_room(1) is RoomStatus.FAILED


class EventOrdering(HostOrdering):
    """An ordering whose scatters complete only when their event says so."""

    def __init__(self) -> None:
        self.events: list[FakeEvent] = []

    def scattered(self) -> object | None:
        event = FakeEvent()
        self.events.append(event)
        return event


class FakeStream:
    """Stands in for a CUDA stream (never used on CPU: the scatter is redirected)."""


def test_scatters_run_on_the_given_stream_and_complete_by_the_given_ordering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """scatter_stream reaches the kernel; the ordering's token holds the region until done."""
    geometry = Geometry(1, 1, 2)
    sender, ordering, stream = RecordingSockets(), EventOrdering(), FakeStream()
    handler = DecodeStagingHandler(
        allocator=StagingAllocator(1 << 16),
        kv_buffers=geometry.empty_pool(1, 0),
        decode_tp=1,
        decode_rank=0,
        total_kv_heads=2,
        session_id=SID,
        sender=sender,
        scatter_stream=cast(torch.cuda.Stream, stream),
        ordering=ordering,
        clock=Clock(),
    )
    pools = handler._scatterer._pools
    scatter = pools.scatter
    streams: list[object] = []

    def on_cpu(*args: object, stream: object = None, **kwargs: object) -> None:
        streams.append(stream)
        scatter(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pools, "scatter", on_cpu)
    handler.register_room(plan(1, pages=2))
    handler.handle_staging_req(1, 0, num_pages=2, session_id=SID, pp_rank=None)
    arrival = handler.handle_chunk_arrival(
        1, 0, page_start=0, num_pages=2, session_id=SID, writer_rank=0
    )
    assert arrival is ArrivalOutcome.COMPLETE
    assert streams == [stream]
    assert handler.poll_room(1) is RoomStatus.TRANSFERRING
    assert handler.allocator.live_count == 1
    ordering.events[0].done = True
    assert handler.poll_room(1) is RoomStatus.SUCCESS
    assert handler.allocator.live_count == 0


def test_a_pass_that_frees_one_room_broadcasts_even_if_a_later_room_frees_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """progress broadcasts the watermark when any room's scatter completed."""
    r = rig()
    r.handler.register_room(plan(1, pages=2))
    r.handler.register_room(plan(2, pages=2))
    events = [FakeEvent(), FakeEvent()]
    pending = iter(events)
    monkeypatch.setattr(r.handler._scatterer, "scatter", lambda *args: next(pending))
    for room in (1, 2):
        r.req(room, 0)
        r.arrive(room, 0, 0)
    r.sender.take()
    events[0].done = True
    r.handler.progress()
    assert r.sender.take() == [(P0, r.watermark())]
    assert r.allocator.live_count == 1


def test_a_room_does_not_succeed_while_another_of_its_scatters_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two scatters of one room at once: the room succeeds only when both have ended."""
    r = rig()
    r.handler.register_room(plan(1, pages=4))
    r.req(1, 0)
    r.req(1, 1)
    scatter = r.handler._scatterer.scatter
    seen: list[RoomStatus] = []

    def first_scatter_lets_the_second_run(*args: object) -> object | None:
        if not seen:
            seen.append(raw_status(r, 1))
            assert r.arrive(1, 1, 0) is ArrivalOutcome.COMPLETE
            seen.append(raw_status(r, 1))
        return scatter(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(r.handler._scatterer, "scatter", first_scatter_lets_the_second_run)
    assert r.arrive(1, 0, 0) is ArrivalOutcome.COMPLETE
    assert seen == [RoomStatus.TRANSFERRING, RoomStatus.TRANSFERRING]
    assert raw_status(r, 1) is RoomStatus.SUCCESS
    assert r.handler._rooms[1].scattering == 0


def test_after_an_anonymous_arrival_every_writer_is_fenced_even_those_that_landed() -> None:
    """With an anonymous arrival in a region, writers that arrived by rank are fenced too."""
    r = rig(4, 1, 4, accept_anonymous=True)
    r.handler.register_room(plan(1, prefill_tp=4, endpoints=(P0, P1, P2, P3)))
    r.req(1, 0)
    assert r.arrive(1, 0, 0) is ArrivalOutcome.WAITING
    assert r.arrive(1, 0, None) is ArrivalOutcome.WAITING
    r.handler.fail_room(1, "x")
    assert r.handler.fenced_rooms == {1: frozenset({0, 1, 2, 3})}


def test_a_room_s_pages_live_on_the_pool_s_device() -> None:
    """register_room puts the plan's page indices, as int64, on the pool's device (here the
    meta device, which tells it from the CPU default)."""
    shape = (64 * 4, 2, 8)

    def pool() -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(shape, dtype=torch.bfloat16, device="meta") for _ in range(2))

    handler = DecodeStagingHandler(
        allocator=StagingAllocator(1 << 16),
        kv_buffers=KVBufferTensors(pool(), pool(), 4),
        decode_tp=1,
        decode_rank=0,
        total_kv_heads=2,
        session_id=SID,
        sender=RecordingSockets(),
    )
    handler.register_room(plan(1))
    pages = handler._rooms[1].pages
    assert (pages.device.type, pages.dtype, tuple(pages.shape)) == ("meta", torch.int64, (4,))


def test_a_room_of_a_writer_already_dead_fails_at_registration() -> None:
    """A writer declared dead before the room is registered fails it at once (liveness will
    not declare it again); a missing writer is reported first."""
    r = rig(4, 1, 4)
    assert r.liveness is not None
    for endpoint in (P2, P3):
        r.liveness.watch(endpoint)
    r.kill(P2, P3)
    status = r.handler.register_room(plan(1, prefill_tp=4, endpoints=(P0, P1, P2, P3)))
    assert status is RoomStatus.FAILED
    assert r.handler.room_failure(1) == f"prefill writer rank 2 ({P2}) is dead"
    r.handler.register_room(RoomPlan(2, (10, 11), 2, 4, (PrefillPeer(0, P0), PrefillPeer(2, P2))))
    assert r.handler.room_failure(2) == "no endpoint registered for prefill writer ranks [1, 3]"
    r.handler.register_room(plan(3, prefill_tp=4, endpoints=(P0, P1, P0, P1)))
    assert r.handler.poll_room(3) is RoomStatus.REGISTERED
