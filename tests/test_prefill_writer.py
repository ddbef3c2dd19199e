"""StagingWriter in isolation: a recording sender, a fake engine, and books on a fake clock.

The writer's waits read ``time.monotonic`` of its module; the tests replace it with a fake
clock that the fake books advance by each wait's slice, so deadlines and re-request cadences
are exact and no test sleeps.
"""

from __future__ import annotations

import ctypes
import logging
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import pytest
import torch

from staging_contracts._control.integrity import ArrivalKeys, ChunkIdentity, chunk_digest
from staging_contracts._control.liveness import PeerLiveness
from staging_contracts._control.room_messages import RoomFence, RoomFenced
from staging_contracts._control.transport import PeerSockets
from staging_contracts._control.wire import (
    ChunkReady,
    StagingReq,
    StagingRsp,
    WatermarkUpdate,
    decode_message,
)
from staging_contracts._prefill import writer as writer_module
from staging_contracts._prefill.books import RegionAnswerTable, WatermarkTracker
from staging_contracts._prefill.writer import (
    WAIT_SLICE_S,
    ArrivalMode,
    ChunkSpec,
    DecodeTarget,
    PrefillTimeouts,
    StagingFailed,
    StagingWriter,
)
from staging_contracts._staging.layout import (
    compute_head_slice_params,
    compute_staging_layout,
    writer_index,
)
from staging_contracts._staging.ordering import HostOrdering
from staging_contracts.outcomes import FailureReason
from staging_contracts.protocols import (
    KVBufferTensors,
    Notification,
    RegionAnswer,
    Transfer,
    TransferError,
    Watermark,
)
from tests.local_cluster import Geometry

PAGE_BYTES = 512
"""Bytes of one page of all heads of Geometry(1, 1, 2): 4 tokens · 2 heads · 16 B · 2 · 2."""
TICK = 0.03125
"""A wait slice that binary floating point adds exactly."""
EXACT = PrefillTimeouts(answer_s=TICK, ready_s=TICK, deadline_s=4 * TICK)
"""Re-request after every slice; give up after four slices."""


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class RecordingSockets(PeerSockets):
    """PeerSockets that record every message instead of sending it."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, list[bytes]]] = []

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool:
        self.sent.append((endpoint, list(frames)))
        return True

    def take(self) -> list[tuple[str, list[bytes]]]:
        """The messages sent since the last call."""
        out, self.sent = self.sent, []
        return out

    def kinds(self) -> list[bytes]:
        return [frames[0] for _, frames in self.sent]


class FakeEngine:
    """A transfer engine that records registrations and writes (and the bytes written)."""

    def __init__(self, *, notifications: bool = False) -> None:
        self.session_id = "prefill-engine"
        self.supports_notifications = notifications
        self.registered: list[tuple[int, int]] = []
        self.deregistered: list[int] = []
        self.writes: list[tuple[str, list[Transfer], bytes | None]] = []
        self.payloads: list[bytes] = []
        self.error: TransferError | None = None
        self.during: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return "FakeEngine()"

    def metadata(self) -> bytes:
        return b""

    def add_peer(self, session_id: str, metadata: bytes) -> None:
        del session_id, metadata

    def register(self, ptr: int, length: int) -> None:
        self.registered.append((ptr, length))

    def deregister(self, ptr: int) -> None:
        self.deregistered.append(ptr)

    def write(self, peer: str, transfers: Sequence[Transfer], notify: bytes | None = None) -> None:
        self.writes.append((peer, list(transfers), notify))
        for transfer in transfers:
            self.payloads.append(ctypes.string_at(transfer.local, transfer.length))
        if self.during is not None:
            self.during()
        if self.error is not None:
            raise self.error

    def poll_notifications(self) -> list[Notification]:
        return []

    def close(self) -> None:
        pass


class FakeRegions(RegionAnswerTable):
    """Region answers whose waits advance the fake clock by their slice instead of blocking."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.waits: list[float] = []
        self.on_wait: Callable[[], object] | None = None

    def wait(
        self, room: int, chunk_idx: int, session_id: str, timeout: float
    ) -> RegionAnswer | None:
        assert len(self.waits) < 1000, "the wait for an answer never ends"
        self.waits.append(timeout)
        answer = self.get(room, chunk_idx, session_id)
        if answer is None:
            self.clock.now += timeout
            if self.on_wait is not None:
                self.on_wait()
            answer = self.get(room, chunk_idx, session_id)
        return answer


class FakeWatermarks(WatermarkTracker):
    """Watermarks whose waits advance the fake clock by their slice instead of blocking."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.waits: list[float] = []
        self.on_wait: Callable[[], object] | None = None

    def wait_ready(self, session_id: str, alloc_round: int, alloc_end: int, timeout: float) -> bool:
        assert len(self.waits) < 1000, "the wait for the watermark never ends"
        self.waits.append(timeout)
        if self.is_ready(session_id, alloc_round, alloc_end):
            return True
        self.clock.now += timeout
        if self.on_wait is not None:
            self.on_wait()
        return self.is_ready(session_id, alloc_round, alloc_end)


@dataclass
class Rig:
    """A writer with its fakes."""

    writer: StagingWriter
    engine: FakeEngine
    sender: RecordingSockets
    regions: FakeRegions
    watermarks: FakeWatermarks
    clock: Clock
    liveness: PeerLiveness
    live_clock: Clock
    geometry: Geometry
    targets: list[DecodeTarget]
    lost: list[tuple[int, str]] = field(default_factory=list)

    def answer(
        self, room: int, chunk: int, offset: int, end: int, rnd: int = 0, d: int = 0
    ) -> None:
        """Record decode rank ``d``'s region for a chunk."""
        self.regions.record(room, chunk, f"decode-{d}", RegionAnswer(offset, rnd, end))

    def watches(self) -> dict[str, int]:
        return dict(self.liveness._watchers)

    def kill(self, endpoint: str) -> None:
        """Declare ``endpoint`` dead in the liveness (it must be watched)."""
        self.live_clock.now += self.liveness.timeout_s + 1
        for other in self.liveness.watched - {endpoint}:
            self.liveness.heard(other)
        self.liveness.tick()
        assert self.liveness.is_dead(endpoint)

    def fence(self, room: int, reason: str, d: int = 0) -> None:
        self.writer.handle_room_fence(RoomFence(room, f"decode-{d}", f"tcp://reply:{d}", reason))


def target(d: int, ring_size: int = 1 << 16) -> DecodeTarget:
    return DecodeTarget(d, f"decode-{d}", f"tcp://decode:{d}", (d + 1) * 1_000_000, ring_size)


