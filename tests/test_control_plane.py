"""The staging control plane end to end: real ZMQ on loopback, ranks as threads, LocalEngine."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from staging_contracts import ArrivalOutcome, StagingReqOutcome
from staging_contracts._control.room_messages import Ping
from staging_contracts._control.transport import open_socket_count
from staging_contracts._control.wire import ChunkReady, StagingReq, StagingRsp, decode_message
from staging_contracts._decode.handler import RoomPlan, RoomStatus
from staging_contracts._decode.publisher import PrefillPublisher
from staging_contracts._decode.rooms import PrefillPeer
from staging_contracts._prefill.writer import ChunkSpec, PrefillTimeouts, StagingFailed
from tests.local_cluster import Geometry, LocalCluster, local_cluster, pools_equal, wait_for

FAST = PrefillTimeouts(answer_s=0.05, ready_s=0.05, deadline_s=30.0)


@pytest.fixture
def zmq_ctx() -> zmq.Context[zmq.Socket[bytes]]:
    """The process-wide ZMQ context (never terminated by tests)."""
    return zmq.Context.instance()


@pytest.fixture
def fake_prefill(
    zmq_ctx: zmq.Context[zmq.Socket[bytes]],
) -> Iterator[tuple[str, zmq.Socket[bytes]]]:
    """A PULL socket standing in for a prefill listener: (endpoint, socket)."""
    sock = zmq_ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    yield endpoint.decode(), sock
    sock.close(linger=0)


def push_to(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    """A PUSH socket connected to a listener."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def receive(sock: zmq.Socket[bytes], count: int, timeout: float = 5.0) -> list[list[bytes]]:
    """Receive ``count`` staging messages or fail after ``timeout`` (liveness pings skipped)."""
    out: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while len(out) < count:
        if sock.poll(max(1, int((deadline - time.monotonic()) * 1000))) == 0:
            break
        frames = sock.recv_multipart()
        if frames[0] != Ping.KIND:
            out.append(frames)
    return out


def run_and_verify(cluster: LocalCluster, rooms: list[int], **send: str) -> None:
    """Send every request, wait for success, check the pools and the empty rings."""
    errors = cluster.send_all([r for r in cluster.requests if r.room in rooms], **send)
    assert errors == []
    status = cluster.wait_rooms(rooms)
    assert all(s == RoomStatus.SUCCESS for v in status.values() for s in v), status
    for d in range(cluster.geometry.decode_tp):
        assert pools_equal(cluster.decode_pools[d], cluster.expected_decode_pool(d)), d
    cluster.release(rooms)
    assert [h._allocator.live_count for h in cluster.handlers] == [0] * len(cluster.handlers)
    assert [h.live_rooms for h in cluster.handlers] == [0] * len(cluster.handlers)


