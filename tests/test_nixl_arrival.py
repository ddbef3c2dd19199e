"""Arrival modes: a NIXL writer signals arrival by notification or, as the reference does, by
CHUNK_READY over ZMQ after its write; our decode accepts either (issue 17).

The writer tests use a fake engine and a recording sender (no NIXL needed); the manager tests
run real NIXL agents in this process and check every decode page bit for bit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import torch

from staging_contracts import KVBufferTensors
from staging_contracts._control.transport import PeerSockets
from staging_contracts._control.wire import ChunkReady
from staging_contracts._decode.handler import DecodeStagingHandler, RoomPlan, RoomStatus, peers_for
from staging_contracts._prefill.books import RegionAnswerTable, WatermarkTracker
from staging_contracts._prefill.writer import (
    ArrivalMode,
    ChunkSpec,
    DecodeTarget,
    StagingWriter,
)
from staging_contracts._staging.layout import compute_staging_layout
from staging_contracts.backends._common import Role
from staging_contracts.backends._staging_setup import (
    StagingBackend,
    enable_decode_staging,
    enable_prefill_staging,
)
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.engines import engine_available
from staging_contracts.protocols import Notification, RegionAnswer, Transfer
from tests.local_cluster import Geometry, make_request, pools_equal, rank_heads

if TYPE_CHECKING:
    from staging_contracts.backends.nixl import NixlKVManager

NIXL_OK, NIXL_WHY = engine_available("nixl")

# --------------------------------------------------------------------------- the writer alone

Event = tuple[str, object]


class LoggingEngine:
    """A transfer engine that logs each write (and its notify) in a shared event log."""

    def __init__(self, log: list[Event], *, notifications: bool) -> None:
        self.session_id = "prefill-engine"
        self.supports_notifications = notifications
        self.log = log

    def metadata(self) -> bytes:
        return b""

    def add_peer(self, session_id: str, metadata: bytes) -> None:
        del session_id, metadata

    def register(self, ptr: int, length: int) -> None:
        del ptr, length

    def deregister(self, ptr: int) -> None:
        del ptr

    def write(self, peer: str, transfers: Sequence[Transfer], notify: bytes | None = None) -> None:
        self.log.append(("write", (peer, len(transfers), notify)))

    def poll_notifications(self) -> list[Notification]:
        return []

    def close(self) -> None:
        pass


class LoggingSockets(PeerSockets):
    """PeerSockets that log every message in the shared event log instead of sending it."""

    def __init__(self, log: list[Event]) -> None:
        super().__init__()
        self.log = log

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool:
        self.log.append(("send", (endpoint, list(frames))))
        return True


GEOMETRY = Geometry(1, 1, 2)
TARGET = DecodeTarget(0, "decode-0", "tcp://decode:0", 1_000_000, 1 << 16)


def make_writer(
    log: list[Event], *, notifications: bool, arrival: ArrivalMode | None = None
) -> StagingWriter:
    """A 1 -> 1 writer over a logging engine and sender; its regions are always ready."""
    regions = RegionAnswerTable()
    writer = StagingWriter(
        kv_buffers=GEOMETRY.empty_pool(1, 0),
        engine=LoggingEngine(log, notifications=notifications),
        sender=LoggingSockets(log),
        watermarks=WatermarkTracker(),
        regions=regions,
        prefill_tp=1,
        prefill_rank=0,
        total_kv_heads=GEOMETRY.total_heads,
        max_chunk_pages=4,
        arrival=arrival,
        integrity=False,
    )
    layout = compute_staging_layout(1, 1, 0, 2, 2 * GEOMETRY.page_size, 16, GEOMETRY.layers)
    regions.record(7, 0, TARGET.session_id, RegionAnswer(0, 0, layout.total_bytes))
    return writer


def stage_one_chunk(writer: StagingWriter, log: list[Event]) -> list[Event]:
    """Send chunk 0 (two pages) of room 7; return what happened after the prefetch."""
    writer.prefetch(7, [(0, 2)], [TARGET])
    log.clear()
    writer.send_chunk(7, ChunkSpec(0, 0, (3, 5)), [TARGET])
    return list(log)


ARRIVAL = ChunkReady(7, 0, 0, 2, TARGET.session_id, 0, 0)
"""Chunk 0 of room 7 by writer 0 into a region of epoch (round) 0; integrity off: no tag."""


@pytest.mark.parametrize(
    ("notifications", "arrival", "expected"),
    [
        (True, None, "notification"),
        (False, None, "zmq"),
        (True, "zmq", "zmq"),
        (True, "notification", "notification"),
        (False, "zmq", "zmq"),
    ],
)
def test_the_writer_carries_its_arrival_mode(
    notifications: bool, arrival: ArrivalMode | None, expected: str
) -> None:
    """Without a choice the engine decides (notifications where it has them); a choice wins."""
    assert make_writer([], notifications=notifications, arrival=arrival).arrival == expected


def test_notification_arrival_needs_an_engine_with_notifications() -> None:
    """Asking for notifications from an engine without them fails at construction."""
    with pytest.raises(ValueError, match=r"^arrival='notification' needs an engine with"):
        make_writer([], notifications=False, arrival="notification")


def test_an_unknown_arrival_mode_is_refused() -> None:
    """Only the two modes exist."""
    with pytest.raises(ValueError, match=r"^arrival='rdma' must be 'notification', 'zmq' or"):
        make_writer([], notifications=True, arrival="rdma")  # type: ignore[arg-type]  # the mistake under test


def test_zmq_arrival_sends_chunk_ready_after_the_write_even_where_notifications_exist() -> None:
    """In ZMQ mode the write carries no notification and CHUNK_READY goes to decode's
    listener once the write returned: the reference's NIXL decode reads only that."""
    log: list[Event] = []
    writer = make_writer(log, notifications=True, arrival="zmq")
    events = stage_one_chunk(writer, log)
    assert events == [
        ("write", (TARGET.session_id, 1, None)),
        ("send", (TARGET.endpoint, ARRIVAL.to_frames())),
    ]
    assert ARRIVAL.to_frames() == [
        b"CHUNK_READY",
        b"7",
        b"0",
        b"0",
        b"2",
        b"decode-0",
        b"0",
        b"0",
    ]


