"""Reliability under faults of honest peers: stale writers, errors, stalls, circular waits,
dead peers. Each test reproduces a failure of an earlier version (named in its docstring)."""

from __future__ import annotations

import threading
import time

import torch

from staging_contracts import ArrivalOutcome
from staging_contracts._decode.handler import RoomStatus
from staging_contracts._prefill.writer import PrefillTimeouts, StagingFailed
from staging_contracts._staging.layout import compute_staging_layout
from staging_contracts.backends._kv_requests import KVPoll, KVReceiver, KVSender
from tests.local_cluster import (
    Geometry,
    LocalCluster,
    Request,
    local_cluster,
    sides,
    wait_for,
    wait_states,
)

FAST = PrefillTimeouts(answer_s=0.05, ready_s=0.05, deadline_s=5.0)


def region_bytes(geometry: Geometry, chunk_pages: int) -> int:
    """Bytes of one chunk's ring region on decode rank 0."""
    element = torch.empty((), dtype=geometry.dtype).element_size()
    layout = compute_staging_layout(
        geometry.prefill_tp,
        geometry.decode_tp,
        0,
        geometry.total_heads,
        chunk_pages * geometry.page_size,
        geometry.head_dim * element,
        geometry.layers,
    )
    return layout.total_bytes


def pages_match(cluster: LocalCluster, request: Request, rank: int = 0) -> bool:
    """Whether decode rank ``rank`` holds exactly the request's heads on its pages."""
    g = cluster.geometry
    expected = cluster.expected_decode_pool(rank)
    actual = cluster.decode_pools[rank]
    rows = torch.tensor(
        [p * g.page_size + t for p in request.decode_pages for t in range(g.page_size)]
    )
    pairs = zip(
        (*actual.k_buffers, *actual.v_buffers),
        (*expected.k_buffers, *expected.v_buffers),
        strict=True,
    )
    return all(torch.equal(a[rows].view(torch.int16), e[rows].view(torch.int16)) for a, e in pairs)


# --------------------------------------------------------------------------- 1. stale writer


def test_a_stale_writer_of_a_failed_room_cannot_corrupt_the_next_room() -> None:
    """Finding 1: decode failed room R and reused its region for room Z at once; R's writer
    0 still held R's STAGING_RSP, wrote into Z's bytes, and Z reported SUCCESS with wrong
    pages. Now R's region stays fenced until R's writers confirm; the stale write is refused
    and Z lands bit-exact."""
    g = Geometry(2, 1, 4)
    with local_cluster(g, ring_bytes=region_bytes(g, 2), timeouts=FAST) as cluster:
        handler = cluster.handlers[0]
        stale = cluster.add_request(70, num_pages=2, chunk_pages=2, seed=1)
        fresh = cluster.add_request(71, num_pages=2, chunk_pages=2, seed=2)
        # One STAGING_REQ (decode answers every writer of the room): no request can reach
        # decode after the failure below and replace the answers with a refusal.
        cluster.writers[0].prefetch(stale.room, [(0, 2)], cluster.targets)
        session = cluster.targets[0].session_id
        # Writer 0 holds the answer (writer 1 never asked: its book drops the answer decode
        # sent it too, see RegionAnswerTable's gating).
        book = cluster.prefill[0]._staging_ctx.regions  # type: ignore[union-attr]
        assert wait_for(lambda: book.get(70, 0, session) is not None)

        handler.fail_room(stale.room, "aborted by the scheduler")
        for writer in cluster.writers:
            writer.prefetch(fresh.room, [(0, 2)], cluster.targets)
        # Z's writer 0 writes (its region becomes writable once R's writers are fenced) ...
        (z_chunk,), (r_chunk,) = fresh.chunks(), stale.chunks()
        cluster.writers[0].send_chunk(fresh.room, z_chunk, cluster.targets)
        # ... R's writer 0 tries its stale write ...
        refusal = None
        try:
            cluster.writers[0].send_chunk(stale.room, r_chunk, cluster.targets)
        except StagingFailed as exc:
            refusal = str(exc)
        # ... and Z's writer 1 completes Z, whose pages must be exactly its own.
        cluster.writers[1].send_chunk(fresh.room, z_chunk, cluster.targets)
        assert cluster.wait_rooms([71])[71] == [RoomStatus.SUCCESS]
        assert pages_match(cluster, fresh)
        assert refusal is not None
        assert refusal.startswith("room 70: chunk 0: decode fenced the room")
        assert handler.poll_room(70) is RoomStatus.FAILED
        assert wait_for(lambda: handler.allocator.live_count == 0)