def req(room: int, chunk: int, pages: int, d: int = 0, pp: int | None = None) -> list[bytes]:
    return StagingReq(room, chunk, pages, f"decode-{d}", pp).to_frames()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The fake clock the writer module reads as time.monotonic."""
    fake = Clock()
    monkeypatch.setattr(writer_module, "time", types.SimpleNamespace(monotonic=fake))
    return fake


def make_rig(
    clock: Clock,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    heads: int = 2,
    *,
    rank: int = 0,
    max_chunk_pages: int = 4,
    timeouts: PrefillTimeouts | None = EXACT,
    notifications: bool = False,
    pp_rank: int | None = None,
    ring_size: int = 1 << 16,
    stream: torch.cuda.Stream | None = None,
    arrival: ArrivalMode | None = None,
    integrity: bool = False,
    arrival_keys: ArrivalKeys | None = None,
) -> Rig:
    """A writer of the geometry with a random KV pool and its fakes (integrity off unless
    asked: the arrivals then carry the epoch, and a tag only with ``arrival_keys``)."""
    geometry = Geometry(prefill_tp, decode_tp, heads)
    pool = geometry.empty_pool(prefill_tp, rank)
    gen = torch.Generator().manual_seed(rank)
    for buffer in (*pool.k_buffers, *pool.v_buffers):
        raw = torch.randint(-(2**14), 2**14, buffer.shape, generator=gen, dtype=torch.int16)
        buffer.copy_(raw.view(geometry.dtype))
    engine = FakeEngine(notifications=notifications)
    sender = RecordingSockets()
    regions = FakeRegions(clock)
    watermarks = FakeWatermarks(clock)
    live_clock = Clock()
    liveness = PeerLiveness(
        RecordingSockets(), "tcp://prefill:0", interval_s=1.0, timeout_s=5.0, clock=live_clock
    )
    writer = StagingWriter(
        kv_buffers=pool,
        engine=engine,
        sender=sender,
        watermarks=watermarks,
        regions=regions,
        prefill_tp=prefill_tp,
        prefill_rank=rank,
        total_kv_heads=heads,
        max_chunk_pages=max_chunk_pages,
        pp_rank=pp_rank,
        timeouts=timeouts,
        stream=stream,
        liveness=liveness,
        arrival=arrival,
        integrity=integrity,
        arrival_keys=arrival_keys,
    )
    rig = Rig(
        writer,
        engine,
        sender,
        regions,
        watermarks,
        clock,
        liveness,
        live_clock,
        geometry,
        [target(d, ring_size) for d in range(decode_tp)],
    )
    writer.on_room_lost(lambda room, reason: rig.lost.append((room, reason)))
    return rig


@pytest.fixture
def r(clock: Clock) -> Rig:
    """A 1→1 writer of two heads, chunks of up to four pages."""
    return make_rig(clock)


def expected_gather(r: Rig, pages: Sequence[int], head_start: int, num_heads: int) -> bytes:
    """The staging bytes of heads ``[head_start, +num_heads)`` of ``pages`` (K then V, per
    layer), built from the pool directly."""
    pool = r.writer._kv
    ps = pool.page_size
    rows = torch.tensor([p * ps + t for p in pages for t in range(ps)])
    parts = [
        buffer[rows][:, head_start : head_start + num_heads].contiguous().view(torch.uint8)
        for buffer in (*pool.k_buffers, *pool.v_buffers)
    ]
    return bytes(torch.cat([part.flatten() for part in parts]).tolist())


# --------------------------------------------------------------------------- construction


def test_defaults_and_the_failure_type() -> None:
    """PrefillTimeouts' defaults, the wait slice, and StagingFailed's fields and message."""
    assert PrefillTimeouts() == PrefillTimeouts(0.5, 0.5, 30.0)
    assert WAIT_SLICE_S == 0.05
    failure = StagingFailed(7, "why")
    assert (failure.room, failure.reason, str(failure)) == (7, "why", "room 7: why")
    assert isinstance(failure, RuntimeError)


def test_the_staging_buffer_is_sized_zeroed_and_registered(r: Rig) -> None:
    """max_chunk_pages pages of every local head, K and V of every layer; registered once."""
    assert r.writer.buffer_bytes == 4 * PAGE_BYTES
    assert r.engine.registered == [(r.writer._buffer_ptr, 4 * PAGE_BYTES)]
    assert r.writer._buffer_ptr == r.writer._buffer.data_ptr()
    assert r.writer._buffer.numel() == 4 * PAGE_BYTES
    assert r.writer._buffer.dtype == torch.uint8
    assert not bool(r.writer._buffer.any())
    assert (r.writer.requests_sent, r.writer.bytes_written) == (0, 0)
    assert r.writer.timeouts is EXACT


def test_default_timeouts_are_used_when_none_given(clock: Clock) -> None:
    """timeouts=None means PrefillTimeouts()."""
    assert make_rig(clock, timeouts=None).writer.timeouts == PrefillTimeouts()


@pytest.mark.parametrize("pages", [0, -1])
def test_a_staging_buffer_of_no_page_is_refused(clock: Clock, pages: int) -> None:
    """max_chunk_pages must be at least one."""
    with pytest.raises(ValueError, match=rf"^max_chunk_pages={pages} must be >= 1$"):
        make_rig(clock, max_chunk_pages=pages)


def test_one_page_buffer_is_enough_for_one_page_chunks(clock: Clock) -> None:
    """max_chunk_pages=1 sizes the buffer for one page and writes one-page chunks."""
    rig = make_rig(clock, max_chunk_pages=1)
    assert rig.writer.buffer_bytes == PAGE_BYTES
    rig.answer(1, 0, 0, PAGE_BYTES)
    assert rig.writer.send_chunk(1, ChunkSpec(0, 0, (5,)), rig.targets) == PAGE_BYTES


# --------------------------------------------------------------------------- requests


def test_targets_of_picks_the_decode_ranks_fed(clock: Clock) -> None:
    """A prefill rank writes to the decode ranks of its slice of heads."""
    rig = make_rig(clock, 1, 2, 4)
    assert rig.writer.targets_of(rig.targets) == rig.targets
    rig = make_rig(clock, 2, 1, 4, rank=1)
    assert rig.writer.targets_of(rig.targets) == rig.targets
    four = [target(d) for d in range(4)]
    rig = make_rig(clock, 2, 4, 4, rank=1)
    assert rig.writer.targets_of(four) == four[2:]


def test_prefetch_sends_one_request_per_chunk_and_rank_once(clock: Clock) -> None:
    """prefetch asks every decode rank fed for every chunk, skipping those already asked."""
    rig = make_rig(clock, 1, 2, 4, pp_rank=3)
    sent = rig.writer.prefetch(5, [(0, 2), (1, 1)], rig.targets)
    assert sent == 4
    assert rig.writer.requests_sent == 4
    assert rig.sender.take() == [
        ("tcp://decode:0", req(5, 0, 2, 0, 3)),
        ("tcp://decode:1", req(5, 0, 2, 1, 3)),
        ("tcp://decode:0", req(5, 1, 1, 0, 3)),
        ("tcp://decode:1", req(5, 1, 1, 1, 3)),
    ]
    assert rig.writer.prefetch(5, [(1, 1), (2, 2)], rig.targets) == 2
    assert rig.writer.requests_sent == 6
    assert rig.sender.take() == [
        ("tcp://decode:0", req(5, 2, 2, 0, 3)),
        ("tcp://decode:1", req(5, 2, 2, 1, 3)),
    ]
    assert rig.watches() == {"tcp://decode:0": 1, "tcp://decode:1": 1}


def test_prefetch_of_another_room_is_not_deduplicated_against_the_first(r: Rig) -> None:
    """The same chunk of two rooms is two requests."""
    assert r.writer.prefetch(1, [(0, 2)], r.targets) == 1
    assert r.writer.prefetch(2, [(0, 2)], r.targets) == 1
    assert r.sender.take() == [("tcp://decode:0", req(1, 0, 2)), ("tcp://decode:0", req(2, 0, 2))]


def test_prefetch_skips_a_decode_rank_that_fenced_the_room(clock: Clock) -> None:
    """A fenced (room, session) is never asked again, nor watched for that room."""
    rig = make_rig(clock, 1, 2, 4)
    rig.fence(5, "gone", d=1)
    rig.sender.take()
    assert rig.writer.prefetch(5, [(0, 2)], rig.targets) == 1
    assert rig.sender.take() == [("tcp://decode:0", req(5, 0, 2))]
    assert rig.watches() == {"tcp://decode:0": 1}


def test_forget_room_clears_requests_answers_fences_and_watches(r: Rig) -> None:
    """After forget_room its answers and fences are gone; opened again (track_room), the
    room can be asked again."""
    r.writer.prefetch(1, [(0, 2)], r.targets)
    r.writer.prefetch(2, [(0, 2)], r.targets)
    r.answer(1, 0, 0, 1024)
    r.answer(2, 0, 0, 1024)
    r.fence(1, "x")
    r.sender.take()
    r.writer.forget_room(1)
    assert not r.writer.fenced(1, "decode-0")
    assert r.regions.get(1, 0, "decode-0") is None
    assert r.regions.get(2, 0, "decode-0") == RegionAnswer(0, 0, 1024)
    assert r.watches() == {"tcp://decode:0": 1}
    r.writer.track_room(1, r.targets)
    assert r.writer.prefetch(1, [(0, 2)], r.targets) == 1
    assert r.writer.prefetch(2, [(0, 2)], r.targets) == 0
    r.writer.forget_room(1)
    r.writer.forget_room(2)
    assert r.watches() == {}


def test_forget_room_keeps_the_fence_of_a_write_in_flight_until_it_returns(r: Rig) -> None:
    """A fence that arrives while the room's write runs survives forget_room while the write
    runs, and is dropped when it returns (it was kept for good, so the room id, used again,
    was refused)."""
    r.answer(1, 0, 0, 1024)
    seen: list[bool] = []

    def during() -> None:
        r.fence(1, "late")
        r.writer.forget_room(1)
        seen.append(r.writer.fenced(1, "decode-0"))

    r.engine.during = during
    r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert seen == [True]
    assert not r.writer.fenced(1, "decode-0")
    r.engine.during = None
    r.writer.track_room(1, r.targets)
    r.answer(1, 0, 2048, 3072)
    assert r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets) == 1024
    assert r.engine.writes[-1][1][0].remote == r.targets[0].ring_base + 2048


# --------------------------------------------------------------------------- closed rooms


def test_a_fenced_then_closed_room_fails_at_once_and_is_not_tracked_again(r: Rig) -> None:
    """The soak's case: decode fenced the room (chunk_ready), then the room was closed
    (forget_room drops the fence and the answers) before send_chunk ran. The chunk fails at
    once, naming the close; nothing is asked again and the room is not tracked or watched
    again (it was re-requested every answer_s until the deadline, and tracked again)."""
    r.writer.prefetch(1, [(0, 2)], r.targets)
    r.answer(1, 0, 0, 1024)
    r.fence(1, "aborted")
    assert r.writer.chunk_ready(1, 0, r.targets)
    r.writer.forget_room(1)
    r.sender.take()
    with pytest.raises(StagingFailed, match=r"^room 1: chunk 0: the room was closed$") as info:
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert info.value.reason == "chunk 0: the room was closed"
    assert r.regions.waits == []
    assert r.sender.take() == []
    assert r.writer.requests_sent == 1
    assert r.engine.writes == []
    assert 1 not in r.writer._room_targets
    assert r.writer._requested == set()
    assert r.watches() == {}
    assert r.writer.chunk_ready(1, 0, r.targets)  # it must fail now, not wait


def test_a_room_closed_during_the_answer_wait_fails_within_a_slice(r: Rig) -> None:
    """Closed while its chunk waits for STAGING_RSP: the wait ends after the slice it was in,
    with no re-request (it went on re-requesting every answer_s until the deadline)."""
    r.regions.on_wait = lambda: r.writer.forget_room(1)
    with pytest.raises(StagingFailed, match=r"^room 1: chunk 0: the room was closed$"):
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert r.regions.waits == [TICK]
    assert r.writer.requests_sent == 1  # the prefetch only
    assert r.sender.take() == [("tcp://decode:0", req(1, 0, 2))]
    assert 1 not in r.writer._room_targets
    assert r.watches() == {}


def test_a_room_closed_during_the_ready_wait_fails_within_a_slice(r: Rig) -> None:
    """Closed while its region waits for the watermark: the wait ends after that slice, with
    no re-request and no write."""
    r.answer(1, 0, 0, 1024, rnd=2)
    r.watermarks.on_wait = lambda: r.writer.forget_room(1)
    with pytest.raises(StagingFailed, match=r"^room 1: chunk 0: the room was closed$"):
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert r.watermarks.waits == [TICK]
    assert r.writer.requests_sent == 1
    assert r.engine.writes == []


def test_a_prefetch_after_the_close_sends_and_tracks_nothing(r: Rig) -> None:
    """A late prefetch (or re-request) of a closed room asks nothing and watches nothing."""
    r.writer.forget_room(1)
    assert r.writer.prefetch(1, [(0, 2), (1, 2)], r.targets) == 0
    r.writer.rerequest(1, 0, 2, r.targets)
    assert r.sender.take() == []
    assert r.writer._requested == set()
    assert 1 not in r.writer._room_targets
    assert r.watches() == {}
    assert r.writer.prefetch(2, [(0, 2)], r.targets) == 1  # other rooms are asked as before


def test_a_close_during_a_prefetch_stops_it(r: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closed while its prefetch sends: the rest is not asked for nor remembered as asked."""
    send = r.sender.send

    def send_then_close(endpoint: str, frames: Sequence[bytes]) -> bool:
        r.writer.forget_room(1)
        return send(endpoint, frames)

    monkeypatch.setattr(r.sender, "send", send_then_close)
    assert r.writer.prefetch(1, [(0, 2), (1, 2)], r.targets) == 1
    assert r.sender.take() == [("tcp://decode:0", req(1, 0, 2))]
    assert r.writer._requested == set()
    assert 1 not in r.writer._room_targets
    assert r.watches() == {}