def test_notification_arrival_travels_with_the_write_and_sends_nothing_else() -> None:
    """In notification mode the payload is the write's notify, and no CHUNK_READY is sent."""
    log: list[Event] = []
    writer = make_writer(log, notifications=True)
    events = stage_one_chunk(writer, log)
    assert events == [("write", (TARGET.session_id, 1, ARRIVAL.to_notification()))]


# --------------------------------------------------------------------------- NIXL managers


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_nixl_manager_refuses_an_unknown_arrival_mode() -> None:
    """The mode is checked before any agent starts."""
    from staging_contracts.backends.nixl import NixlKVManager

    with pytest.raises(ValueError, match=r"^arrival='rdma' must be one of"):
        NixlKVManager(
            GEOMETRY.kv_args(1, 0),
            role=Role.PREFILL,
            attn_tp_size=1,
            arrival="rdma",  # type: ignore[arg-type]  # the mistake under test
        )


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_nixl_engine_without_notifications_refuses_a_notify_and_still_receives() -> None:
    """An engine created with notifications=False has none to offer, refuses a notify, and
    still polls what a peer attaches to its writes."""
    from staging_contracts.engines.nixl import NixlEngine

    quiet = NixlEngine(notifications=False, load_ib_modules=False)
    loud = NixlEngine(load_ib_modules=False)
    try:
        assert not quiet.supports_notifications
        assert loud.supports_notifications
        quiet.add_peer(loud.session_id, loud.metadata())
        loud.add_peer(quiet.session_id, quiet.metadata())
        with pytest.raises(ValueError, match=r"was created with notifications=False"):
            quiet.write(loud.session_id, [], b"hello")
        loud.write(quiet.session_id, [], b"hello")
        deadline = time.monotonic() + 10
        notes: list[Notification] = []
        while not notes and time.monotonic() < deadline:
            notes = quiet.poll_notifications()
            time.sleep(0.005)
        assert notes == [Notification(loud.session_id, b"hello")]
    finally:
        quiet.close()
        loud.close()


@dataclass
class NixlSides:
    """Prefill and decode NixlKVManagers in this process, wired and started."""

    prefill: list[NixlKVManager]
    writers: list[StagingWriter]
    handlers: list[DecodeStagingHandler]
    decode_pools: list[KVBufferTensors]
    prefill_pools: list[KVBufferTensors]
    targets: list[DecodeTarget]
    arrivals: list[tuple[int, str]]
    """(decode rank, "zmq" or "notification") of every arrival decode received."""