# --------------------------------------------------------------------------- whole transfers


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "heads"),
    [(4, 2, 8), (1, 4, 2), (2, 4, 8), (4, 1, 2), (2, 1, 8), (1, 1, 4)],
)
def test_multi_chunk_rooms_arrive_bit_exact(prefill_tp: int, decode_tp: int, heads: int) -> None:
    """Several multi-chunk rooms at once land bit-exact and leave every ring empty."""
    with local_cluster(Geometry(prefill_tp, decode_tp, heads), timeouts=FAST) as cluster:
        for room in (11, 12, 13):
            cluster.add_request(room, num_pages=7, chunk_pages=3, seed=room)
        run_and_verify(cluster, [11, 12, 13])
        stats = cluster.decode[0].staging_stats()
        assert stats.malformed == 0
        assert stats.allocated == 9
        assert stats.arrivals == 9 * max(1, prefill_tp // decode_tp)


def test_chunks_written_out_of_order_arrive_bit_exact() -> None:
    """Chunks written last-first are scattered as they complete and land bit-exact."""
    with local_cluster(Geometry(4, 2, 8), timeouts=FAST) as cluster:
        cluster.add_request(5, num_pages=9, chunk_pages=2, seed=5)
        run_and_verify(cluster, [5], order="reverse")


def test_wrapping_ring_waits_for_the_watermark() -> None:
    """With a ring smaller than a request, writers wait for frees and still land bit-exact."""
    geometry = Geometry(2, 2, 4, page_size=4)
    chunk_bytes = 2 * 4 * 2 * 8 * 2 * 2 * 2  # pages·page_size·heads·head_dim·bytes·2·layers
    with local_cluster(geometry, ring_bytes=int(chunk_bytes * 1.5), timeouts=FAST) as cluster:
        cluster.add_request(7, num_pages=10, chunk_pages=2, seed=7)
        run_and_verify(cluster, [7])


# --------------------------------------------------------------------------- SPEC §4 cases


def test_staging_req_for_unknown_room_is_dropped_and_counted(
    zmq_ctx: zmq.Context[zmq.Socket[bytes]], fake_prefill: tuple[str, zmq.Socket[bytes]]
) -> None:
    """A STAGING_REQ for a room decode never registered is dropped, counted, not answered."""
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        decode = cluster.decode[0]
        push = push_to(zmq_ctx, decode.endpoint)
        push.send_multipart(StagingReq(99, 0, 1, decode.engine.session_id).to_frames())
        assert wait_for(lambda: decode.staging_stats().dropped == 1)
        assert receive(fake_prefill[1], 1, timeout=0.2) == []
        push.close(linger=0)


def test_staging_req_before_handler_is_attached_is_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before attach_staging_handler, STAGING_REQ is dropped with a warning and a counter."""
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        decode = cluster.decode[0]
        handler = cluster.handlers[0]
        decode.detach_staging_handler()
        frames = StagingReq(1, 0, 1, decode.engine.session_id).to_frames()
        assert decode._handle_staging_req(frames) is None
        assert decode.staging_stats().dropped == 1
        assert "no staging handler attached yet" in caplog.text
        decode.attach_staging_handler(handler)


def test_duplicate_arrival_is_counted_once() -> None:
    """A writer's second arrival for a chunk is a duplicate and changes nothing."""
    with local_cluster(Geometry(1, 1, 2), timeouts=FAST) as cluster:
        request = cluster.add_request(3, num_pages=2, chunk_pages=2)
        cluster.send_all([request])
        handler = cluster.handlers[0]
        assert cluster.wait_rooms([3])[3] == [RoomStatus.SUCCESS]
        again = handler.handle_chunk_arrival(
            3, 0, page_start=0, num_pages=2, session_id=handler.session_id, writer_rank=0
        )
        assert again is ArrivalOutcome.DUPLICATE
        assert pools_equal(cluster.decode_pools[0], cluster.expected_decode_pool(0))
        cluster.release([3])


def test_duplicate_writer_before_completion_does_not_complete_the_chunk() -> None:
    """With two writers, the same writer arriving twice still waits for the other one."""
    with local_cluster(Geometry(2, 1, 2)) as cluster:
        cluster.add_request(4, num_pages=2, chunk_pages=2)
        handler = cluster.handlers[0]
        sid = handler.session_id
        assert handler.handle_staging_req(4, 0, num_pages=2, session_id=sid, pp_rank=None) is (
            StagingReqOutcome.ALLOCATED
        )

        def arrive(writer: int) -> ArrivalOutcome:
            return handler.handle_chunk_arrival(
                4, 0, page_start=0, num_pages=2, session_id=sid, writer_rank=writer
            )

        assert arrive(0) is ArrivalOutcome.WAITING
        assert arrive(0) is ArrivalOutcome.DUPLICATE
        assert arrive(1) is ArrivalOutcome.COMPLETE
        cluster.release([4])


def test_geometry_mismatch_in_staging_req_fails_the_room(
    fake_prefill: tuple[str, zmq.Socket[bytes]],
) -> None:
    """A STAGING_REQ whose page count disagrees with the registration is refused with -2."""
    endpoint, sock = fake_prefill
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        handler = cluster.handlers[0]
        handler.register_room(RoomPlan(8, (1, 2, 3, 4), 2, 1, (PrefillPeer(0, endpoint),)))
        outcome = handler.handle_staging_req(
            8, 0, num_pages=3, session_id=handler.session_id, pp_rank=None
        )
        assert outcome is StagingReqOutcome.REJECTED
        (answer,) = receive(sock, 1)
        rsp = decode_message(answer)
        assert isinstance(rsp, StagingRsp)
        assert (rsp.offset, rsp.round, rsp.end) == (-2, 0, -1)
        assert handler.poll_room(8) is RoomStatus.FAILED
        assert "STAGING_REQ says 3 pages, decode registered 2" in (handler.room_failure(8) or "")
        handler.release_room(8)


def test_geometry_mismatch_in_arrival_fails_the_room() -> None:
    """An arrival whose pages disagree with the region fails the room and frees the ring."""
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        cluster.add_request(9, num_pages=4, chunk_pages=2)
        handler = cluster.handlers[0]
        sid = handler.session_id
        handler.handle_staging_req(9, 1, num_pages=2, session_id=sid, pp_rank=None)
        outcome = handler.handle_chunk_arrival(
            9, 1, page_start=0, num_pages=2, session_id=sid, writer_rank=0
        )
        assert outcome is ArrivalOutcome.REJECTED
        assert handler.poll_room(9) is RoomStatus.FAILED
        assert wait_for(lambda: handler._allocator.live_count == 0)  # once writer 0 is fenced
        handler.release_room(9)


def test_arrival_from_a_writer_that_does_not_feed_this_rank_fails_the_room() -> None:
    """Only the prefill ranks that feed a decode rank may signal arrival into its ring."""
    with local_cluster(Geometry(4, 2, 8)) as cluster:
        cluster.add_request(10, num_pages=2, chunk_pages=2)
        handler = cluster.handlers[0]
        sid = handler.session_id
        handler.handle_staging_req(10, 0, num_pages=2, session_id=sid, pp_rank=None)
        outcome = handler.handle_chunk_arrival(
            10, 0, page_start=0, num_pages=2, session_id=sid, writer_rank=3
        )
        assert outcome is ArrivalOutcome.REJECTED
        assert "writer rank 3 does not feed decode rank 0" in (handler.room_failure(10) or "")
        cluster.release([10])


def test_oversized_chunk_is_answered_with_minus_two_and_fails_the_room() -> None:
    """A chunk larger than the ring gets offset -2 and the prefill raises StagingFailed."""
    with local_cluster(Geometry(1, 1, 2), ring_bytes=256, timeouts=FAST) as cluster:
        request = cluster.add_request(12, num_pages=4, chunk_pages=4)
        errors = cluster.send_all([request])
        assert len(errors) == 1
        assert isinstance(errors[0], StagingFailed)
        assert errors[0].reason == "decode refused chunk 0 (offset -2)"
        # The refusal can reach prefill before decode's listener counts it.
        assert wait_for(lambda: cluster.decode[0].staging_stats().oversized == 1)
        assert cluster.handlers[0].poll_room(12) is RoomStatus.FAILED
        cluster.release([12])


def test_resent_staging_req_for_consumed_chunk_is_refused(
    fake_prefill: tuple[str, zmq.Socket[bytes]],
) -> None:
    """After a chunk was scattered, asking for it again gets the failure answer, no region."""
    with local_cluster(Geometry(1, 1, 2), timeouts=FAST) as cluster:
        request = cluster.add_request(14, num_pages=2, chunk_pages=2)
        cluster.send_all([request])
        assert cluster.wait_rooms([14])[14] == [RoomStatus.SUCCESS]
        handler = cluster.handlers[0]
        outcome = handler.handle_staging_req(
            14, 0, num_pages=2, session_id=handler.session_id, pp_rank=None
        )
        assert outcome is StagingReqOutcome.REJECTED
        assert handler._allocator.live_count == 0
        outcome = handler.handle_staging_req(
            14, 5, num_pages=2, session_id=handler.session_id, pp_rank=None
        )
        assert outcome is StagingReqOutcome.REJECTED
        cluster.release([14])


def test_lost_staging_rsp_is_recovered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first STAGING_RSP of every chunk is lost; prefill re-requests and completes."""
    lost: set[tuple[str, bytes, bytes]] = set()
    original = PrefillPublisher.send

    def lossy(self: PrefillPublisher, endpoint: str, frames: list[bytes]) -> bool:
        if frames[0] == b"STAGING_RSP":
            key = (endpoint, frames[1], frames[2])
            if key not in lost:
                lost.add(key)
                return True
        return original(self, endpoint, frames)

    monkeypatch.setattr(PrefillPublisher, "send", lossy)
    with local_cluster(Geometry(1, 1, 2), timeouts=FAST) as cluster:
        cluster.add_request(15, num_pages=6, chunk_pages=2)
        run_and_verify(cluster, [15])
        assert len(lost) == 3
        assert cluster.writers[0].requests_sent >= 6  # three prefetches, three re-requests


def test_lost_watermark_is_recovered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every broadcast WATERMARK is lost; re-requests bring the current watermark back."""
    dropped: list[int] = []

    def lossy_broadcast(self: PrefillPublisher, frames: list[bytes]) -> None:
        dropped.append(1)

    monkeypatch.setattr(PrefillPublisher, "broadcast_watermark", lossy_broadcast)
    geometry = Geometry(1, 1, 2)
    chunk_bytes = 2 * 4 * 2 * 8 * 2 * 2 * 2  # pages·page_size·heads·head_dim·bytes·2·layers
    with local_cluster(geometry, ring_bytes=int(chunk_bytes * 1.5), timeouts=FAST) as cluster:
        cluster.add_request(16, num_pages=8, chunk_pages=2)
        run_and_verify(cluster, [16])
        assert dropped


def test_teardown_in_mid_flight_frees_everything_and_is_idempotent() -> None:
    """Releasing a room with live regions fences them until its writers answer, then frees them;
    later arrivals are ignored; twice is safe."""
    with local_cluster(Geometry(2, 1, 4)) as cluster:
        cluster.add_request(17, num_pages=6, chunk_pages=2)
        handler = cluster.handlers[0]
        sid = handler.session_id
        for chunk in range(3):
            handler.handle_staging_req(17, chunk, num_pages=2, session_id=sid, pp_rank=None)
        handler.handle_chunk_arrival(
            17, 0, page_start=0, num_pages=2, session_id=sid, writer_rank=0
        )
        assert handler._allocator.live_count == 3
        handler.release_room(17)
        # Fenced for both writers; a writer's answer may already have cleared its part (the
        # local cluster's prefill ranks answer at once, from their listener threads).
        assert handler.fenced_rooms.get(17, frozenset()) <= frozenset({0, 1})
        assert wait_for(lambda: handler._allocator.live_count == 0)  # both writers fenced
        assert handler.fenced_rooms == {}
        assert handler.live_rooms == 0
        late = handler.handle_chunk_arrival(
            17, 0, page_start=0, num_pages=2, session_id=sid, writer_rank=1
        )
        assert late is ArrivalOutcome.UNKNOWN
        handler.release_room(17)


def test_stalled_room_fails_and_frees_the_ring() -> None:
    """A room that holds regions without progress past the stall timeout fails."""
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        cluster.add_request(18, num_pages=2, chunk_pages=2)
        handler = cluster.handlers[0]
        handler._stall_timeout = 0.05
        handler.handle_staging_req(18, 0, num_pages=2, session_id=handler.session_id, pp_rank=None)
        assert wait_for(lambda: handler.poll_room(18) is RoomStatus.FAILED)
        assert wait_for(lambda: handler._allocator.live_count == 0)
        handler.release_room(18)


def test_misaligned_decode_prefix_fails_that_room_only() -> None:
    """A prefix that is not page-aligned fails its room; other rooms proceed."""
    with local_cluster(Geometry(1, 1, 2), timeouts=FAST) as cluster:
        handler = cluster.handlers[0]
        peers = (PrefillPeer(0, cluster.prefill[0].endpoint),)
        status = handler.register_room(RoomPlan(19, (1, 2), 2, 1, peers, prefix_tokens=3))
        assert status is RoomStatus.FAILED
        assert "not aligned to page_size=4" in (handler.room_failure(19) or "")
        cluster.add_request(20, num_pages=2, chunk_pages=2)
        handler.release_room(19)
        run_and_verify(cluster, [20])


def test_registration_is_idempotent() -> None:
    """Registering a room again keeps its in-flight state."""
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        request = cluster.add_request(21, num_pages=2, chunk_pages=2)
        handler = cluster.handlers[0]
        handler.handle_staging_req(21, 0, num_pages=2, session_id=handler.session_id, pp_rank=None)
        plan = RoomPlan(21, request.decode_pages, 2, 1, (PrefillPeer(0, "tcp://127.0.0.1:1"),))
        assert handler.register_room(plan) is RoomStatus.TRANSFERRING
        assert handler._allocator.live_count == 1
        cluster.release([21])


def test_staging_req_answers_only_the_matching_pp_rank(
    fake_prefill: tuple[str, zmq.Socket[bytes]], zmq_ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """With pp_rank set, only prefill peers of that stage are answered (here: the refusal of a
    pipeline-parallel room, which the staging path does not support yet)."""
    endpoint, sock = fake_prefill
    other = zmq_ctx.socket(zmq.PULL)
    other.setsockopt(zmq.LINGER, 0)
    other.bind("tcp://127.0.0.1:*")
    other_endpoint = other.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(other_endpoint, bytes)
    try:
        with local_cluster(Geometry(1, 1, 2)) as cluster:
            handler = cluster.handlers[0]
            peers = (
                PrefillPeer(0, endpoint, pp_rank=0),
                PrefillPeer(0, other_endpoint.decode(), 1),
            )
            handler.register_room(RoomPlan(22, (1, 2), 2, 1, peers))
            outcome = handler.handle_staging_req(
                22, 0, num_pages=2, session_id=handler.session_id, pp_rank=1
            )
            assert outcome is StagingReqOutcome.REJECTED
            # The refusal of a failed room follows its ROOM_FAILED (the cause, for prefill).
            failed, answer = receive(other, 2)
            assert failed[0] == b"ROOM_FAILED", failed
            rsp = decode_message(answer)
            assert isinstance(rsp, StagingRsp)
            assert rsp.offset == -2
            answers = receive(other, 1, timeout=0.2) + receive(sock, 3, timeout=0.2)
            assert all(f[0] != StagingRsp.WIRE_TYPE for f in answers)  # pp rank 0 is not answered
            handler.release_room(22)
    finally:
        other.close(linger=0)


def test_send_to_a_dead_peer_never_blocks_and_prunes_it() -> None:
    """Answers to a prefill that is gone are dropped without blocking; the peer is pruned."""
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        handler = cluster.handlers[0]
        dead = "tcp://127.0.0.1:9"  # nothing listens there
        handler._publisher._sender._hwm = 1
        handler.register_room(RoomPlan(23, tuple(range(1, 41)), 1, 1, (PrefillPeer(0, dead),)))
        for chunk in range(40):  # a blocking send would hang here (pytest-timeout ends it)
            handler.handle_staging_req(
                23, chunk, num_pages=1, session_id=handler.session_id, pp_rank=None
            )
        assert handler._publisher._sender.dropped > 0
        assert handler._publisher.pruned >= 1
        handler.release_room(23)
        assert dead not in handler._publisher.subscribers


# --------------------------------------------------------------------------- bad input


def test_listener_fed_bad_and_good_messages_answers_every_good_one(
    zmq_ctx: zmq.Context[zmq.Socket[bytes]], fake_prefill: tuple[str, zmq.Socket[bytes]]
) -> None:
    """Malformed messages are counted and dropped; every good STAGING_REQ is answered."""
    endpoint, sock = fake_prefill
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        decode = cluster.decode[0]
        handler = cluster.handlers[0]
        handler.register_room(RoomPlan(30, tuple(range(1, 11)), 1, 1, (PrefillPeer(0, endpoint),)))
        sid = handler.session_id.encode()
        bad: list[list[bytes]] = [
            [b"STAGING_REQ", b"30", b"0", b"1"],
            [b"STAGING_REQ", b"30", b"0", b"1", sid, b"0", b"extra"],
            [b"STAGING_REQ", "٣".encode(), b"0", b"1", sid],
            [b"STAGING_REQ", b"30", b"x", b"1", sid],
            [b"STAGING_REQ", b"+5", b"0", b"1", sid],
            [b"STAGING_REQ", b" 5", b"0", b"1", sid],
            [b"STAGING_REQ", b"9" * 25, b"0", b"1", sid],
            [b"STAGING_REQ", b"-1", b"0", b"1", sid],
            [b"STAGING_REQ", b"30", b"0", b"1", b""],
            [b"NOT_A_TYPE", b"1"],
            [b""],
        ]
        push = push_to(zmq_ctx, decode.endpoint)
        for chunk in range(10):
            push.send_multipart(bad[chunk % len(bad)])
            push.send_multipart(StagingReq(30, chunk, 1, handler.session_id).to_frames())
        push.send_multipart(bad[10])
        answers = [decode_message(m) for m in receive(sock, 20)]
        rsps = [a for a in answers if isinstance(a, StagingRsp)]
        assert sorted(r.chunk_idx for r in rsps) == list(range(10))
        assert wait_for(lambda: decode.listener.stats().malformed == 11)
        assert decode.listener.alive
        stats = decode.staging_stats()
        assert stats.allocated == 10
        assert stats.malformed == 9  # the two of unknown type never reach the mixin
        push.close(linger=0)
        handler.release_room(30)


def test_malformed_notification_is_counted_and_the_listener_keeps_serving() -> None:
    """A bad arrival notification is dropped; good ones still complete the chunk."""
    with local_cluster(Geometry(1, 1, 2), timeouts=FAST) as cluster:
        decode = cluster.decode[0]
        prefill_engine = cluster.prefill[0].engine
        prefill_engine.write(decode.engine.session_id, [], b"CHUNK_READY\x00garbage")
        request = cluster.add_request(31, num_pages=2, chunk_pages=2)
        cluster.send_all([request])
        assert cluster.wait_rooms([31])[31] == [RoomStatus.SUCCESS]
        assert decode.staging_stats().malformed == 1
        cluster.release([31])


def test_chunk_ready_frames_complete_a_chunk(
    zmq_ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Mooncake's arrival signal, CHUNK_READY over ZMQ, completes a chunk like a notification."""
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        decode = cluster.decode[0]
        handler = cluster.handlers[0]
        cluster.add_request(32, num_pages=2, chunk_pages=2)
        handler.handle_staging_req(32, 0, num_pages=2, session_id=handler.session_id, pp_rank=None)
        push = push_to(zmq_ctx, decode.endpoint)
        push.send_multipart(ChunkReady(32, 0, 0, 2, handler.session_id, 0).to_frames())
        assert wait_for(lambda: handler.poll_room(32) is RoomStatus.SUCCESS)
        assert decode.staging_stats().arrivals == 1
        push.close(linger=0)
        handler.release_room(32)


# --------------------------------------------------------------------------- clean shutdown


def test_shutdown_leaks_no_threads_or_sockets() -> None:
    """Closing every manager stops its listener thread and closes every socket."""
    threads_before = {t.ident for t in threading.enumerate()}
    sockets_before = open_socket_count()
    with local_cluster(Geometry(2, 1, 4), timeouts=FAST) as cluster:
        cluster.add_request(40, num_pages=4, chunk_pages=2)
        run_and_verify(cluster, [40])
        assert open_socket_count() > sockets_before
    assert open_socket_count() == sockets_before
    assert {t.ident for t in threading.enumerate()} <= threads_before


def test_pipeline_parallel_prefill_is_refused_clearly() -> None:
    """Peers of several pp ranks fail the room with a message; pp_size > 1 cannot stage."""
    from staging_contracts.backends._common import Role
    from staging_contracts.backends._staging_setup import enable_prefill_staging
    from staging_contracts.backends.local import LocalKVManager

    with local_cluster(Geometry(1, 1, 2)) as cluster:
        handler = cluster.handlers[0]
        peers = (PrefillPeer(0, "tcp://127.0.0.1:1", 0), PrefillPeer(0, "tcp://127.0.0.1:2", 1))
        assert handler.register_room(RoomPlan(60, (1, 2), 2, 1, peers)) is RoomStatus.FAILED
        assert "pipeline-parallel prefill" in (handler.room_failure(60) or "")
        handler.release_room(60)
    geometry = Geometry(1, 1, 2)
    manager = LocalKVManager(geometry.kv_args(1, 0), role=Role.PREFILL, attn_tp_size=1, pp_size=2)
    try:
        with pytest.raises(NotImplementedError, match=r"^staging with a pipeline-parallel"):
            enable_prefill_staging(manager, kv_buffers=geometry.empty_pool(1, 0), max_chunk_pages=2)
    finally:
        manager.close()


def test_chunk_larger_than_the_staging_buffer_fails_before_any_request() -> None:
    """A chunk over max_chunk_pages fails its room at once, without asking decode for a region."""
    with local_cluster(Geometry(1, 1, 2), max_chunk_pages=2) as cluster:
        writer = cluster.writers[0]
        with pytest.raises(
            StagingFailed, match=r"^room 61: chunk 0 of 3 pages exceeds max_chunk_pages=2$"
        ):
            writer.send_chunk(61, ChunkSpec(0, 0, (1, 2, 3)), cluster.targets)
        assert writer.requests_sent == 0