def test_track_room_opens_a_closed_room_again(r: Rig) -> None:
    """A room id used again: track_room opens it (watched, asked, written); track_room of a
    room never closed just tracks it."""
    r.writer.track_room(2, r.targets)
    assert r.writer._room_targets == {2: {"decode-0": r.targets[0]}}
    r.writer.forget_room(2)
    r.writer.forget_room(1)
    r.writer.track_room(1, r.targets)
    assert r.watches() == {"tcp://decode:0": 1}
    assert not r.writer.chunk_ready(1, 0, r.targets)  # waits for its region again
    r.answer(1, 0, 0, 1024)
    assert r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets) == 1024
    assert r.writer.requests_sent == 1
    assert len(r.engine.writes) == 1
    assert r.writer.prefetch(2, [(0, 2)], r.targets) == 0  # still closed


def test_forgotten_rooms_are_bounded_and_the_oldest_goes_first(
    r: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the last FORGOTTEN_ROOMS closes are remembered; closing a room again makes it the
    most recent; a room forgotten longer ago is treated as never seen."""
    monkeypatch.setattr(writer_module, "FORGOTTEN_ROOMS", 2)
    for room in (1, 2, 1, 3):
        r.writer.forget_room(room)
    assert list(r.writer._forgotten) == [1, 3]
    assert r.writer.prefetch(1, [(0, 2)], r.targets) == 0
    assert r.writer.prefetch(3, [(0, 2)], r.targets) == 0
    assert r.writer.prefetch(2, [(0, 2)], r.targets) == 1


# --------------------------------------------------------------------------- fences


def test_a_fence_is_answered_at_once_and_reported_once(r: Rig) -> None:
    """ROOM_FENCE with no write in flight: ROOM_FENCED right away; listeners told once."""
    r.fence(3, "aborted")
    answer = RoomFenced(3, "decode-0", 0).to_frames()
    assert r.sender.take() == [("tcp://reply:0", answer)]
    assert r.writer.fenced(3, "decode-0")
    assert not r.writer.fenced(3, "decode-1")
    assert not r.writer.fenced(4, "decode-0")
    assert r.lost == [(3, "decode fenced the room: aborted")]
    r.fence(3, "again")
    assert r.sender.take() == [("tcp://reply:0", answer)]
    assert r.lost == [(3, "decode fenced the room: aborted")]


def test_the_fence_answer_carries_this_rank(clock: Clock) -> None:
    """ROOM_FENCED names the writer's prefill rank."""
    rig = make_rig(clock, 2, 1, 4, rank=1)
    rig.fence(3, "x")
    assert rig.sender.take() == [("tcp://reply:0", RoomFenced(3, "decode-0", 1).to_frames())]


def test_a_fence_during_the_write_is_answered_when_it_returns(r: Rig) -> None:
    """ROOM_FENCE for the room being written: answered only after the write, before
    CHUNK_READY; a fence of another room is answered at once."""
    r.answer(1, 0, 0, 1024)
    seen: list[list[bytes]] = []

    def during() -> None:
        r.fence(1, "x")
        r.fence(1, "y")
        r.fence(2, "z")
        seen.extend(frames[0:2] for _, frames in r.sender.take())

    r.engine.during = during
    assert r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets) == 1024
    assert seen == [[StagingReq.WIRE_TYPE, b"1"], [RoomFenced.KIND, b"2"]]
    fenced = RoomFenced(1, "decode-0", 0).to_frames()
    ready = ChunkReady(1, 0, 0, 2, "decode-0", 0, 0).to_frames()
    assert r.sender.take() == [
        ("tcp://reply:0", fenced),
        ("tcp://reply:0", fenced),
        ("tcp://decode:0", ready),
    ]
    assert r.writer._in_flight is None
    assert r.writer._fence_acks == {}