def test_a_write_in_flight_delays_the_fence_answer() -> None:
    """A writer answers ROOM_FENCED only once its running write of the room returned."""
    g = Geometry(1, 1, 2)
    with local_cluster(g, timeouts=FAST) as cluster:
        handler = cluster.handlers[0]
        request = cluster.add_request(72, num_pages=2, chunk_pages=2)
        writer, manager = cluster.writers[0], cluster.prefill[0]
        engine = manager.engine
        entered, release = threading.Event(), threading.Event()
        original = engine.write

        def slow_write(*args: object, **kwargs: object) -> None:
            entered.set()
            release.wait(10)
            original(*args, **kwargs)  # type: ignore[arg-type]

        engine.write = slow_write  # type: ignore[method-assign]
        worker = threading.Thread(
            target=writer.send_chunk, args=(72, request.chunks()[0], cluster.targets)
        )
        worker.start()
        assert entered.wait(5)
        handler.fail_room(72, "aborted while a write runs")
        time.sleep(0.3)
        assert handler.fenced_rooms == {72: frozenset({0})}  # no answer during the write
        assert handler.allocator.live_count == 1
        release.set()
        worker.join(10)
        assert wait_for(lambda: handler.fenced_rooms == {})
        assert wait_for(lambda: handler.allocator.live_count == 0)


# --------------------------------------------------------------------------- 2. worker errors


def test_an_ordinary_error_fails_one_room_and_the_worker_lives_on() -> None:
    """Finding 2: the prefill worker caught only StagingFailed, so a ValueError from a bad page
    index killed it and every later room stayed Transferring forever."""
    with sides(Geometry(1, 1, 2), timeouts=FAST) as s:
        c = s.cluster
        bad = c.add_request(80, num_pages=2, chunk_pages=2)
        good = c.add_request(81, num_pages=2, chunk_pages=2)
        rooms = []
        for request, pages in ((bad, (9999, 9998)), (good, good.prefill_pages)):
            c.handlers[0].release_room(request.room)
            receiver = KVReceiver(s.decode[0], request.room)
            receiver.init(request.decode_pages, chunk_pages=2)
            receiver.send_metadata()
            sender = KVSender(s.prefill[0], request.room)
            sender.init(2, c.targets)
            sender.send(pages, last=True)
            rooms.append((sender, receiver))
        (bad_sender, _), (good_sender, good_receiver) = rooms
        assert wait_states([bad_sender, good_sender]) == [KVPoll.Failed, KVPoll.Success]
        assert "IndexError" in (bad_sender.failure() or "") or "ValueError" in (
            bad_sender.failure() or ""
        )
        assert wait_states([good_receiver]) == [KVPoll.Success]
        assert pages_match(c, good)


# --------------------------------------------------------------------------- 3. fair stalls


def test_waiting_for_ring_space_is_not_a_stall() -> None:
    """Finding 3: time a room spent waiting for a region that another (slow but alive) room
    held counted as no progress, so the healthy room failed while the slow one succeeded."""
    g = Geometry(2, 1, 4)
    with local_cluster(g, ring_bytes=region_bytes(g, 2), timeouts=FAST) as cluster:
        handler = cluster.handlers[0]
        handler._stall_timeout = 0.3
        sid = handler.session_id
        cluster.add_request(90, num_pages=2, chunk_pages=2)
        cluster.add_request(91, num_pages=2, chunk_pages=2)
        handler.handle_staging_req(90, 0, num_pages=2, session_id=sid, pp_rank=None)
        handler.handle_staging_req(91, 0, num_pages=2, session_id=sid, pp_rank=None)
        for rank in (0, 1):  # the slow room: one writer every 0.2 s, progress each time
            time.sleep(0.2)
            handler.handle_chunk_arrival(
                90, 0, page_start=0, num_pages=2, session_id=sid, writer_rank=rank
            )
        assert handler.poll_room(90) is RoomStatus.SUCCESS
        assert handler.poll_room(91) is RoomStatus.TRANSFERRING  # waited 0.4 s: not stalled
        outcomes = [
            handler.handle_chunk_arrival(
                91, 0, page_start=0, num_pages=2, session_id=sid, writer_rank=rank
            )
            for rank in (0, 1)
        ]
        assert outcomes == [ArrivalOutcome.WAITING, ArrivalOutcome.COMPLETE]
        assert handler.poll_room(91) is RoomStatus.SUCCESS


