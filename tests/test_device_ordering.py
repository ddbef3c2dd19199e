"""Device ordering, checked on CPU with an instrumented ordering that behaves like an
asynchronous device: the engine never reads a staging buffer before its gather completed, and
a ring region is never freed before its scatter completed, on every path (success, failure,
teardown). Each check is also run against a reordered writer or handler, which it must catch.
The CUDA tests (skipped without a device) delay the copies on a stream with ``_sleep``."""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from staging_contracts import ArrivalOutcome
from staging_contracts._control.integrity import INTEGRITY_ENV
from staging_contracts._control.transport import PeerSockets
from staging_contracts._decode.handler import (
    DecodeStagingHandler,
    PrefillPeer,
    RoomPlan,
    RoomStatus,
)
from staging_contracts._prefill.writer import ChunkSpec, StagingWriter
from staging_contracts._staging.allocator import StagingAllocator
from staging_contracts._staging.ordering import CudaOrdering, HostOrdering, ordering_for
from staging_contracts.protocols import KVBufferTensors, RegionAnswer, Transfer
from tests.local_cluster import Geometry, LocalCluster, local_cluster, wait_for

SID = "decode-0"
P0 = "tcp://prefill:0"


@dataclass
class Token:
    """A scatter's completion, released by the test (a stand-in for a CUDA event)."""

    complete: bool = False


@dataclass
class RecordingOrdering:
    """An instrumented ordering (a fake of an asynchronous device, named as such): copies
    complete only when the ordering says so, and every hand-off is logged in order."""

    log: list[str]
    tokens: list[Token] = field(default_factory=list)

    def gathered(self) -> None:
        self.log.append("gathered")

    def scattered(self) -> object | None:
        token = Token()
        self.tokens.append(token)
        self.log.append("scattered")
        return token

    def done(self, token: object) -> bool:
        return isinstance(token, Token) and token.complete

    def wait(self, token: object) -> None:
        if isinstance(token, Token):
            self.log.append("waited")
            self.complete(token)

    def complete(self, token: Token) -> None:
        """The device ran the scatter behind ``token``."""
        if not token.complete:
            token.complete = True
            self.log.append("complete")


def writes_after_gathers(log: list[str]) -> bool:
    """Every engine write comes after a gather that was waited for, and no gather is pending."""
    pending = False
    for entry in log:
        if entry == "gather":
            pending = True
        elif entry == "gathered":
            pending = False
        elif entry == "write" and pending:
            return False
    return "write" in log


def frees_after_scatters(log: list[str]) -> bool:
    """Every free comes when each scatter begun so far has completed, and something was freed.

    ``scatter`` (the kernel was called, whether or not it raised) opens one copy that only
    ``complete`` (the device ran it) closes."""
    pending = 0
    for entry in log:
        if entry == "scatter":
            pending += 1
        elif entry == "complete":
            pending -= 1
        elif entry == "free" and pending:
            return False
    return "free" in log