def test_a_failed_write_still_answers_the_fence(r: Rig) -> None:
    """An engine error after a fence arrived still sends ROOM_FENCED, then fails the chunk."""
    r.answer(1, 0, 0, 1024)
    r.engine.during = lambda: r.fence(1, "x")
    r.engine.error = TransferError("link down")
    with pytest.raises(StagingFailed, match=r"^room 1: chunk 0: engine write failed: link down$"):
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert r.sender.take() == [
        ("tcp://decode:0", req(1, 0, 2)),
        ("tcp://reply:0", RoomFenced(1, "decode-0", 0).to_frames()),
    ]
    assert r.writer._in_flight is None


def test_an_engine_error_fails_the_chunk_with_its_cause(r: Rig) -> None:
    """TransferError becomes StagingFailed (chained); nothing is counted as written."""
    r.answer(1, 0, 0, 1024)
    error = TransferError("peer gone")
    r.engine.error = error
    with pytest.raises(StagingFailed, match=r"^room 1: chunk 0: engine write failed") as info:
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert info.value.__cause__ is error
    assert info.value.reason == "chunk 0: engine write failed: peer gone"
    assert info.value.kind is FailureReason.ENGINE_ERROR


def test_an_engine_error_is_typed_whatever_the_engine_says(r: Rig) -> None:
    """An engine that reports its failure as a timeout is still an engine error (the label
    is set where the write failed, not read from the engine's words)."""
    r.answer(1, 0, 0, 1024)
    r.engine.error = TransferError("transfer timed out")
    with pytest.raises(StagingFailed) as info:
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert info.value.kind is FailureReason.ENGINE_ERROR
    assert r.writer.bytes_written == 0
    assert r.sender.kinds() == [StagingReq.WIRE_TYPE]