@contextmanager
def nixl_sides(
    geometry: Geometry,
    modes: Sequence[ArrivalMode],
    setup: Sequence[ArrivalMode | None] | None = None,
) -> Iterator[NixlSides]:
    """One prefill manager per mode, ``geometry.decode_tp`` decode managers; ``setup``: the
    ``arrival=`` given to ``enable_prefill_staging`` per prefill rank (``None`` each by
    default: the manager's own mode)."""
    from staging_contracts.backends.nixl import NixlKVManager

    g = geometry
    made: list[NixlKVManager] = []
    try:
        prefill = []
        for p, mode in enumerate(modes):
            manager = NixlKVManager(
                g.kv_args(g.prefill_tp, p),
                role=Role.PREFILL,
                attn_tp_size=g.prefill_tp,
                arrival=mode,
            )
            made.append(manager)
            prefill.append(manager)
        decode = []
        for d in range(g.decode_tp):
            manager = NixlKVManager(
                g.kv_args(g.decode_tp, d), role=Role.DECODE, attn_tp_size=g.decode_tp
            )
            made.append(manager)
            decode.append(manager)
        arrivals: list[tuple[int, str]] = []
        lock = threading.Lock()
        for d, manager in enumerate(decode):
            by_zmq, by_note = manager._handle_chunk_ready, manager._handle_chunk_notification

            def on_zmq(frames: Sequence[bytes], d: int = d, inner: object = by_zmq) -> object:
                with lock:
                    arrivals.append((d, "zmq"))
                assert callable(inner)
                return inner(frames)

            def on_note(payload: bytes, d: int = d, inner: object = by_note) -> object:
                with lock:
                    arrivals.append((d, "notification"))
                assert callable(inner)
                return inner(payload)

            manager._handle_chunk_ready = on_zmq  # type: ignore[method-assign,assignment]  # observe which path delivered
            manager._handle_chunk_notification = on_note  # type: ignore[method-assign,assignment]  # observe which path delivered
        prefill_pools = [g.empty_pool(g.prefill_tp, p) for p in range(g.prefill_tp)]
        decode_pools = [g.empty_pool(g.decode_tp, d) for d in range(g.decode_tp)]
        handlers = [
            enable_decode_staging(m, kv_buffers=pool, ring_bytes=1 << 18)
            for m, pool in zip(decode, decode_pools, strict=True)
        ]
        chosen = list(setup) if setup is not None else [None] * len(prefill)
        writers = [
            enable_prefill_staging(m, kv_buffers=pool, max_chunk_pages=4, arrival=arrival)
            for m, pool, arrival in zip(prefill, prefill_pools, chosen, strict=True)
        ]
        for manager in made:
            manager.start()
        targets = []
        for d, manager in enumerate(decode):
            allocator = handlers[d]._allocator
            targets.append(
                DecodeTarget(
                    d, manager.engine.session_id, manager.endpoint, allocator.base_ptr, 1 << 18
                )
            )
            for writer_manager in prefill:
                writer_manager.engine.add_peer(manager.engine.session_id, manager.engine.metadata())
        yield NixlSides(prefill, writers, handlers, decode_pools, prefill_pools, targets, arrivals)
    finally:
        for manager in made:
            manager.close()


def run_room(sides: NixlSides, geometry: Geometry, *, room: int = 11, pages: int = 6) -> None:
    """Stage one room of ``pages`` pages in chunks of four, every writer in its own thread,
    and check each decode pool bit for bit."""
    g = geometry
    request = make_request(g, room, pages, 4, seed=room, used=set())
    for p, pool in enumerate(sides.prefill_pools):
        place(
            pool,
            request.k,
            request.v,
            request.prefill_pages,
            rank_heads(g.total_heads, g.prefill_tp, p),
        )
    endpoints = [m.endpoint for m in sides.prefill]
    for d, handler in enumerate(sides.handlers):
        handler.register_room(
            RoomPlan(
                room,
                request.decode_pages,
                4,
                g.prefill_tp,
                peers_for(endpoints, g.prefill_tp, g.decode_tp, d),
            )
        )
    errors: list[BaseException] = []

    def work(writer: StagingWriter) -> None:
        chunks = request.chunks()
        writer.prefetch(room, [(c.chunk_idx, len(c.pages)) for c in chunks], sides.targets)
        try:
            for chunk in chunks:
                writer.send_chunk(room, chunk, sides.targets)
        except Exception as exc:  # noqa: BLE001 - collected for the test to assert on
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in sides.writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    deadline = time.monotonic() + 20
    status = [h.poll_room(room) for h in sides.handlers]
    while any(s is not RoomStatus.SUCCESS for s in status) and time.monotonic() < deadline:
        time.sleep(0.005)
        status = [h.poll_room(room) for h in sides.handlers]
    assert status == [RoomStatus.SUCCESS] * g.decode_tp
    for d, pool in enumerate(sides.decode_pools):
        expected = g.empty_pool(g.decode_tp, d)
        place(
            expected,
            request.k,
            request.v,
            request.decode_pages,
            rank_heads(g.total_heads, g.decode_tp, d),
        )
        assert pools_equal(pool, expected), f"decode rank {d}"