def _logged(log: list[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: object, **kwargs: object) -> object:
        log.append(name)
        return fn(*args, **kwargs)

    return wrapper


def _raising(log: list[str], name: str) -> Callable[..., Any]:
    def wrapper(*args: object, **kwargs: object) -> object:
        log.append(name)  # as if some of its copies had been enqueued before it raised
        raise RuntimeError(f"{name} failed part-way")

    return wrapper


# --------------------------------------------------------------------------- the checks


def test_the_checks_tell_the_right_order_from_a_wrong_one() -> None:
    """The log checks on their own (the tests below run them on real writers/handlers)."""
    assert writes_after_gathers(["gather", "gathered", "write"])
    assert not writes_after_gathers(["gather", "write"])
    assert not writes_after_gathers(["gathered", "gather", "write"])
    assert not writes_after_gathers(["gather", "gathered"])
    assert frees_after_scatters(["scatter", "scattered", "complete", "free"])
    assert not frees_after_scatters(["scatter", "scattered", "free", "complete"])
    assert not frees_after_scatters(["scatter", "free"])
    assert not frees_after_scatters(["scatter", "scattered", "complete"])


# --------------------------------------------------------------------------- prefill: gather


def _instrumented_writer(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, log: list[str]
) -> RecordingOrdering:
    """Writer 0 of the cluster with its gathers, its ordering and its engine writes logged."""
    writer = cluster.writers[0]
    ordering = RecordingOrdering(log)
    monkeypatch.setattr(writer, "_ordering", ordering)
    monkeypatch.setattr(writer._pools, "gather", _logged(log, "gather", writer._pools.gather))
    engine = cluster.prefill[0].engine
    monkeypatch.setattr(engine, "write", _logged(log, "write", engine.write))
    return ordering


def test_the_engine_never_reads_a_buffer_before_its_gather_completed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gather, gathered, write: for every chunk and every decode rank fed."""
    with local_cluster(Geometry(1, 2, 4)) as cluster:
        request = cluster.add_request(400, num_pages=4, chunk_pages=2)
        log: list[str] = []
        _instrumented_writer(cluster, monkeypatch, log)
        assert cluster.send_all([request]) == []
        assert log.count("write") == 4  # two chunks, two decode ranks
        assert writes_after_gathers(log)


def test_a_writer_that_waits_before_it_gathers_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check fails on a reordered writer: its wait runs before the gather is enqueued (so
    the engine write can read a buffer the gather is still filling)."""
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        request = cluster.add_request(403, num_pages=2, chunk_pages=2)
        log: list[str] = []
        ordering = _instrumented_writer(cluster, monkeypatch, log)
        writer = cluster.writers[0]
        gather = writer._pools.gather

        def wait_then_gather(*args: Any, **kwargs: Any) -> object:
            ordering.gathered()
            return gather(*args, **kwargs)

        monkeypatch.setattr(writer._pools, "gather", wait_then_gather)
        # The writer's own wait after the gather is gone: it moved above.
        monkeypatch.setattr(writer, "_ordering", types.SimpleNamespace(gathered=lambda: None))
        assert cluster.send_all([request]) == []
        assert log == ["gathered", "gather", "write"]
        assert not writes_after_gathers(log)


def test_a_writer_that_skips_the_wait_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check fails on a writer whose ordering never waits."""
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        request = cluster.add_request(404, num_pages=2, chunk_pages=2)
        log: list[str] = []
        _instrumented_writer(cluster, monkeypatch, log)
        monkeypatch.setattr(cluster.writers[0], "_ordering", HostOrdering())
        assert cluster.send_all([request]) == []
        assert log == ["gather", "write"]
        assert not writes_after_gathers(log)


def test_a_gather_that_fails_part_way_is_still_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gather that raises after enqueueing some copies: the writer waits for them before
    the failure leaves it, so none lands in the buffer during a later chunk's write."""
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        request = cluster.add_request(405, num_pages=2, chunk_pages=2)
        log: list[str] = []
        _instrumented_writer(cluster, monkeypatch, log)
        monkeypatch.setattr(cluster.writers[0]._pools, "gather", _raising(log, "gather"))
        errors = cluster.send_all([request])
        assert len(errors) == 1
        assert log == ["gather", "gathered"]


# --------------------------------------------------------------------------- decode: scatter


@dataclass
class Decode:
    """A decode handler of one rank with an instrumented ordering and its frees logged."""

    handler: DecodeStagingHandler
    ordering: RecordingOrdering
    log: list[str]

    def arrive(self, room: int) -> ArrivalOutcome:
        """Register a one-chunk room of two pages, assign its region, and land its writer."""
        self.handler.register_room(RoomPlan(room, (10, 11), 2, 1, (PrefillPeer(0, P0),)))
        self.handler.handle_staging_req(room, 0, num_pages=2, session_id=SID, pp_rank=None)
        return self.handler.handle_chunk_arrival(
            room, 0, page_start=0, num_pages=2, session_id=SID, writer_rank=0
        )


class _NoSockets(PeerSockets):
    """Sends nothing (this test looks at the ring, not at the messages)."""

    def send(self, endpoint: str, frames: object) -> bool:
        del endpoint, frames
        return True


@pytest.fixture
def decode(monkeypatch: pytest.MonkeyPatch) -> Decode:
    log: list[str] = []
    ordering = RecordingOrdering(log)
    handler = DecodeStagingHandler(
        allocator=StagingAllocator(1 << 16),
        kv_buffers=Geometry(1, 1, 2).empty_pool(1, 0),
        decode_tp=1,
        decode_rank=0,
        total_kv_heads=2,
        session_id=SID,
        sender=_NoSockets(),
        ordering=ordering,
    )
    pools = handler._scatterer._pools
    monkeypatch.setattr(pools, "scatter", _logged(log, "scatter", pools.scatter))
    monkeypatch.setattr(handler, "_free", _logged(log, "free", handler._free))
    return Decode(handler, ordering, log)


def test_a_region_is_freed_only_after_its_scatter_completed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Until the scatter's token completes: the region stays live, no watermark moves, the
    room is not SUCCESS; then progress frees it and the room succeeds (integrity off: its
    check waits for the token at once, see the next test)."""
    monkeypatch.setenv(INTEGRITY_ENV, "0")
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        handler = cluster.handlers[0]
        log: list[str] = []
        ordering = RecordingOrdering(log)
        handler._scatterer.ordering = ordering
        handler._free = _logged(log, "free", handler._free)  # type: ignore[method-assign]
        pools = handler._scatterer._pools
        pools.scatter = _logged(log, "scatter", pools.scatter)  # type: ignore[method-assign]
        request = cluster.add_request(401, num_pages=2, chunk_pages=2)
        cluster.send_all([request])
        assert wait_for(lambda: ordering.tokens)
        watermark = handler.allocator.get_watermark()
        handler.progress()
        assert handler.allocator.live_count == 1
        assert handler.allocator.get_watermark() == watermark
        assert handler.poll_room(401) is RoomStatus.TRANSFERRING
        ordering.complete(ordering.tokens[0])
        assert wait_for(lambda: handler.poll_room(401) is RoomStatus.SUCCESS)
        assert handler.allocator.live_count == 0
        assert handler.allocator.get_watermark() != watermark
        assert frees_after_scatters(log)


def test_the_integrity_check_reads_the_region_only_after_its_scatter_completed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With integrity on, the handler waits for the scatter's token before it hashes the
    region, and frees it only after (a region checked before its scatter completed could
    still change under the check on CUDA)."""
    monkeypatch.setenv(INTEGRITY_ENV, "1")
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        handler = cluster.handlers[0]
        assert handler.integrity
        log: list[str] = []
        ordering = RecordingOrdering(log)
        handler._scatterer.ordering = ordering
        handler._free = _logged(log, "free", handler._free)  # type: ignore[method-assign]
        pools = handler._scatterer._pools
        pools.scatter = _logged(log, "scatter", pools.scatter)  # type: ignore[method-assign]
        verifier = handler._verifier
        verifier.check = _logged(log, "checked", verifier.check)  # type: ignore[method-assign]
        request = cluster.add_request(402, num_pages=2, chunk_pages=2)
        cluster.send_all([request])
        assert wait_for(lambda: handler.poll_room(402) is RoomStatus.SUCCESS)
        assert log.index("waited") < log.index("checked") < log.index("free")
        assert frees_after_scatters(log)


def test_a_handler_that_frees_before_the_token_completes_is_caught(
    decode: Decode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check fails on a reordered handler that takes every token for complete."""
    monkeypatch.setattr(decode.ordering, "done", lambda token: True)
    assert decode.arrive(1) is ArrivalOutcome.COMPLETE
    decode.handler.progress()
    assert decode.handler.allocator.live_count == 0
    assert decode.log == ["scatter", "scattered", "free"]
    assert not frees_after_scatters(decode.log)


def _device_runs_while_release_waits(decode: Decode, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device completes every queued scatter while release_room waits (it polls the
    tokens between waits, never blocks on them)."""

    def wait(timeout: float | None = None) -> bool:
        for token in decode.ordering.tokens:
            decode.ordering.complete(token)
        return False

    monkeypatch.setattr(decode.handler._idle, "wait", wait)


def test_release_waits_for_a_pending_scatter_before_freeing(
    decode: Decode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tearing a room down polls its scatter's token until it completed, then frees the
    region."""
    assert decode.arrive(2) is ArrivalOutcome.COMPLETE
    _device_runs_while_release_waits(decode, monkeypatch)
    decode.handler.release_room(2)
    assert decode.log == ["scatter", "scattered", "complete", "free"]
    assert frees_after_scatters(decode.log)
    assert decode.handler.allocator.live_count == 0


def test_a_failed_scatter_frees_its_region_only_after_what_it_enqueued_completed(
    decode: Decode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scatter that raises after enqueueing some copies fails the room at once, but its
    region stays held (no writer may overwrite it, no late copy lands elsewhere) until the
    ordering says those copies completed."""
    pools = decode.handler._scatterer._pools
    monkeypatch.setattr(pools, "scatter", _raising(decode.log, "scatter"))
    assert decode.arrive(3) is ArrivalOutcome.REJECTED
    # FAILED means done: shown once what the scatter enqueued can no longer land.
    assert decode.handler.poll_room(3) is RoomStatus.TRANSFERRING
    assert decode.handler.allocator.live_count == 1
    assert decode.log == ["scatter", "scattered"]
    decode.ordering.complete(decode.ordering.tokens[0])
    decode.handler.progress()
    assert decode.handler.allocator.live_count == 0
    assert decode.handler.poll_room(3) is RoomStatus.FAILED
    assert decode.handler.room_failure(3) == "scatter of chunk 0 failed: scatter failed part-way"
    assert frees_after_scatters(decode.log)


def test_releasing_a_room_whose_scatter_failed_waits_before_freeing(
    decode: Decode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler tears the failed room down at once: the wait comes before the free."""
    pools = decode.handler._scatterer._pools
    monkeypatch.setattr(pools, "scatter", _raising(decode.log, "scatter"))
    assert decode.arrive(4) is ArrivalOutcome.REJECTED
    _device_runs_while_release_waits(decode, monkeypatch)
    decode.handler.release_room(4)
    assert decode.log == ["scatter", "scattered", "complete", "free"]
    assert frees_after_scatters(decode.log)
    assert decode.handler.allocator.live_count == 0
    assert decode.handler.live_rooms == 0


def test_a_failed_scatter_without_a_token_keeps_its_region(
    decode: Decode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If not even a token can be had after the failure (a broken device), the region is
    held rather than freed while copies may still read it."""
    pools = decode.handler._scatterer._pools
    monkeypatch.setattr(pools, "scatter", _raising(decode.log, "scatter"))
    monkeypatch.setattr(decode.ordering, "scattered", _raising(decode.log, "scattered"))
    assert decode.arrive(5) is ArrivalOutcome.REJECTED
    assert decode.handler.poll_room(5) is RoomStatus.FAILED
    decode.handler.release_room(5)
    assert "free" not in decode.log
    assert decode.handler.allocator.live_count == 1


# --------------------------------------------------------------------------- the real orderings


def test_cpu_pools_get_the_host_ordering() -> None:
    """On CPU every copy is complete when its call returns."""
    ordering = ordering_for(torch.device("cpu"), None)
    assert isinstance(ordering, HostOrdering)
    assert ordering.scattered() is None
    assert ordering.done(None)


def test_cuda_pools_without_a_stream_get_the_cuda_ordering() -> None:
    """The default set-up (no stream) still gets events (it used to get none, and freed each
    region at once); building it touches no CUDA, so this runs without a device."""
    for stream in (None, types.SimpleNamespace()):
        ordering = ordering_for(torch.device("cuda", 0), stream)  # type: ignore[arg-type]
        assert isinstance(ordering, CudaOrdering)


@dataclass
class FakeStream:
    """Records what the ordering asked of it."""

    name: str
    calls: list[str]

    def synchronize(self) -> None:
        self.calls.append(f"synchronize {self.name}")


class FakeCuda:
    """torch.cuda's current stream and events, faked: the current stream can change."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.current = FakeStream("current-1", self.calls)
        self.asked: list[object] = []
        outer = self

        class Event:
            def __init__(self) -> None:
                self.stream: FakeStream | None = None

            def record(self, stream: FakeStream) -> None:
                self.stream = stream
                outer.calls.append(f"record on {stream.name}")

            def query(self) -> bool:
                outer.calls.append("query")
                return False

            def synchronize(self) -> None:
                outer.calls.append("event synchronize")

        self.Event = Event

    def current_stream(self, device: object) -> FakeStream:
        self.asked.append(device)
        return self.current


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    return fake


def test_without_a_stream_the_event_is_recorded_on_the_current_stream_of_the_call(
    fake_cuda: FakeCuda,
) -> None:
    """No stream: the kernels went on the caller's current stream, so that is where the
    event is recorded and what ``gathered`` synchronizes, looked up at each call."""
    device = torch.device("cuda", 1)
    ordering = ordering_for(device, None)
    token = ordering.scattered()
    assert token is not None
    assert fake_cuda.calls == ["record on current-1"]
    fake_cuda.current = FakeStream("current-2", fake_cuda.calls)
    ordering.gathered()
    second = ordering.scattered()
    assert fake_cuda.calls[1:] == ["synchronize current-2", "record on current-2"]
    assert fake_cuda.asked == [device, device, device]
    assert not ordering.done(second)
    ordering.wait(second)
    assert fake_cuda.calls[3:] == ["query", "event synchronize"]


def test_with_a_stream_the_event_is_recorded_on_that_stream(fake_cuda: FakeCuda) -> None:
    """An explicit stream: the scatter's event and the gather's wait are on it, never on the
    current stream."""
    side = FakeStream("side", fake_cuda.calls)
    ordering = CudaOrdering(torch.device("cuda", 0), side)  # type: ignore[arg-type]
    assert ordering.scattered() is not None
    ordering.gathered()
    assert fake_cuda.calls == ["record on side", "synchronize side"]
    assert fake_cuda.asked == []


# --------------------------------------------------------------------------- CUDA

_SLEEP_CYCLES = 1 << 31  # about a second of a GPU clock: far longer than the checks below

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]  # unannotated in torch


def _sleep() -> None:
    """Hold the current stream back (a kernel that spins for ``_SLEEP_CYCLES``)."""
    torch.cuda._sleep(_SLEEP_CYCLES)  # type: ignore[no-untyped-call]  # unannotated in torch


def _running(stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
    """The stream the kernels enqueued on: ``stream``, or the current one."""
    return stream if stream is not None else torch.cuda.current_stream()


def _cuda_pool(geometry: Geometry, tp: int, rank: int) -> KVBufferTensors:
    pool = geometry.empty_pool(tp, rank)
    return KVBufferTensors(
        tuple(t.cuda() for t in pool.k_buffers),
        tuple(t.cuda() for t in pool.v_buffers),
        pool.page_size,
    )


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_a_delayed_scatter_s_token_completes_only_with_its_stream(side_stream: bool) -> None:
    """A kernel held back on the stream: the token is not done until the stream ran it."""
    stream = _stream() if side_stream else None
    ordering = ordering_for(torch.device("cuda", torch.cuda.current_device()), stream)
    with torch.cuda.stream(stream):  # None: the current stream
        _sleep()
    token = ordering.scattered()
    assert token is not None
    assert not ordering.done(token)
    ordering.wait(token)
    assert ordering.done(token)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_a_region_is_not_freed_before_the_delayed_scatter_ran(
    monkeypatch: pytest.MonkeyPatch, side_stream: bool
) -> None:
    """The scatter kernel held back on its stream: the region stays live and the room
    transferring until the stream finished; then progress frees it."""
    stream = _stream() if side_stream else None
    handler = DecodeStagingHandler(
        allocator=StagingAllocator(1 << 16, device=torch.device("cuda")),
        kv_buffers=_cuda_pool(Geometry(1, 1, 2), 1, 0),
        decode_tp=1,
        decode_rank=0,
        total_kv_heads=2,
        session_id=SID,
        sender=_NoSockets(),
        scatter_stream=stream,
    )
    pools = handler._scatterer._pools
    scatter = pools.scatter

    def delayed(*args: Any, **kwargs: Any) -> None:
        with torch.cuda.stream(kwargs.get("stream")):  # the kernel's stream
            _sleep()
        scatter(*args, **kwargs)

    monkeypatch.setattr(pools, "scatter", delayed)
    decode = Decode(handler, RecordingOrdering([]), [])
    assert decode.arrive(1) is ArrivalOutcome.COMPLETE
    ran_on = _running(stream)
    assert not ran_on.query()
    handler.progress()
    assert handler.allocator.live_count == 1
    assert handler.poll_room(1) is RoomStatus.TRANSFERRING
    ran_on.synchronize()
    assert handler.poll_room(1) is RoomStatus.SUCCESS
    assert handler.allocator.live_count == 0


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_the_engine_write_comes_after_the_delayed_gather_ran(
    monkeypatch: pytest.MonkeyPatch, side_stream: bool
) -> None:
    """The gather held back on its stream: when the engine is asked to write, the stream
    has finished and the buffer holds the gathered bytes."""
    from tests.test_prefill_writer import (
        Clock,
        FakeEngine,
        FakeRegions,
        FakeWatermarks,
        RecordingSockets,
        target,
    )

    stream = _stream() if side_stream else None
    geometry = Geometry(1, 1, 2)
    pool = _cuda_pool(geometry, 1, 0)
    for number, buffer in enumerate((*pool.k_buffers, *pool.v_buffers)):
        buffer.view(torch.uint8).fill_(number + 1)
    finished: list[bool] = []
    payloads: list[torch.Tensor] = []

    class CudaEngine(FakeEngine):
        def write(
            self, peer: str, transfers: Sequence[Transfer], notify: bytes | None = None
        ) -> None:
            finished.append(_running(stream).query())
            payloads.append(writer._buffer[: transfers[0].length].cpu())

    clock = Clock()
    regions = FakeRegions(clock)
    writer = StagingWriter(
        kv_buffers=pool,
        engine=CudaEngine(),
        sender=RecordingSockets(),
        watermarks=FakeWatermarks(clock),
        regions=regions,
        prefill_tp=1,
        prefill_rank=0,
        total_kv_heads=2,
        max_chunk_pages=4,
        stream=stream,
    )
    gather = writer._pools.gather

    def delayed(*args: Any, **kwargs: Any) -> int:
        with torch.cuda.stream(kwargs.get("stream")):  # the kernel's stream
            _sleep()
        return int(gather(*args, **kwargs))

    monkeypatch.setattr(writer._pools, "gather", delayed)
    regions.record(1, 0, "decode-0", RegionAnswer(0, 0, 1024))
    writer.send_chunk(1, ChunkSpec(0, 0, (1, 2)), [target(0)])
    assert finished == [True]
    assert bool((payloads[0] != 0).all())