def test_a_room_holding_a_writable_region_still_stalls() -> None:
    """The stall detector still fails a room whose writable region sees no writer."""
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        handler = cluster.handlers[0]
        handler._stall_timeout = 0.1
        cluster.add_request(92, num_pages=2, chunk_pages=2)
        handler.handle_staging_req(92, 0, num_pages=2, session_id=handler.session_id, pp_rank=None)
        assert wait_for(lambda: handler.poll_room(92) is RoomStatus.FAILED)
        assert "writable region" in (handler.room_failure(92) or "")


# --------------------------------------------------------------------------- 4. circular wait


def test_round_robin_chunks_of_many_rooms_through_a_small_ring_all_complete() -> None:
    """Finding 4: one prefill sending chunks round-robin across 16 rooms into a ring of 4 chunk
    regions completed 0/16 rooms: regions were assigned in prefetch order while the serial
    worker wrote in submission order, each waiting for a region held by a later chunk."""
    g = Geometry(1, 1, 2, pool_pages=160)
    rooms, chunks = 16, 4
    with sides(g, ring_bytes=4 * region_bytes(g, 1), timeouts=FAST) as s:
        c = s.cluster
        requests = [
            c.add_request(100 + i, num_pages=chunks, chunk_pages=1, seed=i) for i in range(rooms)
        ]
        senders, receivers = [], []
        for request in requests:
            c.handlers[0].release_room(request.room)
            receiver = KVReceiver(s.decode[0], request.room)
            receiver.init(request.decode_pages, chunk_pages=1)
            receiver.send_metadata()
            sender = KVSender(s.prefill[0], request.room)
            sender.init(chunks, c.targets)
            senders.append(sender)
            receivers.append(receiver)
        assert wait_for(lambda: all(x.poll() is KVPoll.WaitingForInput for x in senders))
        for index in range(chunks):
            for sender, request in zip(senders, requests, strict=True):
                sender.send([request.prefill_pages[index]], last=index == chunks - 1)
        assert wait_states(senders, timeout=30) == [KVPoll.Success] * rooms
        assert wait_states(receivers, timeout=10) == [KVPoll.Success] * rooms
        assert all(pages_match(c, request) for request in requests)
        assert c.handlers[0].allocator.live_count == 0


# --------------------------------------------------------------------------- 5. dead peers


def test_a_dead_decode_fails_every_queued_room_together() -> None:
    """Finding 5: the per-chunk deadline and the serial worker failed queued rooms one after
    another (room k at k x deadline). Now the decode rank's silence fails them all at once,
    within the liveness timeout."""
    with sides(Geometry(1, 1, 2), timeouts=PrefillTimeouts(0.05, 0.05, 30.0)) as s:
        c = s.cluster
        c.prefill[0].liveness.timeout_s = 1.0
        requests = [c.add_request(110 + i, num_pages=2, chunk_pages=2, seed=i) for i in range(6)]
        senders = []
        for request in requests:
            c.handlers[0].release_room(request.room)
            receiver = KVReceiver(s.decode[0], request.room)
            receiver.init(request.decode_pages, chunk_pages=2)
            receiver.send_metadata()
            sender = KVSender(s.prefill[0], request.room)
            sender.init(2, c.targets)
            senders.append(sender)
        assert wait_for(lambda: all(x.poll() is KVPoll.WaitingForInput for x in senders))
        c.decode[0].close()  # the decode rank dies: nothing answers from now on
        start = time.monotonic()
        for sender, request in zip(senders, requests, strict=True):
            sender.send(request.prefill_pages, last=True)
        assert wait_states(senders, timeout=10) == [KVPoll.Failed] * 6
        assert time.monotonic() - start < 5.0
        # Liveness, or the engine noticing the peer is gone, whichever comes first.
        assert all(("dead" in f or "gone" in f) for f in (x.failure() or "" for x in senders))