def test_a_fence_after_the_gather_stops_the_write(r: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fence that lands between the gather and the write: no write, the chunk fails."""
    r.answer(1, 0, 0, 1024)
    gather = r.writer._pools.gather

    def gather_then_fence(*args: object, **kwargs: object) -> int:
        result = gather(*args, **kwargs)  # type: ignore[arg-type]
        r.fence(1, "late")
        return result

    monkeypatch.setattr(r.writer._pools, "gather", gather_then_fence)
    with pytest.raises(
        StagingFailed, match=r"^room 1: chunk 0: decode fenced the room: late$"
    ) as info:
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert info.value.reason == "chunk 0: decode fenced the room: late"
    assert r.engine.writes == []
    assert r.writer._in_flight is None


def test_a_fenced_room_fails_before_any_wait(r: Rig) -> None:
    """send_chunk of a fenced room fails at once with the fence's reason."""
    r.fence(1, "aborted")
    with pytest.raises(StagingFailed, match=r"^room 1: chunk 2: decode fenced the room: aborted$"):
        r.writer.send_chunk(1, ChunkSpec(2, 0, (1, 2)), r.targets)
    assert r.regions.waits == []
    assert r.engine.writes == []


def test_room_lost_listeners_all_run_even_if_one_raises(r: Rig) -> None:
    """A failing room-lost listener does not stop the next one."""
    calls: list[int] = []

    def broken(room: int, reason: str) -> None:
        raise RuntimeError("bug")

    r.writer._room_lost.insert(0, broken)
    r.writer.on_room_lost(lambda room, reason: calls.append(room))
    r.fence(4, "x")
    assert r.lost == [(4, "decode fenced the room: x")]
    assert calls == [4]


def test_peer_dead_tells_every_room_requested_from_it(clock: Clock) -> None:
    """A dead decode endpoint loses every room requested from it, and only those."""
    rig = make_rig(clock, 1, 2, 4)
    rig.writer.prefetch(1, [(0, 2)], rig.targets)
    rig.writer.prefetch(2, [(0, 2)], rig.targets[:1] * 2)  # only decode 0's endpoint
    rig.writer.peer_dead("tcp://decode:1")
    assert rig.lost == [(1, "decode rank at tcp://decode:1 is dead")]
    rig.writer.peer_dead("tcp://decode:9")
    assert len(rig.lost) == 1


def test_a_dead_decode_rank_fails_the_chunk(r: Rig) -> None:
    """A decode rank declared dead by liveness: the chunk fails naming it."""
    r.writer.prefetch(1, [(0, 2)], r.targets)
    r.kill("tcp://decode:0")
    with pytest.raises(
        StagingFailed, match=r"^room 1: chunk 0: decode rank 0 at tcp://decode:0 is dead$"
    ):
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert r.writer.chunk_ready(1, 0, r.targets)


# --------------------------------------------------------------------------- chunk_ready


def test_chunk_ready_needs_an_answer_and_the_watermark(r: Rig) -> None:
    """Not ready without an answer, nor while the watermark lags; ready once it passed."""
    assert not r.writer.chunk_ready(1, 0, r.targets)
    r.answer(1, 0, 0, 1024, rnd=1)
    assert not r.writer.chunk_ready(1, 0, r.targets)
    r.watermarks.observe("decode-0", Watermark(0, 1024))
    assert r.writer.chunk_ready(1, 0, r.targets)


def test_chunk_ready_when_a_rank_refused_or_fenced(clock: Clock) -> None:
    """A refusal or a fence makes the chunk 'ready' (send_chunk then fails at once)."""
    rig = make_rig(clock, 1, 2, 4)
    rig.answer(1, 0, 0, 1024, d=1)
    assert not rig.writer.chunk_ready(1, 0, rig.targets)
    rig.answer(1, 0, -2, -1, d=0)
    assert rig.writer.chunk_ready(1, 0, rig.targets)
    rig.answer(2, 0, 0, 1024, rnd=5, d=1)
    rig.fence(2, "x", d=0)
    assert rig.writer.chunk_ready(2, 0, rig.targets)


def test_chunk_ready_checks_every_rank_fed(clock: Clock) -> None:
    """One rank ready and another not is not ready."""
    rig = make_rig(clock, 1, 2, 4)
    rig.answer(1, 0, 0, 1024, d=0)
    assert not rig.writer.chunk_ready(1, 0, rig.targets)
    rig.answer(1, 0, 0, 1024, rnd=1, d=1)
    assert not rig.writer.chunk_ready(1, 0, rig.targets)
    rig.watermarks.observe("decode-1", Watermark(1, 0))
    assert rig.writer.chunk_ready(1, 0, rig.targets)


def test_markers_report_answers_and_watermarks_per_rank(clock: Clock) -> None:
    """answers_marker and ring_marker list each rank fed, in order."""
    rig = make_rig(clock, 1, 2, 4)
    assert rig.writer.answers_marker(1, 0, rig.targets) == (None, None)
    assert rig.writer.ring_marker(rig.targets) == (Watermark(0, 0), Watermark(0, 0))
    rig.answer(1, 0, 0, 1024, d=1)
    rig.watermarks.observe("decode-0", Watermark(2, 64))
    assert rig.writer.answers_marker(1, 0, rig.targets) == (None, RegionAnswer(0, 0, 1024))
    assert rig.writer.ring_marker(rig.targets) == (Watermark(2, 64), Watermark(0, 0))
    assert rig.writer.answers_marker(1, 1, rig.targets) == (None, None)


def test_rerequest_asks_only_ranks_not_yet_writable(clock: Clock) -> None:
    """rerequest skips ranks that made the chunk writable or fenced the room."""
    rig = make_rig(clock, 1, 2, 4, pp_rank=0)
    rig.writer.rerequest(1, 0, 2, rig.targets)
    assert rig.sender.take() == [
        ("tcp://decode:0", req(1, 0, 2, 0, 0)),
        ("tcp://decode:1", req(1, 0, 2, 1, 0)),
    ]
    rig.answer(1, 0, 0, 1024, d=0)
    rig.answer(1, 0, 0, 1024, rnd=1, d=1)
    rig.writer.rerequest(1, 0, 2, rig.targets)
    assert rig.sender.take() == [("tcp://decode:1", req(1, 0, 2, 1, 0))]
    rig.fence(1, "x", d=1)
    rig.sender.take()
    rig.writer.rerequest(1, 0, 2, rig.targets)
    assert rig.sender.take() == []
    assert rig.writer.requests_sent == 3


# --------------------------------------------------------------------------- send_chunk


def test_send_chunk_writes_the_gathered_heads_and_signals_arrival(r: Rig) -> None:
    """One write of the gathered bytes at ring base + region offset, then CHUNK_READY."""
    r.answer(1, 3, 2048, 3072)
    written = r.writer.send_chunk(1, ChunkSpec(3, 6, (7, 2)), r.targets)
    assert written == 1024
    assert r.writer.bytes_written == 1024
    ((peer, transfers, notify),) = r.engine.writes
    assert (peer, notify) == ("decode-0", None)
    assert transfers == [Transfer(r.writer._buffer_ptr, 1_000_000 + 2048, 1024)]
    assert r.engine.payloads == [expected_gather(r, (7, 2), 0, 2)]
    assert r.sender.take() == [
        ("tcp://decode:0", req(1, 3, 2)),
        ("tcp://decode:0", ChunkReady(1, 3, 6, 2, "decode-0", 0, 0).to_frames()),
    ]
    assert r.writer.requests_sent == 1
    r.answer(1, 4, 0, 512)
    assert r.writer.send_chunk(1, ChunkSpec(4, 8, (9,)), r.targets) == 512
    assert r.writer.bytes_written == 1536


def test_the_arrival_carries_the_digest_of_the_written_bytes_and_the_region_epoch(
    clock: Clock,
) -> None:
    """Integrity on: the tag's digest is that of exactly the bytes written, bound to the
    chunk's identity and the epoch (round) of the region decode answered; no MAC without
    keys."""
    rig = make_rig(clock, integrity=True)
    rig.answer(1, 3, 2048, 3072, rnd=5)
    rig.watermarks.observe("decode-0", Watermark(5, 0))
    rig.writer.send_chunk(1, ChunkSpec(3, 6, (7, 2)), rig.targets)
    (payload,) = rig.engine.payloads
    identity = ChunkIdentity(1, 3, 6, 2, "decode-0", 0, 5)
    sent = rig.sender.sent[-1][1]
    assert decode_message(sent) == ChunkReady(
        1, 3, 6, 2, "decode-0", 0, 5, chunk_digest(identity, payload)
    )
    other = ChunkIdentity(1, 3, 6, 2, "decode-0", 0, 4)
    assert chunk_digest(other, payload) != chunk_digest(identity, payload)


def test_with_keys_every_arrival_carries_a_mac_for_its_decode_session(clock: Clock) -> None:
    """With the secret's keys the tag ends with a MAC that the decode session's key checks;
    with integrity off the digest is '-' and the MAC still there."""
    keys = ArrivalKeys(b"a secret of at least sixteen bytes")
    for integrity in (True, False):
        rig = make_rig(clock, integrity=integrity, arrival_keys=keys)
        rig.answer(1, 0, 0, 1024, rnd=2)
        rig.watermarks.observe("decode-0", Watermark(2, 0))
        rig.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), rig.targets)
        arrival = decode_message(rig.sender.sent[-1][1])
        assert isinstance(arrival, ChunkReady)
        assert arrival.tag is not None
        digest, _, mac = arrival.tag.partition(":")
        assert (digest == "-") is not integrity
        assert len(mac) == 32
        identity = ChunkIdentity(1, 0, 0, 2, "decode-0", 0, 2)
        assert keys.authentic(identity, arrival.tag)
        assert not keys.authentic(identity._replace(epoch=3), arrival.tag)
        assert not ArrivalKeys(b"another secret of sixteen bytes").authentic(identity, arrival.tag)


def test_with_notifications_the_arrival_rides_on_the_write(clock: Clock) -> None:
    """An engine with notifications gets the CHUNK_READY payload; no frames are sent."""
    rig = make_rig(clock, notifications=True)
    rig.answer(1, 0, 0, 1024)
    rig.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), rig.targets)
    ((_, _, notify),) = rig.engine.writes
    assert notify == ChunkReady(1, 0, 0, 2, "decode-0", 0, 0).to_notification()
    assert rig.sender.kinds() == [StagingReq.WIRE_TYPE]


def test_each_decode_rank_gets_its_own_heads(clock: Clock) -> None:
    """1→2: decode rank 1 gets heads [2, 4) of the prefill rank, at its own ring."""
    rig = make_rig(clock, 1, 2, 4)
    rig.answer(1, 0, 0, 1024, d=0)
    rig.answer(1, 0, 4096, 5120, d=1)
    assert rig.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), rig.targets) == 2048
    assert [w[0] for w in rig.engine.writes] == ["decode-0", "decode-1"]
    assert rig.engine.writes[1][1] == [Transfer(rig.writer._buffer_ptr, 2_000_000 + 4096, 1024)]
    for d, payload in enumerate(rig.engine.payloads):
        head = compute_head_slice_params(1, 2, 0, d, 4)
        assert payload == expected_gather(rig, (1, 2), head.src_head_start, head.num_heads)


def test_a_second_writer_writes_after_the_first_in_the_region(clock: Clock) -> None:
    """2→1: prefill rank 1's bytes go after rank 0's in the shared region."""
    rig = make_rig(clock, 2, 1, 4, rank=1)
    rig.answer(1, 0, 4096, 6144)
    assert rig.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), rig.targets) == 1024
    layout = compute_staging_layout(2, 1, 0, 4, 8, 16, 2)
    offset = layout.writer_offsets[writer_index(2, 1, 1)]
    assert offset == 1024
    ((_, transfers, _),) = rig.engine.writes
    assert transfers == [Transfer(rig.writer._buffer_ptr, 1_000_000 + 4096 + offset, 1024)]
    assert rig.sender.sent[-1] == (
        "tcp://decode:0",
        ChunkReady(1, 0, 0, 2, "decode-0", 1, 0).to_frames(),
    )


def test_send_chunk_after_close_fails(r: Rig) -> None:
    """A closed writer refuses every chunk; close deregisters its buffer once."""
    r.writer.close()
    r.writer.close()
    assert r.engine.deregistered == [r.writer._buffer_ptr]
    with pytest.raises(StagingFailed, match=r"^room 1: the staging writer is closed$"):
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1,)), r.targets)
    assert r.sender.sent == []


