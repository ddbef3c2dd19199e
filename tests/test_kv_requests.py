"""The per-request API: KVSender and KVReceiver over LocalKVManagers in one process."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import types
from collections.abc import Callable, Sequence

import pytest

from staging_contracts._control.room_messages import RoomMeta
from staging_contracts._control.wire import StagingReq
from staging_contracts._decode import handler as decode_handler
from staging_contracts._prefill import writer as writer_module
from staging_contracts._prefill.writer import (
    ChunkSpec,
    DecodeTarget,
    PrefillTimeouts,
    StagingFailed,
)
from staging_contracts.backends._kv_requests import (
    KVPoll,
    KVReceiver,
    KVSender,
    PrefillTransfers,
)
from staging_contracts.outcomes import FailureReason, Outcome, RoomFailure
from staging_contracts.protocols import KVArgs
from tests.local_cluster import (
    Geometry,
    pools_equal,
    sides,
    wait_for,
    wait_states,
)
from tests.test_prefill_writer import TICK, Clock, expected_gather, make_rig


def test_request_goes_through_every_state_and_lands_bit_exact() -> None:
    """Bootstrapping, WaitingForInput, Transferring, Success on both sides; pages verify."""
    with sides(Geometry(2, 1, 4)) as s:
        c = s.cluster
        request = c.add_request(50, num_pages=6, chunk_pages=2)
        c.handlers[0].release_room(50)  # registered again below through the receiver
        receiver = KVReceiver(s.decode[0], 50)
        receiver.init(request.decode_pages, chunk_pages=2)
        assert receiver.poll() is KVPoll.Bootstrapping
        senders = [KVSender(t, 50) for t in s.prefill]
        for sender in senders:
            sender.init(6, c.targets)
            assert sender.poll() is KVPoll.Bootstrapping
        receiver.send_metadata()
        # Prefill prefetches regions as soon as it has the metadata: decode may already be
        # transferring by the time it is polled.
        assert receiver.poll() in (KVPoll.WaitingForInput, KVPoll.Transferring)
        deadline = time.monotonic() + 5
        while (
            any(x.poll() is not KVPoll.WaitingForInput for x in senders)
            and time.monotonic() < deadline
        ):
            time.sleep(0.005)
        assert [x.poll() for x in senders] == [KVPoll.WaitingForInput] * 2
        for sender in senders:
            for chunk in request.chunks():
                sender.send(chunk.pages, last=chunk.chunk_idx == 2)
        assert wait_states(senders) == [KVPoll.Success] * 2
        assert wait_states([receiver]) == [KVPoll.Success]
        assert pools_equal(c.decode_pools[0], c.expected_decode_pool(0))
        records = [x.get_transfer_metric() for x in senders] + [receiver.get_transfer_metric()]
        for record in records:
            assert record is not None
            assert record.outcome is Outcome.SUCCESS
            assert record.reason is None
            assert record.latency_s >= 0
            assert record.end_wall >= record.start_wall
        page_bytes = sum(s.cluster.geometry.kv_args(1, 0).kv_item_lens)  # decode, every head
        # Each prefill rank wrote its half of the heads of 6 pages in 3 chunks; decode
        # scattered the 3 chunks' regions, each holding both writers' halves.
        assert [(r.chunks, r.bytes) for r in records if r is not None] == [
            (3, 3 * page_bytes),
            (3, 3 * page_bytes),
            (3, 6 * page_bytes),
        ]
        receiver.release()
        for sender in senders:
            sender.release()
        assert c.handlers[0].allocator.live_count == 0
        # Released: the records are those kept at the end, not a failure of an unknown room.
        kept = [x.get_transfer_metric() for x in senders] + [receiver.get_transfer_metric()]
        assert kept == records


def test_a_record_not_asked_for_before_release_is_kept_by_it() -> None:
    """``release`` keeps the record of a room that ended; one that had not ended has none."""
    with sides(Geometry(1, 1, 2)) as s:
        c = s.cluster
        request = c.add_request(58, num_pages=4, chunk_pages=2)
        c.handlers[0].release_room(58)
        receiver = KVReceiver(s.decode[0], 58)
        receiver.init(request.decode_pages, chunk_pages=2)
        receiver.send_metadata()
        sender = KVSender(s.prefill[0], 58)
        sender.init(4, c.targets)
        for chunk in request.chunks():
            sender.send(chunk.pages, last=chunk.chunk_idx == 1)
        assert wait_states([sender]) == [KVPoll.Success]
        assert wait_states([receiver]) == [KVPoll.Success]
        sender.release()
        receiver.release()
        for record in (sender.get_transfer_metric(), receiver.get_transfer_metric()):
            assert record is not None
            assert record.outcome is Outcome.SUCCESS
        idle = KVSender(s.prefill[0], 59)
        idle.init(4, c.targets)
        idle.release()
        assert idle.get_transfer_metric() is None


def test_a_room_in_flight_when_the_transfers_close_fails_as_draining() -> None:
    """Closing ``PrefillTransfers`` with a room in flight ends it (failed, draining): it is
    counted and its record says so."""
    with sides(Geometry(1, 1, 2)) as s:
        sender = KVSender(s.prefill[0], 57)
        sender.init(2, s.cluster.targets)
        s.prefill[0].close()
        assert sender.poll() is KVPoll.Failed
        record = sender.get_transfer_metric()
        assert record is not None
        assert record.reason is FailureReason.DRAINING
        assert s.prefill[0].room_tally().ended == (("failed", str(FailureReason.DRAINING), 1),)


def test_wait_wakes_when_the_request_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """``wait`` returns Success on both sides as the last chunk lands, long before its bound:
    woken by the completion itself (decode's periodic re-check is pushed past the bound)."""
    monkeypatch.setattr(decode_handler, "WAIT_SLICE_S", 60.0)
    with sides(Geometry(2, 1, 4)) as s:
        c = s.cluster
        request = c.add_request(60, num_pages=6, chunk_pages=2)
        c.handlers[0].release_room(60)
        receiver = KVReceiver(s.decode[0], 60)
        receiver.init(request.decode_pages, chunk_pages=2)
        senders = [KVSender(t, 60) for t in s.prefill]
        for sender in senders:
            sender.init(6, c.targets)
        receiver.send_metadata()
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            decode_done = pool.submit(receiver.wait, 60.0)  # waiting before any chunk is sent
            for sender in senders:
                for chunk in request.chunks():
                    sender.send(chunk.pages, last=chunk.chunk_idx == 2)
            assert [sender.wait(60.0) for sender in senders] == [KVPoll.Success] * 2
            assert decode_done.result() is KVPoll.Success
        assert time.monotonic() - start < 30.0  # woken, not timed out
        assert pools_equal(c.decode_pools[0], c.expected_decode_pool(0))
        receiver.release()


def test_wait_returns_the_current_state_after_its_bound() -> None:
    """A request that cannot end returns its state once the bound passed."""
    with sides(Geometry(1, 1, 2)) as s:
        receiver = KVReceiver(s.decode[0], 61)
        receiver.init((0, 1), chunk_pages=2)
        sender = KVSender(s.prefill[0], 62)
        sender.init(2, s.cluster.targets)
        assert receiver.wait(0.05) is KVPoll.Bootstrapping
        assert sender.wait(0.05) is KVPoll.Bootstrapping
        assert KVSender(s.prefill[0], 63).wait(0.05) is KVPoll.Failed  # unknown room
        receiver.release()


def test_chunk_off_decode_grid_fails_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk that disagrees with decode's grid fails on prefill, and decode is told; the
    failure wakes a waiting sender and receiver."""
    monkeypatch.setattr(decode_handler, "WAIT_SLICE_S", 60.0)
    with sides(Geometry(1, 1, 2)) as s:
        c = s.cluster
        request = c.add_request(51, num_pages=4, chunk_pages=2)
        c.handlers[0].release_room(51)
        receiver = KVReceiver(s.decode[0], 51)
        receiver.init(request.decode_pages, chunk_pages=2)
        receiver.send_metadata()
        sender = KVSender(s.prefill[0], 51)
        sender.init(4, c.targets)
        sender.send(request.prefill_pages[:3])
        sender.send(request.prefill_pages[3:], last=True)
        start = time.monotonic()
        assert sender.wait(60.0) is KVPoll.Failed
        assert "decode's grid of 2 pages expects 2" in (sender.failure() or "")
        assert receiver.wait(60.0) is KVPoll.Failed
        assert time.monotonic() - start < 30.0  # woken, not timed out
        assert "prefill failed the room" in (receiver.failure() or "")
        receiver.release()
        assert wait_for(lambda: c.handlers[0].allocator.live_count == 0)


def test_missing_room_meta_fails_after_the_timeout() -> None:
    """Without decode's ROOM_META the prefill gives the room up after its bound."""
    with sides(Geometry(1, 1, 2)) as s:
        sender = KVSender(s.prefill[0], 52)
        sender.init(2, s.cluster.targets)
        sender.send((1, 2), last=True)
        assert wait_states([sender], timeout=10) == [KVPoll.Failed]
        assert sender.failure() == "decode never sent ROOM_META"
        assert sender.failure_record() == RoomFailure(
            FailureReason.NO_ROOM_META, "decode never sent ROOM_META"
        )
        record = sender.get_transfer_metric()
        assert record is not None
        assert record.outcome is Outcome.FAILED
        assert record.reason is FailureReason.NO_ROOM_META
        assert (record.chunks, record.bytes) == (0, 0)  # nothing written


def test_send_after_last_chunk_is_refused() -> None:
    """A chunk after the last one is a programming error."""
    with sides(Geometry(1, 1, 2)) as s:
        sender = KVSender(s.prefill[0], 53)
        sender.init(2, s.cluster.targets)
        sender.send((1, 2), last=True)
        with pytest.raises(ValueError, match=r"^room 53: a chunk after the last one$"):
            sender.send((3,))
        with pytest.raises(RuntimeError, match=r"^room 54: send_metadata before init$"):
            KVReceiver(s.decode[0], 54).send_metadata()


def test_page_count_disagreement_fails_the_request() -> None:
    """A sender whose page count differs from decode's ROOM_META fails, whichever came first."""
    with sides(Geometry(1, 1, 2)) as s:
        c = s.cluster
        request = c.add_request(55, num_pages=4, chunk_pages=2)
        c.handlers[0].release_room(55)
        receiver = KVReceiver(s.decode[0], 55)
        receiver.init(request.decode_pages, chunk_pages=2)
        receiver.send_metadata()
        # until ROOM_META has reached the prefill, which holds it aside (no room yet)
        assert wait_for(lambda: s.prefill[0].early_meta_held == 1)
        assert s.prefill[0].status(55) == (KVPoll.Failed, "unknown room")
        sender = KVSender(s.prefill[0], 55)
        sender.init(3, c.targets)
        assert sender.poll() is KVPoll.Failed
        assert sender.failure() == "decode expects 4 pages, prefill 3"
        assert wait_states([receiver]) == [KVPoll.Failed]
        receiver.release()


def test_a_room_id_used_again_after_release_transfers_normally() -> None:
    """Released on both sides, a room id opened again (KVSender.init) is asked for, written
    and lands bit-exact: the writer refuses a closed room only until it is opened again."""
    with sides(Geometry(1, 1, 2)) as s:
        c = s.cluster
        for seed in (1, 2):
            request = c.add_request(57, num_pages=4, chunk_pages=2, seed=seed)
            c.handlers[0].release_room(57)  # registered again below through the receiver
            receiver = KVReceiver(s.decode[0], 57)
            receiver.init(request.decode_pages, chunk_pages=2)
            sender = KVSender(s.prefill[0], 57)
            sender.init(4, c.targets)
            receiver.send_metadata()
            for chunk in request.chunks():
                sender.send(chunk.pages, last=chunk.chunk_idx == 1)
            assert wait_states([sender]) == [KVPoll.Success], sender.failure()
            assert wait_states([receiver]) == [KVPoll.Success], receiver.failure()
            assert pools_equal(c.decode_pools[0], c.expected_decode_pool(0))
            receiver.release()
            sender.release()
        assert wait_for(lambda: c.handlers[0].allocator.live_count == 0)


class FakeHost:
    """The manager side of PrefillTransfers: records handlers and sends nothing."""

    def __init__(self, kv_args: KVArgs) -> None:
        self._kv_args = kv_args
        self.handlers: dict[bytes, Callable[[list[bytes]], None]] = {}

    @property
    def kv_args(self) -> KVArgs:
        return self._kv_args

    def register_control(self, kind: bytes, handler: Callable[[list[bytes]], None]) -> None:
        self.handlers[kind] = handler

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool:
        del endpoint, frames
        return True

    def add_authorizer(self, authorizer: Callable[[list[bytes], str], bool]) -> None:
        del authorizer


def test_a_room_failed_and_closed_after_its_chunk_was_taken_does_not_hold_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The soak's case through the per-request layer, on the writer's fakes and fake clock:
    the worker takes room 1's chunk because decode fenced the room (chunk_ready), the room
    then fails and is closed before send_chunk. The chunk fails at once ("the room was
    closed") with no STAGING_REQ and no tracking of room 1 again, and room 2 behind it is
    written. (It re-requested every answer_s until deadline_s, and tracked room 1 again.)"""
    clock = Clock()
    monkeypatch.setattr(writer_module, "time", types.SimpleNamespace(monotonic=clock))
    rig = make_rig(clock, timeouts=PrefillTimeouts(answer_s=TICK, ready_s=TICK, deadline_s=1.0))
    host = FakeHost(rig.geometry.kv_args(1, 0))
    transfers = PrefillTransfers(host, rig.writer, meta_timeout_s=60.0)
    writer = rig.writer
    real_ready, real_send = writer.chunk_ready, writer.send_chunk
    stage_calls: list[int] = []
    failures: list[tuple[int, str]] = []

    def chunk_ready(room: int, chunk_idx: int, decode: Sequence[DecodeTarget]) -> bool:
        stage_calls.append(room)
        if room == 1 and stage_calls.count(1) == 2:  # _stage's check, after _next_job's
            rig.fence(1, "aborted")  # the listener: decode fenced room 1; it fails
            ready = real_ready(room, chunk_idx, decode)
            transfers.close_room(1)  # the user closes the failed room
            return ready
        return real_ready(room, chunk_idx, decode)

    def send_chunk(room: int, chunk: ChunkSpec, decode: Sequence[DecodeTarget]) -> int:
        try:
            return real_send(room, chunk, decode)
        except StagingFailed as exc:
            failures.append((room, exc.reason))
            raise

    try:
        for room in (1, 2):
            transfers.open_room(room, 2, rig.targets)
            host.handlers[RoomMeta.KIND](RoomMeta(room, 0, 2, 2).to_frames())
            rig.answer(room, 0, 0, 1024)
        monkeypatch.setattr(writer, "chunk_ready", chunk_ready)
        monkeypatch.setattr(writer, "send_chunk", send_chunk)
        rig.sender.take()
        transfers.submit(1, (1, 2), last=True)
        transfers.submit(2, (3, 4), last=True)
    finally:
        transfers.close()  # stops the worker after the queued chunks
    assert failures == [(1, "chunk 0: the room was closed")]
    sent = [frames for _, frames in rig.sender.take() if frames[0] == StagingReq.WIRE_TYPE]
    assert sent == []
    assert 1 not in writer._room_targets
    assert transfers.status(1) == (KVPoll.Failed, "unknown room")
    assert transfers.status(2) == (KVPoll.Success, None)
    assert len(rig.engine.writes) == 1
    assert rig.watches() == {"tcp://decode:0": 1}  # room 2's, until it is closed
    transfers.close_room(2)
    assert rig.watches() == {}


def test_a_chunk_queued_before_its_room_was_closed_is_not_the_reopened_room_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Room 1's chunk waits for its region; room 1 is closed and its id opened again before
    the worker drops that chunk. The stale chunk is dropped: only the new room's chunk is
    written, and the new room succeeds on its own chunk (the stale pages were written as the
    new room's chunk 0, and the room counted done one chunk early)."""
    clock = Clock()
    monkeypatch.setattr(writer_module, "time", types.SimpleNamespace(monotonic=clock))
    rig = make_rig(clock, timeouts=PrefillTimeouts(answer_s=TICK, ready_s=TICK, deadline_s=1.0))
    host = FakeHost(rig.geometry.kv_args(1, 0))
    transfers = PrefillTransfers(host, rig.writer, meta_timeout_s=60.0)
    writer = rig.writer
    real_ready = writer.chunk_ready
    reopened = threading.Event()

    def meta() -> None:
        host.handlers[RoomMeta.KIND](RoomMeta(1, 0, 2, 2).to_frames())

    def chunk_ready(room: int, chunk_idx: int, decode: Sequence[DecodeTarget]) -> bool:
        ready = real_ready(room, chunk_idx, decode)
        if not reopened.is_set():  # on the worker, while the stale chunk waits
            transfers.close_room(1)
            transfers.open_room(1, 2, rig.targets)
            meta()
            rig.answer(1, 0, 0, 1024)
            reopened.set()
        return ready

    try:
        transfers.open_room(1, 2, rig.targets)
        meta()
        monkeypatch.setattr(writer, "chunk_ready", chunk_ready)
        transfers.submit(1, (1, 2), last=True)  # no region yet: it waits
        assert reopened.wait(30.0)  # bounded: the worker looks at the chunk within a slice
        transfers.submit(1, (3, 4), last=True)  # the reopened room's own chunk
    finally:
        transfers.close()
    assert transfers.status(1) == (KVPoll.Success, None)
    assert len(rig.engine.writes) == 1
    assert rig.engine.payloads == [expected_gather(rig, (3, 4), 0, 2)]