def test_a_dead_prefill_fails_its_decode_rooms_within_seconds() -> None:
    """Finding 5: a dead prefill rank's rooms on decode failed only after the 60 s stall
    timeout, and only those holding a region. Now every room it feeds fails when liveness
    declares it dead, and their fenced regions return."""
    with sides(Geometry(2, 1, 4), timeouts=FAST) as s:
        c = s.cluster
        c.decode[0].liveness.timeout_s = 1.0
        request = c.add_request(120, num_pages=4, chunk_pages=2)
        handler = c.handlers[0]
        sid = handler.session_id
        handler.handle_staging_req(120, 0, num_pages=2, session_id=sid, pp_rank=None)
        handler.handle_chunk_arrival(
            120, 0, page_start=0, num_pages=2, session_id=sid, writer_rank=0
        )
        c.prefill[1].close()  # prefill rank 1 dies before writing
        start = time.monotonic()
        assert wait_for(lambda: handler.poll_room(120) is RoomStatus.FAILED, timeout=10)
        assert time.monotonic() - start < 5.0
        assert "prefill writer rank 1" in (handler.room_failure(120) or "")
        assert "dead" in (handler.room_failure(120) or "")
        # Rank 0 answers its fence; dead rank 1 is not waited for: the region returns.
        assert wait_for(lambda: handler.allocator.live_count == 0, timeout=5)
        del request


# --------------------------------------------------------------------------- 10. anonymous


def test_an_anonymous_arrival_in_a_region_of_several_writers_fails_the_room() -> None:
    """Finding 10: a CHUNK_READY without a writer rank, sent twice, completed a region of two
    writers before the second writer landed, and the room reported SUCCESS."""
    with local_cluster(Geometry(2, 1, 4)) as cluster:
        handler = cluster.handlers[0]
        sid = handler.session_id
        cluster.add_request(130, num_pages=2, chunk_pages=2)
        handler.handle_staging_req(130, 0, num_pages=2, session_id=sid, pp_rank=None)
        outcomes = [
            handler.handle_chunk_arrival(
                130, 0, page_start=0, num_pages=2, session_id=sid, writer_rank=None
            )
            for _ in range(2)
        ]
        assert outcomes == [ArrivalOutcome.REJECTED, ArrivalOutcome.UNKNOWN]
        assert handler.poll_room(130) is RoomStatus.FAILED
        assert "cannot be told from a duplicate" in (handler.room_failure(130) or "")


def test_an_anonymous_arrival_of_a_single_writer_counts_once() -> None:
    """With one writer, an arrival without a rank completes the region; a repeat is a
    duplicate."""
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        handler = cluster.handlers[0]
        sid = handler.session_id
        cluster.add_request(131, num_pages=2, chunk_pages=2)
        handler.handle_staging_req(131, 0, num_pages=2, session_id=sid, pp_rank=None)
        outcomes = [
            handler.handle_chunk_arrival(
                131, 0, page_start=0, num_pages=2, session_id=sid, writer_rank=None
            )
            for _ in range(2)
        ]
        assert outcomes == [ArrivalOutcome.COMPLETE, ArrivalOutcome.DUPLICATE]
        assert handler.poll_room(131) is RoomStatus.SUCCESS


def test_a_room_registered_after_its_writer_died_fails_at_once() -> None:
    """Found by the soak: liveness declares a dead writer once; a room registered later with
    that writer used to wait forever (no region, so no stall clock either)."""
    with sides(Geometry(1, 1, 2), timeouts=FAST) as s:
        c = s.cluster
        c.decode[0].liveness.timeout_s = 1.0
        handler = c.handlers[0]
        first = c.add_request(140, num_pages=2, chunk_pages=1)
        second = c.add_request(141, num_pages=2, chunk_pages=1, seed=1)
        c.prefill[0].close()  # the only writer dies
        assert wait_for(lambda: handler.poll_room(140) is RoomStatus.FAILED, timeout=10)
        for request in (first, second):
            handler.release_room(request.room)
        receiver = KVReceiver(s.decode[0], second.room)
        receiver.init(second.decode_pages, chunk_pages=1)
        assert receiver.poll() is KVPoll.Failed
        assert "is dead" in (receiver.failure() or "")


def test_a_decode_that_dies_before_room_meta_fails_the_room_within_the_liveness_bound() -> None:
    """Found by the soak: prefill watched a decode rank only once ROOM_META came, so a decode
    that died before sending it failed the room only at the ROOM_META timeout (30 s)."""
    with sides(Geometry(1, 1, 2), timeouts=FAST, meta_timeout_s=30.0) as s:
        c = s.cluster
        c.prefill[0].liveness.timeout_s = 1.0
        request = c.add_request(142, num_pages=2, chunk_pages=2)
        sender = KVSender(s.prefill[0], request.room)
        sender.init(2, c.targets)
        sender.send(request.prefill_pages, last=True)
        start = time.monotonic()
        c.decode[0].close()
        assert sender.wait(10.0) is KVPoll.Failed
        assert time.monotonic() - start < 5.0
        assert "dead" in (sender.failure() or "") or "gone" in (sender.failure() or "")