def test_a_chunk_over_the_buffer_fails_before_asking(r: Rig) -> None:
    """More pages than max_chunk_pages fail the chunk; exactly max_chunk_pages is fine."""
    with pytest.raises(
        StagingFailed, match=r"^room 1: chunk 0 of 5 pages exceeds max_chunk_pages=4$"
    ):
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2, 3, 4, 5)), r.targets)
    assert r.writer.requests_sent == 0
    r.answer(1, 0, 0, 2048)
    assert r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2, 3, 4)), r.targets) == 2048


def test_an_unsupported_tp_pair_fails_before_asking(r: Rig) -> None:
    """A decode TP size that cannot split the heads raises ValueError, sends nothing."""
    with pytest.raises(ValueError, match=r"must divide one another$"):
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1,)), [target(d) for d in range(3)])
    assert r.sender.sent == []


@pytest.mark.parametrize(
    ("offset", "end", "ring"), [(0, 1023, 1 << 16), (100, 1123, 1 << 16), (0, 1024, 1023)]
)
def test_a_region_that_does_not_fit_fails_the_chunk(
    clock: Clock, offset: int, end: int, ring: int
) -> None:
    """A region smaller than the layout, or past the ring's end, fails the chunk unwritten."""
    rig = make_rig(clock, ring_size=ring)
    rig.answer(1, 0, offset, end)
    with pytest.raises(
        StagingFailed,
        match=rf"^room 1: chunk 0: decode region \[{offset}, {end}\) does not fit the layout "
        r"of 1024 bytes$",
    ):
        rig.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), rig.targets)
    assert rig.engine.writes == []


def test_a_region_ending_at_the_ring_end_fits(clock: Clock) -> None:
    """A region of exactly the layout's size, ending exactly at the ring's end, is written."""
    rig = make_rig(clock, ring_size=2048)
    rig.answer(1, 0, 1024, 2048)
    assert rig.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), rig.targets) == 1024


def test_a_refused_chunk_fails_with_decode_s_offset(r: Rig) -> None:
    """The -2 answer fails the chunk at once."""
    r.answer(1, 0, -2, -1)
    with pytest.raises(StagingFailed, match=r"^room 1: decode refused chunk 0 \(offset -2\)$"):
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert r.clock.now == 0.0


# --------------------------------------------------------------------------- waits


def test_no_answer_is_asked_again_every_answer_s_until_the_deadline(r: Rig) -> None:
    """Without STAGING_RSP: a re-request every answer_s, failure exactly at the deadline."""
    with pytest.raises(
        StagingFailed, match=r"^room 1: no STAGING_RSP for chunk 0 before the deadline$"
    ):
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert r.clock.now == 4 * TICK
    assert r.regions.waits == [TICK] * 4
    assert r.writer.requests_sent == 4  # the prefetch and one per slice but the last
    assert r.sender.take() == [("tcp://decode:0", req(1, 0, 2))] * 4


def test_the_answer_wait_is_sliced_to_check_fences(clock: Clock) -> None:
    """Waits for an answer last at most WAIT_SLICE_S; answer_s longer than it re-asks later."""
    rig = make_rig(clock, timeouts=PrefillTimeouts(answer_s=0.125, ready_s=1.0, deadline_s=0.25))
    with pytest.raises(StagingFailed, match=r"before the deadline$"):
        rig.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), rig.targets)
    assert rig.regions.waits == [WAIT_SLICE_S] * 5
    assert rig.writer.requests_sent == 2


def test_an_answer_after_a_re_request_is_written(r: Rig) -> None:
    """An answer that comes during the wait ends it; the chunk is written."""
    r.regions.on_wait = lambda: r.answer(1, 0, 0, 1024) if r.clock.now >= 2 * TICK else None
    assert r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets) == 1024
    assert r.writer.requests_sent == 2


def test_a_fence_during_the_answer_wait_ends_it(r: Rig) -> None:
    """A fence that arrives while waiting for the answer fails the chunk at the next slice."""
    r.regions.on_wait = lambda: r.fence(1, "gone")
    with pytest.raises(StagingFailed, match=r"^room 1: chunk 0: decode fenced the room: gone$"):
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert r.regions.waits == [TICK]


def test_a_watermark_that_never_comes_fails_at_the_deadline(r: Rig) -> None:
    """A region of a later round waits for the watermark, re-asks every ready_s, then fails."""
    r.answer(1, 0, 0, 1024, rnd=2)
    with pytest.raises(
        StagingFailed,
        match=r"^room 1: chunk 0: region of round 2 never became writable \(watermark \(0, 0\)\)$",
    ):
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert r.clock.now == 4 * TICK
    assert r.watermarks.waits == [TICK] * 4
    assert r.writer.requests_sent == 4
    assert r.engine.writes == []


def test_the_ready_wait_is_sliced_to_check_fences(clock: Clock) -> None:
    """Waits for the watermark last at most WAIT_SLICE_S; ready_s longer than it re-asks later."""
    rig = make_rig(clock, timeouts=PrefillTimeouts(answer_s=1.0, ready_s=0.125, deadline_s=0.25))
    rig.answer(1, 0, 0, 1024, rnd=2)
    with pytest.raises(StagingFailed, match=r"never became writable"):
        rig.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), rig.targets)
    assert rig.watermarks.waits == [WAIT_SLICE_S] * 5
    assert rig.writer.requests_sent == 2


def test_a_moving_ring_is_not_a_stall(r: Rig) -> None:
    """Each move of the watermark restarts the deadline; the chunk fails only deadline_s
    after the last move."""
    moves = iter([Watermark(0, 1), Watermark(0, 2)])

    def move() -> None:
        if r.clock.now in (3 * TICK, 6 * TICK):
            r.watermarks.observe("decode-0", next(moves))

    r.answer(1, 0, 0, 1024, rnd=2)
    r.watermarks.on_wait = move
    with pytest.raises(StagingFailed, match=r"\(watermark \(0, 2\)\)$"):
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert r.clock.now == 10 * TICK


def test_a_watermark_that_arrives_in_time_lets_the_write_go(r: Rig) -> None:
    """Once the watermark passes the region, the chunk is written."""

    def free() -> None:
        if r.clock.now == 2 * TICK:
            r.watermarks.observe("decode-0", Watermark(1, 1024))

    r.answer(1, 0, 0, 1024, rnd=2)
    r.watermarks.on_wait = free
    assert r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets) == 1024
    assert r.writer.requests_sent == 2


def test_a_fence_during_the_ready_wait_ends_it(r: Rig) -> None:
    """A fence that arrives while waiting for the watermark fails the chunk."""
    r.answer(1, 0, 0, 1024, rnd=2)
    r.watermarks.on_wait = lambda: r.fence(1, "gone")
    with pytest.raises(StagingFailed, match=r"^room 1: chunk 0: decode fenced the room: gone$"):
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert r.watermarks.waits == [TICK]


def test_the_deadline_is_per_decode_rank(clock: Clock) -> None:
    """Each decode rank's wait gets its own deadline."""
    rig = make_rig(clock, 1, 2, 4)
    rig.answer(1, 0, 0, 1024, d=0, rnd=2)

    def free() -> None:
        if rig.clock.now == 3 * TICK:
            rig.watermarks.observe("decode-0", Watermark(2, 0))

    rig.watermarks.on_wait = free
    with pytest.raises(StagingFailed, match=r"^room 1: no STAGING_RSP for chunk 0"):
        rig.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), rig.targets)
    assert rig.clock.now == 7 * TICK
    assert len(rig.engine.writes) == 1


# --------------------------------------------------------------------------- authorisation