def place(
    pool: KVBufferTensors,
    k: Sequence[torch.Tensor],
    v: Sequence[torch.Tensor],
    pages: Sequence[int],
    heads: list[int],
) -> None:
    """Write the request's tokens of ``heads`` into ``pages`` of ``pool``."""
    ps = pool.page_size
    index = torch.tensor([p * ps + t for p in pages for t in range(ps)])
    for layer in range(len(pool.k_buffers)):
        pool.k_buffers[layer][index] = k[layer][:, heads]
        pool.v_buffers[layer][index] = v[layer][:, heads]


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_one_decode_takes_a_notification_writer_and_a_zmq_writer_of_the_same_chunks() -> None:
    """P=2 -> D=1: rank 0 signals by notification, rank 1 by CHUNK_READY over ZMQ; decode
    counts both kinds for every chunk, completes the room and its pool is bit-exact."""
    g = Geometry(2, 1, 4)
    with nixl_sides(g, ["notification", "zmq"]) as sides:
        assert [w.arrival for w in sides.writers] == ["notification", "zmq"]
        assert [m.engine.supports_notifications for m in sides.prefill] == [True, False]
        run_room(sides, g)
        assert sorted(sides.arrivals) == [(0, "notification")] * 2 + [(0, "zmq")] * 2


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_zmq_arrival_fans_out_to_two_decode_ranks() -> None:
    """P=1 -> D=2 with arrival="zmq": every arrival reaches each decode rank as CHUNK_READY
    over ZMQ (none as a notification); decode managers keep polling their agents, whatever
    mode they were given, and both pools are bit-exact."""
    from staging_contracts.backends.nixl import NixlKVManager

    g = Geometry(1, 2, 4)
    with nixl_sides(g, ["zmq"]) as sides:
        (writer,) = sides.writers
        assert writer.arrival == "zmq"
        run_room(sides, g)
        assert sorted(sides.arrivals) == [(0, "zmq")] * 2 + [(1, "zmq")] * 2
    decode = NixlKVManager(g.kv_args(2, 0), role=Role.DECODE, attn_tp_size=2, arrival="zmq")
    try:
        assert decode.arrival == "zmq"
        assert decode.engine.supports_notifications  # decode accepts both
    finally:
        decode.close()


# --------------------------------------------------------------------------- enable_prefill_staging


@pytest.mark.parametrize(
    ("arrival", "expected"),
    [(None, "notification"), ("notification", "notification"), ("zmq", "zmq")],
)
def test_setup_arrival_where_the_engine_has_notifications(
    arrival: ArrivalMode | None, expected: str
) -> None:
    """A backend whose engine has notifications (LocalKVManager): without arrival= the writer
    takes the manager's mode (notification); either mode may be chosen."""
    g = GEOMETRY
    manager = LocalKVManager(g.kv_args(1, 0), role=Role.PREFILL, attn_tp_size=1)
    try:
        writer = enable_prefill_staging(
            manager, kv_buffers=g.empty_pool(1, 0), max_chunk_pages=4, arrival=arrival
        )
        assert writer.arrival == expected
    finally:
        manager.close()


def test_setup_refuses_an_unknown_arrival_and_leaves_the_backend_without_staging() -> None:
    """Only the two modes (or None); a refusal leaves no staging context or pool behind."""
    g = GEOMETRY
    manager = LocalKVManager(g.kv_args(1, 0), role=Role.PREFILL, attn_tp_size=1)
    try:
        with pytest.raises(ValueError, match=r"^arrival='rdma' must be 'notification', 'zmq' or"):
            enable_prefill_staging(
                manager,
                kv_buffers=g.empty_pool(1, 0),
                max_chunk_pages=4,
                arrival="rdma",  # type: ignore[arg-type]  # the mistake under test
            )
        assert manager._staging_ctx is None
        assert manager.kv_buffer_tensors is None
    finally:
        manager.close()