def test_decode_messages_only_from_the_session_s_endpoint(clock: Clock) -> None:
    """STAGING_RSP and a WATERMARK naming a session come from that session's endpoint."""
    rig = make_rig(clock, 1, 2, 4)
    rsp0 = StagingRsp(1, 0, 0, 0, 1024, "decode-0").to_frames()
    mark1 = WatermarkUpdate(0, 0, "decode-1").to_frames()
    assert not rig.writer.authorize(rsp0, "tcp://decode:0")  # nothing requested yet
    rig.writer.prefetch(1, [(0, 2)], rig.targets)
    assert rig.writer.authorize(rsp0, "tcp://decode:0")
    assert not rig.writer.authorize(rsp0, "tcp://decode:1")
    assert rig.writer.authorize(mark1, "tcp://decode:1")
    assert not rig.writer.authorize(mark1, "tcp://decode:0")
    assert not rig.writer.authorize(WatermarkUpdate(0, 0, "decode-9").to_frames(), "x")


def test_a_watermark_without_a_session_comes_from_any_decode_rank_asked(r: Rig) -> None:
    """The reference's WATERMARK names no session: any endpoint requested from may send it."""
    frames = WatermarkUpdate(0, 0, "").to_frames()
    assert len(frames) == 3
    assert not r.writer.authorize(frames, "tcp://decode:0")
    r.writer.prefetch(1, [(0, 2)], r.targets)
    assert r.writer.authorize(frames, "tcp://decode:0")
    assert not r.writer.authorize(frames, "tcp://decode:1")
    assert r.writer.authorize([*frames, b""], "tcp://decode:0")
    assert not r.writer.authorize([*frames, b""], "tcp://elsewhere:0")


def test_a_short_staging_rsp_is_judged_as_naming_no_session(r: Rig) -> None:
    """Without its session frame a STAGING_RSP is accepted only from a known decode rank."""
    r.writer.prefetch(1, [(0, 2)], r.targets)
    short = StagingRsp(1, 0, 0, 0, 1024, "decode-0").to_frames()[:6]
    assert r.writer.authorize(short, "tcp://decode:0")
    assert not r.writer.authorize(short, "tcp://elsewhere:0")


def test_a_fence_comes_from_its_session_and_replies_there(r: Rig) -> None:
    """ROOM_FENCE: from the session's endpoint, with that endpoint as its reply address."""
    r.writer.prefetch(1, [(0, 2)], r.targets)
    good = RoomFence(1, "decode-0", "tcp://decode:0", "x").to_frames()
    assert r.writer.authorize(good, "tcp://decode:0")
    assert not r.writer.authorize(good, "tcp://decode:1")
    elsewhere = RoomFence(1, "decode-0", "tcp://elsewhere:0", "x").to_frames()
    assert not r.writer.authorize(elsewhere, "tcp://decode:0")
    assert not r.writer.authorize(good[:3], "tcp://decode:0")
    assert r.writer.authorize(good[:4], "tcp://decode:0")
    assert not r.writer.authorize(
        RoomFence(1, "decode-1", "tcp://decode:0", "x").to_frames(), "tcp://decode:0"
    )


def test_other_messages_are_not_the_writer_s_to_judge(r: Rig) -> None:
    """Kinds the writer does not authorise, and no frames at all, are let through."""
    for frames in ([], [b"PING", b"x"], StagingReq(1, 0, 2, "decode-0").to_frames()):
        assert r.writer.authorize(frames, "tcp://stranger:0")


def test_a_session_frame_that_is_not_ascii_matches_no_session(r: Rig) -> None:
    """A non-ASCII session is read with replacement characters and matches nothing."""
    r.writer.prefetch(1, [(0, 2)], r.targets)
    frames = [*StagingRsp(1, 0, 0, 0, 1024, "decode-0").to_frames()[:6], b"decode-\xff"]
    assert not r.writer.authorize(frames, "tcp://decode:0")


# --------------------------------------------------------------------------- logs and streams


def writer_logs(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    """(level, message) of every record the writer logged."""
    return [
        (record.levelname, record.getMessage())
        for record in caplog.records
        if record.name == writer_module.__name__
    ]


def test_re_requests_are_logged(r: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """Each re-request for a missing answer or a lagging watermark is logged at INFO."""
    caplog.set_level(logging.INFO, logger=writer_module.__name__)
    r.regions.on_wait = lambda: r.answer(1, 2, 0, 1024, rnd=2) if r.clock.now == 2 * TICK else None
    r.watermarks.on_wait = lambda: (
        r.watermarks.observe("decode-0", Watermark(2, 0)) if r.clock.now == 4 * TICK else None
    )
    r.writer.send_chunk(1, ChunkSpec(2, 0, (1, 2)), r.targets)
    assert writer_logs(caplog) == [
        ("INFO", "room 1 chunk 2: no STAGING_RSP yet, asking again"),
        ("INFO", "room 1 chunk 2: waiting for the watermark, asking again"),
    ]


def test_a_failing_room_lost_listener_is_logged(r: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """A room-lost listener's exception is logged with its traceback and the room."""

    def broken(room: int, reason: str) -> None:
        raise RuntimeError("bug")

    r.writer.on_room_lost(broken)
    r.fence(6, "x")
    assert writer_logs(caplog) == [("ERROR", "room 6: a room-lost listener failed")]
    assert caplog.records[0].exc_info is not None


class FakeStream:
    """Stands in for a CUDA stream (never used on CPU: the gather is redirected)."""


class RecordingOrdering(HostOrdering):
    """Host ordering that records when the writer waited for its gather."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.gathers_before_write: list[int] = []

    def gathered(self) -> None:
        self.gathers_before_write.append(len(self.engine.writes))


def test_gathers_run_on_the_writer_s_stream_and_complete_before_each_write(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each gather is enqueued on the writer's stream and waited for before its write."""
    stream = FakeStream()
    rig = make_rig(clock, 1, 2, 4, stream=cast(torch.cuda.Stream, stream))
    ordering = RecordingOrdering(rig.engine)
    rig.writer._ordering = ordering
    gather = rig.writer._pools.gather
    streams: list[object] = []

    def on_cpu(*args: object, stream: object = None, **kwargs: object) -> int:
        streams.append(stream)
        return gather(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(rig.writer._pools, "gather", on_cpu)
    rig.answer(1, 0, 0, 1024, d=0)
    rig.answer(1, 0, 0, 1024, d=1)
    rig.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), rig.targets)
    assert streams == [stream, stream]
    assert ordering.gathers_before_write == [0, 1]


def test_the_ordering_is_the_one_given_or_the_host_s(clock: Clock) -> None:
    """An explicit ordering is kept; on CPU the default is HostOrdering."""
    rig = make_rig(clock)
    assert type(rig.writer._ordering) is HostOrdering
    ordering = RecordingOrdering(rig.engine)
    writer = StagingWriter(
        kv_buffers=rig.writer._kv,
        engine=rig.engine,
        sender=rig.sender,
        watermarks=rig.watermarks,
        regions=rig.regions,
        prefill_tp=1,
        prefill_rank=0,
        total_kv_heads=2,
        max_chunk_pages=1,
        ordering=ordering,
    )
    assert writer._ordering is ordering


# --------------------------------------------------------------------------- progress


def test_progress_listeners_hear_answers_watermark_moves_and_lost_rooms(r: Rig) -> None:
    """on_progress: called after each answer, each forward watermark move and each lost room."""
    calls: list[int] = []
    r.writer.on_progress(lambda: calls.append(len(calls)))
    r.answer(1, 0, 0, 1024)
    assert len(calls) == 1
    r.watermarks.observe("decode-0", Watermark(1, 0))
    r.watermarks.observe("decode-0", Watermark(0, 5))  # backwards: no call
    assert len(calls) == 2
    r.fence(1, "x")
    assert len(calls) == 3
    assert r.lost == [(1, "decode fenced the room: x")]


def test_authorisation_follows_a_session_s_latest_endpoint(r: Rig) -> None:
    """A decode session re-registered at a new endpoint is authorised there from then on."""
    rsp = StagingRsp(2, 0, 0, 0, 1024, "decode-0").to_frames()
    r.writer.prefetch(1, [(0, 2)], r.targets)
    moved = DecodeTarget(0, "decode-0", "tcp://moved:0", 1_000_000, 1 << 16)
    r.writer.prefetch(2, [(0, 2)], [moved])
    assert r.writer.authorize(rsp, "tcp://moved:0")
    assert not r.writer.authorize(rsp, "tcp://decode:0")


# --------------------------------------------------------------------------- arrival modes


def test_the_arrival_mode_follows_the_engine_by_default(clock: Clock) -> None:
    """No arrival given: notifications where the engine has them, ZMQ otherwise."""
    assert make_rig(clock).writer.arrival == "zmq"
    assert make_rig(clock, notifications=True).writer.arrival == "notification"
    assert make_rig(clock, notifications=True, arrival="notification").writer.arrival == (
        "notification"
    )


def test_zmq_arrivals_can_be_chosen_with_a_notifying_engine(clock: Clock) -> None:
    """arrival='zmq': CHUNK_READY goes over ZMQ and the write carries no notification."""
    rig = make_rig(clock, notifications=True, arrival="zmq")
    assert rig.writer.arrival == "zmq"
    rig.answer(1, 0, 0, 1024)
    rig.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), rig.targets)
    assert rig.engine.writes[0][2] is None
    assert rig.sender.sent[-1] == (
        "tcp://decode:0",
        ChunkReady(1, 0, 0, 2, "decode-0", 0, 0).to_frames(),
    )


def test_notification_arrivals_need_an_engine_that_has_them(clock: Clock) -> None:
    """arrival='notification' with an engine without notifications is refused."""
    with pytest.raises(
        ValueError,
        match=r"^arrival='notification' needs an engine with notifications; FakeEngine\(\) "
        r"has none$",
    ):
        make_rig(clock, arrival="notification")


@pytest.mark.parametrize("mode", ["bogus", "ZMQ", "Notification", ""])
def test_an_unknown_arrival_mode_is_refused(clock: Clock, mode: str) -> None:
    """Only 'notification', 'zmq' or None are arrival modes."""
    with pytest.raises(
        ValueError, match=rf"^arrival={mode!r} must be 'notification', 'zmq' or None$"
    ):
        make_rig(clock, notifications=True, arrival=cast(ArrivalMode, mode))


# --------------------------------------------------------------------------- more edges


def meta_pool() -> KVBufferTensors:
    """A pool of Geometry(1, 1, 2) on the meta device (tells a device from the CPU default)."""
    shape = (64 * 4, 2, 8)

    def layers() -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(shape, dtype=torch.bfloat16, device="meta") for _ in range(2))

    return KVBufferTensors(layers(), layers(), 4)


def test_buffer_and_pages_live_on_the_pool_s_device(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staging buffer and each chunk's page indices (int64) are on the pool's device."""
    engine, regions = FakeEngine(), FakeRegions(clock)
    writer = StagingWriter(
        kv_buffers=meta_pool(),
        engine=engine,
        sender=RecordingSockets(),
        watermarks=FakeWatermarks(clock),
        regions=regions,
        prefill_tp=1,
        prefill_rank=0,
        total_kv_heads=2,
        max_chunk_pages=2,
    )
    assert writer._buffer.device.type == "meta"
    pages: list[torch.Tensor] = []

    def record(page_indices: torch.Tensor, *args: object, **kwargs: object) -> int:
        pages.append(page_indices)
        raise TransferError("stop here")

    monkeypatch.setattr(writer._pools, "gather", record)
    regions.record(1, 0, "decode-0", RegionAnswer(0, 0, 1024))
    with pytest.raises(TransferError, match=r"^stop here$"):
        writer.send_chunk(1, ChunkSpec(0, 0, (3, 5)), [target(0)])
    (sent,) = pages
    assert (sent.device.type, sent.dtype, tuple(sent.shape)) == ("meta", torch.int64, (2,))


def test_a_head_count_that_prefill_cannot_split_fails_before_asking(clock: Clock) -> None:
    """send_chunk checks the prefill/decode pair against the model's head count."""
    g = Geometry(2, 1, 3)
    writer = StagingWriter(
        kv_buffers=g.empty_pool(2, 0),
        engine=FakeEngine(),
        sender=RecordingSockets(),
        watermarks=FakeWatermarks(clock),
        regions=FakeRegions(clock),
        prefill_tp=2,
        prefill_rank=0,
        total_kv_heads=3,
        max_chunk_pages=2,
    )
    with pytest.raises(ValueError, match=r"^total_kv_heads=3 and prefill_tp=2 must divide one"):
        writer.send_chunk(1, ChunkSpec(0, 0, (1,)), [target(0)])
    assert writer.requests_sent == 0


def test_prefetch_asks_the_ranks_not_yet_asked_after_one_that_was(clock: Clock) -> None:
    """A chunk already requested from one rank is still requested from the next."""
    rig = make_rig(clock, 1, 2, 4)
    assert rig.writer.prefetch(1, [(0, 2)], rig.targets[:1]) == 1
    assert rig.writer.prefetch(1, [(0, 2)], rig.targets) == 1
    assert rig.sender.take() == [
        ("tcp://decode:0", req(1, 0, 2)),
        ("tcp://decode:1", req(1, 0, 2, 1)),
    ]


def test_rerequest_goes_on_past_a_fenced_rank(clock: Clock) -> None:
    """A fenced first rank does not stop the re-request to the next one."""
    rig = make_rig(clock, 1, 2, 4)
    rig.fence(1, "x", d=0)
    rig.sender.take()
    rig.writer.rerequest(1, 0, 2, rig.targets)
    assert rig.sender.take() == [("tcp://decode:1", req(1, 0, 2, 1))]


def test_rerequest_reads_each_rank_s_own_watermark(clock: Clock) -> None:
    """A region made writable by its own rank's watermark is not asked again."""
    rig = make_rig(clock, 1, 2, 4)
    rig.answer(1, 0, 0, 1024, rnd=1, d=0)
    rig.answer(1, 0, 0, 1024, rnd=1, d=1)
    rig.watermarks.observe("decode-1", Watermark(1, 0))
    rig.writer.rerequest(1, 0, 2, rig.targets)
    assert rig.sender.take() == [("tcp://decode:0", req(1, 0, 2))]


def test_a_watermark_seen_before_the_wait_is_not_a_move(r: Rig) -> None:
    """The watermark at the start of the wait is the reference: no move, no extension."""
    r.watermarks.observe("decode-0", Watermark(0, 5))
    r.answer(1, 0, 0, 1024, rnd=2)
    with pytest.raises(StagingFailed, match=r"\(watermark \(0, 5\)\)$"):
        r.writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), r.targets)
    assert r.clock.now == 4 * TICK


def test_the_default_ordering_is_the_device_s_for_the_writer_s_stream(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an ordering, the writer asks ordering_for(pool device, its stream)."""
    asked: list[tuple[torch.device, object]] = []
    ordering = HostOrdering()

    def ordering_for(device: torch.device, stream: object) -> HostOrdering:
        asked.append((device, stream))
        return ordering

    monkeypatch.setattr(writer_module, "ordering_for", ordering_for)
    stream = FakeStream()
    rig = make_rig(clock, stream=cast(torch.cuda.Stream, stream))
    assert asked == [(torch.device("cpu"), stream)]
    assert rig.writer._ordering is ordering