def refused_then_accepted(backend: StagingBackend, g: Geometry) -> StagingWriter:
    """Asking for "notification" is refused with the engine named, nothing of staging is left on the
    backend, and the manager's own mode is then accepted."""
    with pytest.raises(
        ValueError, match=r"^arrival='notification' needs an engine with notifications; "
    ) as caught:
        enable_prefill_staging(
            backend, kv_buffers=g.empty_pool(1, 0), max_chunk_pages=4, arrival="notification"
        )
    assert repr(backend.engine) in str(caught.value)
    assert backend._staging_ctx is None
    assert getattr(backend, "kv_buffer_tensors", None) is None
    return enable_prefill_staging(backend, kv_buffers=g.empty_pool(1, 0), max_chunk_pages=4)


@pytest.mark.mooncake
def test_setup_arrival_on_a_backend_without_notifications() -> None:
    """Mooncake has no notifications: the writer signals over ZMQ by default or when asked,
    and "notification" is refused with a ValueError naming the engine."""
    ok, why = engine_available("mooncake")
    if not ok:
        pytest.skip(why)
    from staging_contracts.backends.mooncake import MooncakeKVManager

    g = GEOMETRY
    manager = MooncakeKVManager(g.kv_args(1, 0), role=Role.PREFILL, attn_tp_size=1)
    try:
        assert refused_then_accepted(manager, g).arrival == "zmq"
    finally:
        manager.close()
    manager = MooncakeKVManager(g.kv_args(1, 0), role=Role.PREFILL, attn_tp_size=1)
    try:
        writer = enable_prefill_staging(
            manager, kv_buffers=g.empty_pool(1, 0), max_chunk_pages=4, arrival="zmq"
        )
        assert writer.arrival == "zmq"
    finally:
        manager.close()


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
@pytest.mark.parametrize(
    ("manager_mode", "setup", "expected"),
    [
        ("notification", None, "notification"),
        ("notification", "notification", "notification"),
        ("notification", "zmq", "zmq"),
        ("zmq", None, "zmq"),
        ("zmq", "zmq", "zmq"),
    ],
)
def test_setup_arrival_on_a_nixl_manager(
    manager_mode: ArrivalMode, setup: ArrivalMode | None, expected: str
) -> None:
    """Without arrival= the writer takes the manager's mode; a manager with notifications
    (its default) lets the set-up choose either; the manager's own mode is unchanged."""
    from staging_contracts.backends.nixl import NixlKVManager

    g = GEOMETRY
    manager = NixlKVManager(
        g.kv_args(1, 0), role=Role.PREFILL, attn_tp_size=1, arrival=manager_mode
    )
    try:
        writer = enable_prefill_staging(
            manager, kv_buffers=g.empty_pool(1, 0), max_chunk_pages=4, arrival=setup
        )
        assert writer.arrival == expected
        assert manager.arrival == manager_mode
    finally:
        manager.close()


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_setup_refuses_notification_arrival_on_a_nixl_manager_made_for_zmq() -> None:
    """NixlKVManager(arrival="zmq") creates its agent without notifications: the set-up
    cannot ask for them, and says which engine has none."""
    from staging_contracts.backends.nixl import NixlKVManager

    g = GEOMETRY
    manager = NixlKVManager(g.kv_args(1, 0), role=Role.PREFILL, attn_tp_size=1, arrival="zmq")
    try:
        assert refused_then_accepted(manager, g).arrival == "zmq"
    finally:
        manager.close()


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_setup_arrival_zmq_on_default_nixl_managers_is_what_decode_receives() -> None:
    """P=2 -> D=1, both prefill managers in their default mode (notification); the set-up
    turns rank 0 to ZMQ: decode receives rank 0's arrivals as CHUNK_READY and rank 1's as
    notifications, and its pool is bit-exact."""
    g = Geometry(2, 1, 4)
    with nixl_sides(g, ["notification", "notification"], setup=["zmq", None]) as sides:
        assert [m.arrival for m in sides.prefill] == ["notification", "notification"]
        assert [w.arrival for w in sides.writers] == ["zmq", "notification"]
        run_room(sides, g)
        assert sorted(sides.arrivals) == [(0, "notification")] * 2 + [(0, "zmq")] * 2
