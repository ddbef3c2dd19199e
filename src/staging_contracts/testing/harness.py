"""``run_transfer``: a staged transfer through any backend, every decode page verified.

The contract kit's behaviour checks drive one decode manager with fake prefill peers; this
harness runs the real thing, in one process, over the backend's own engine and listeners::

    from staging_contracts.testing import run_transfer

    report = run_transfer(MyKVManager, prefill_tp=2, decode_tp=1, rooms=3)
    if not report.ok:
        pytest.fail(report.summary())

It builds ``prefill_tp`` prefill and ``decode_tp`` decode managers with the backend (a class is
called with the standard constructor ``Class(kv_args, role=..., attn_tp_size=...)``; any
:class:`ManagerFactory` with that signature will do), enables staging on each
(:func:`~staging_contracts.backends.staging_setup.enable_decode_staging`,
:func:`~staging_contracts.backends.staging_setup.enable_prefill_staging`), wires them as a
bootstrap would (each prefill engine ``add_peer``-s each decode engine; every manager
``trust_peer``-s every other, a no-op without a cluster secret), starts their listeners and
moves ``rooms`` multi-chunk requests through the per-request API
(:class:`~staging_contracts.backends.kv_requests.KVReceiver` on decode,
:class:`~staging_contracts.backends.kv_requests.KVSender` on prefill), all rooms at once. It
then compares every decode KV page with what it must hold, computed from first principles
(which global KV heads each rank holds), closes everything, and returns a
:class:`TransferReport`: per room, whether it succeeded or why not, the writer arrivals decode
counted, the chunks that landed bit for bit; and, when something failed, a diagnosis that
names the likely cause.

Every wait is bounded by ``timeout_s``; a room still running then is failed and reported as
timed out. The harness raises only for bad arguments or when a manager cannot be built or
wired; everything that goes wrong during the transfer is in the report.

**Thread:** call it from any thread but a listener's; it blocks until the report is ready.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Final, Protocol

import torch

from ..backends.common import Role
from ..backends.kv_requests import (
    DecodeTransfers,
    KVPoll,
    KVReceiver,
    KVSender,
    PrefillTransfers,
)
from ..backends.staging_setup import enable_decode_staging, enable_prefill_staging
from ..decode.handler import DecodeStagingHandler
from ..prefill.writer import DecodeTarget, PrefillTimeouts
from ..protocols import ArrivalOutcome, KVArgs, KVArgsRecord, KVBufferTensors, StagingReqOutcome
from ..staging.layout import validate_tp_pair
from ..stats import StagingStats
from .decode_setup import StartableBackend

__all__ = [
    "IDLE_HOOK_HINT",
    "ManagerFactory",
    "RoomReport",
    "TransferGeometry",
    "TransferManager",
    "TransferReport",
    "run_transfer",
]

logger = logging.getLogger(__name__)

IDLE_HOOK_HINT: Final = (
    "is the listener's idle hook wired to staging_idle? (arrivals by engine notification "
    "are delivered there: '_on_idle(self): staging_idle(self)')"
)
"""What the diagnosis asks when a notifying engine's arrivals never reached decode."""

_POLL_S: Final = 0.005
_TEARDOWN_S: Final = 5.0
"""Longest the teardown waits for prefill to hear that the unfinished rooms failed."""
_ROOM_BASE: Final = 1000


class TransferManager(StartableBackend, Protocol):
    """A manager the harness can wire and drive: what ``CommonKVManager`` + the mixin give.

    Beyond :class:`~staging_contracts.testing.StartableBackend` (the staging host, its engine,
    listener, ``start`` and ``close``): ``send`` to a peer's listener, ``trust_peer`` and
    ``curve_key`` for the authenticated control plane, and the mixin's entry points (so a
    manager of this kind is also a :class:`~staging_contracts.testing.LiveDecodeManager`
    once decode staging is enabled).
    """

    @property
    def curve_key(self) -> bytes | None:
        """This manager's CURVE public key (``None`` without a cluster secret)."""
        ...

    def trust_peer(self, endpoint: str, curve_key: bytes | None) -> None:
        """Accept messages from, and encrypt messages to, the peer at ``endpoint``."""
        ...

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool:
        """Send a control message to a peer without blocking."""
        ...

    def detach_staging_handler(self) -> None:
        """Detach the decode handler (the mixin's)."""
        ...

    def _handle_staging_req(self, frames: Sequence[bytes]) -> StagingReqOutcome | None: ...

    def _handle_chunk_ready(self, frames: Sequence[bytes]) -> ArrivalOutcome | None: ...


class ManagerFactory(Protocol):
    """Builds one unstarted manager: the standard constructor of a backend class.

    A backend class whose constructor takes ``(kv_args, *, role, attn_tp_size)`` (and
    anything else with defaults) is one; so is a function with that signature.
    """

    def __call__(self, kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> TransferManager:
        """A new manager for the rank ``kv_args.engine_rank`` of the side ``role``."""
        ...


@dataclass(frozen=True, slots=True)
class TransferGeometry:
    """Model and transfer sizes of a harness run (CPU tensors).

    The defaults give rooms of three chunks each, and a ring that cannot hold every chunk
    of every room at once (so regions are reused while rooms run).

    Raises:
        ValueError: a size is not positive, or the rooms do not fit the KV pools.
    """

    total_kv_heads: int = 4
    """KV heads of the whole model (4: TP 1, 2 and 4 on either side)."""
    num_layers: int = 2
    """Layers of the KV pools."""
    head_dim: int = 8
    """Elements per head and token."""
    page_size: int = 4
    """Tokens per KV page."""
    pool_pages: int = 64
    """Pages of every rank's KV pool."""
    room_pages: int = 6
    """Pages of one room (request)."""
    chunk_pages: int = 2
    """Pages of one chunk of the chunked prefill (the decode grid)."""
    ring_bytes: int = 1 << 15
    """Bytes of each decode rank's staging ring."""
    dtype: torch.dtype = torch.float16
    """Element type of the KV pools."""

    def __post_init__(self) -> None:
        for name in (
            "total_kv_heads",
            "num_layers",
            "head_dim",
            "page_size",
            "pool_pages",
            "room_pages",
            "chunk_pages",
            "ring_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"TransferGeometry.{name}={getattr(self, name)!r} must be >= 1")

    @property
    def chunks_per_room(self) -> int:
        """Chunks of one room."""
        return -(-self.room_pages // self.chunk_pages)

    def heads(self, tp: int, rank: int) -> list[int]:
        """Global KV heads rank ``rank`` of a side of TP ``tp`` holds (replicated under GQA)."""
        if self.total_kv_heads >= tp:
            per = self.total_kv_heads // tp
            return list(range(rank * per, (rank + 1) * per))
        return [rank // (tp // self.total_kv_heads)]

    def kv_args(self, tp: int, rank: int) -> KVArgsRecord:
        """KV arguments of one rank (CPU device)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        heads = len(self.heads(tp, rank))
        item = self.page_size * heads * self.head_dim * element
        return KVArgsRecord(
            page_size=self.page_size,
            kv_item_lens=(item,) * (2 * self.num_layers),
            engine_rank=rank,
            device="cpu",
            total_kv_head_num=self.total_kv_heads,
            kv_head_num=heads,
            kv_layer_ids=tuple(range(self.num_layers)),
        )

    def empty_pool(self, tp: int, rank: int) -> KVBufferTensors:
        """A zeroed KV pool of one rank."""
        shape = (self.pool_pages * self.page_size, len(self.heads(tp, rank)), self.head_dim)
        return KVBufferTensors(
            tuple(torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)),
            tuple(torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)),
            self.page_size,
        )


@dataclass(frozen=True, slots=True)
class RoomReport:
    """What happened to one room (request)."""

    room: int
    """The room id."""
    succeeded: bool
    """Every rank reported success and every decode page of the room verified bit for bit."""
    reason: str | None
    """Why not, when it did not succeed (the first reason found)."""
    decode_states: tuple[KVPoll, ...]
    """Each decode rank's final state of the room (by TP rank)."""
    prefill_states: tuple[KVPoll, ...]
    """Each prefill rank's final state of the room (by TP rank)."""
    chunks: int
    """Chunks of the room."""
    chunks_verified: int
    """Chunks whose pages hold exactly the expected bytes on every decode rank."""
    arrivals: int
    """Writer arrivals decode counted for this room (every decode rank)."""
    expected_arrivals: int
    """Arrivals a complete room has: one per chunk, decode rank and writer of that rank."""

    def line(self) -> str:
        """One line: the room, its outcome, arrivals and chunks."""
        outcome = "succeeded" if self.succeeded else f"failed: {self.reason}"
        return (
            f"room {self.room}: {outcome} (arrivals {self.arrivals}/{self.expected_arrivals}, "
            f"chunks verified {self.chunks_verified}/{self.chunks})"
        )


@dataclass(frozen=True, slots=True)
class TransferReport:
    """The result of :func:`run_transfer`."""

    backend: str
    """The backend (class or factory) that was run."""
    prefill_tp: int
    """Prefill ranks."""
    decode_tp: int
    """Decode ranks."""
    notifications: bool
    """The prefill writers signal arrival by the engine's notification (else by a
    ``CHUNK_READY`` message)."""
    rooms: tuple[RoomReport, ...]
    """One report per room, in room order."""
    decode_stats: tuple[StagingStats, ...]
    """Each decode manager's staging counters at the end."""
    prefill_stats: tuple[StagingStats, ...]
    """Each prefill manager's staging counters at the end."""
    stray_pages: int
    """Decode pages outside every room that were written (must be 0)."""
    elapsed_s: float
    """Seconds from the first room to the last verdict (teardown excluded)."""
    timeout_s: float
    """The bound the run was given."""

    @property
    def ok(self) -> bool:
        """Every room succeeded and nothing was written outside them."""
        return self.stray_pages == 0 and all(room.succeeded for room in self.rooms)

    @property
    def failed(self) -> tuple[RoomReport, ...]:
        """The rooms that did not succeed."""
        return tuple(room for room in self.rooms if not room.succeeded)

    def diagnosis(self) -> str | None:
        """The likely cause of the failure, then each failed room; ``None`` when :attr:`ok`.

        The causes, checked in this order: decode's listener handed no staging message to
        the mixin; prefill recorded no answer to its requests; no arrival reached decode
        though the writes were done (by notification: the idle hook; by ``CHUNK_READY``: the
        message routing); rooms that reported success with wrong bytes; otherwise the rooms'
        own reasons.
        """
        if self.ok:
            return None
        cause = self._cause()
        lines = [cause] if cause else []
        lines.extend(room.line() for room in self.failed)
        if self.stray_pages:
            lines.append(f"{self.stray_pages} decode page(s) outside every room were written")
        return "\n".join(lines)

    def _cause(self) -> str | None:
        received = sum(s.received for s in self.decode_stats)
        allocated = sum(s.allocated for s in self.decode_stats)
        arrivals = sum(room.arrivals for room in self.rooms)
        answers = sum(s.responses for s in self.prefill_stats)
        written = any(
            state is KVPoll.Success for room in self.rooms for state in room.prefill_states
        )
        if received == 0:
            return (
                "decode's staging handler got no message at all: is the decode listener "
                "started, and does its _on_message hand staging messages to "
                "self._dispatch_staging?"
            )
        if allocated and answers == 0:
            return (
                "decode allocated ring regions but prefill recorded no STAGING_RSP: does the "
                "prefill manager's _on_message hand staging messages to self._dispatch_staging?"
            )
        if arrivals == 0 and (written or allocated):
            done = "the writes were done" if written else "regions were allocated"
            if self.notifications:
                return f"no arrivals were delivered at all ({done}): {IDLE_HOOK_HINT}"
            return (
                f"writes landed but no CHUNK_READY arrived ({done}): does the decode "
                "manager's _on_message hand CHUNK_READY to self._dispatch_staging?"
            )
        wrong = [
            room.room
            for room in self.rooms
            if all(s is KVPoll.Success for s in room.decode_states)
            and room.chunks_verified < room.chunks
        ]
        if wrong:
            return (
                f"rooms {wrong} reported success but their decode pages do not hold the "
                "staged bytes: the engine's write or the scatter moved the wrong bytes"
            )
        return None

    def summary(self) -> str:
        """A few lines for a test failure or a log: the run, each room, the diagnosis."""
        head = (
            f"{self.backend}: prefill TP {self.prefill_tp} -> decode TP {self.decode_tp}, "
            f"{len(self.rooms)} rooms, {'ok' if self.ok else 'FAILED'} in {self.elapsed_s:.2f}s"
        )
        lines = [head, *(f"  {room.line()}" for room in self.rooms)]
        diagnosis = self.diagnosis()
        if diagnosis:
            lines.append(f"diagnosis: {diagnosis}")
        return "\n".join(lines)


@dataclass
class _Room:
    room: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    prefill_pages: tuple[int, ...]
    decode_pages: tuple[int, ...]
    receivers: list[KVReceiver] = field(default_factory=list)
    senders: list[KVSender] = field(default_factory=list)
    decode_states: tuple[KVPoll, ...] = ()
    prefill_states: tuple[KVPoll, ...] = ()
    reason: str | None = None


class _ArrivalTally:
    """Writer arrivals per room, counted as the decode handler accepts them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}

    def tap(self, handler: DecodeStagingHandler) -> None:
        """Count the arrivals ``handler`` accepts (the listener thread calls it)."""
        accept = handler.handle_chunk_arrival

        def counted(
            room: int,
            chunk_idx: int,
            *,
            page_start: int,
            num_pages: int,
            session_id: str,
            writer_rank: int | None,
        ) -> ArrivalOutcome:
            outcome = accept(
                room,
                chunk_idx,
                page_start=page_start,
                num_pages=num_pages,
                session_id=session_id,
                writer_rank=writer_rank,
            )
            if outcome in (ArrivalOutcome.WAITING, ArrivalOutcome.COMPLETE):
                with self._lock:
                    self._counts[room] = self._counts.get(room, 0) + 1
            return outcome

        # Only on the handler the harness itself made: the mixin calls it through the
        # attribute, so this counts exactly what the mixin delivered, changing nothing.
        handler.handle_chunk_arrival = counted  # type: ignore[method-assign]

    def count(self, room: int) -> int:
        """Arrivals counted for ``room`` so far."""
        with self._lock:
            return self._counts.get(room, 0)


def _backend_name(backend: ManagerFactory) -> str:
    """``module.QualName`` of a class or function, else the factory's ``repr``."""
    name = getattr(backend, "__qualname__", None)
    module = getattr(backend, "__module__", None)
    if isinstance(backend, type) or inspect.isfunction(backend) or inspect.ismethod(backend):
        return f"{module}.{name}"
    return repr(backend)


def run_transfer(
    backend: ManagerFactory,
    *,
    prefill_tp: int = 2,
    decode_tp: int = 1,
    rooms: int = 3,
    geometry: TransferGeometry | None = None,
    timeout_s: float = 30.0,
    seed: int = 0,
) -> TransferReport:
    """Stage ``rooms`` multi-chunk requests from ``prefill_tp`` to ``decode_tp`` ranks.

    Args:
        backend: a backend class with the standard constructor, or any
            :class:`ManagerFactory`; called once per rank.
        prefill_tp: prefill ranks (attention TP size of prefill).
        decode_tp: decode ranks.
        rooms: requests, all in flight at once.
        geometry: sizes (default :class:`TransferGeometry`'s).
        timeout_s: bound on the whole transfer; rooms still running then fail as timed out.
        seed: seed of the KV data and page choice.

    Returns:
        The per-room report (see :attr:`TransferReport.ok` and
        :meth:`TransferReport.diagnosis`).

    Raises:
        ValueError: the TP pair does not fit the head count, or the rooms do not fit the
            pools.
        Exception: whatever the factory, the staging set-up or the engine wiring raised; every
            manager built so far is closed first.
    """
    g = geometry or TransferGeometry()
    validate_tp_pair(prefill_tp, decode_tp, g.total_kv_heads)
    if rooms < 1 or timeout_s <= 0:
        raise ValueError(f"rooms={rooms} must be >= 1 and timeout_s={timeout_s} > 0")
    if 2 * rooms * g.room_pages > g.pool_pages:
        raise ValueError(
            f"{rooms} rooms of {g.room_pages} pages need {2 * rooms * g.room_pages} pool pages "
            f"(prefill and decode pages apart), the pools have {g.pool_pages}"
        )
    name = _backend_name(backend)
    stack = ExitStack()  # closes, last first: prefill workers, then decode and prefill managers
    try:
        prefill: list[TransferManager] = []
        decode: list[TransferManager] = []
        sides = ((Role.PREFILL, prefill_tp, prefill), (Role.DECODE, decode_tp, decode))
        for role, tp, made in sides:
            for rank in range(tp):
                manager = backend(g.kv_args(tp, rank), role=role, attn_tp_size=tp)
                stack.callback(manager.close)
                made.append(manager)
        logger.debug("%s: %d prefill and %d decode managers built", name, prefill_tp, decode_tp)
        run = _Run(g, prefill, decode, timeout_s, stack)
        run.execute(rooms, seed)
    finally:
        stack.close()
    report = run.report(name)
    logger.log(logging.DEBUG if report.ok else logging.WARNING, "%s", report.summary())
    return report


class _Run:
    """One harness run over built managers (closed by the caller's stack)."""

    def __init__(
        self,
        geometry: TransferGeometry,
        prefill: list[TransferManager],
        decode: list[TransferManager],
        timeout_s: float,
        stack: ExitStack,
    ) -> None:
        g = geometry
        self.g = g
        self.prefill = prefill
        self.decode = decode
        self.timeout_s = timeout_s
        self.tally = _ArrivalTally()
        self.prefill_pools = [g.empty_pool(len(prefill), p) for p in range(len(prefill))]
        self.decode_pools = [g.empty_pool(len(decode), d) for d in range(len(decode))]
        self.handlers: list[DecodeStagingHandler] = []
        for manager, pool in zip(decode, self.decode_pools, strict=True):
            handler = enable_decode_staging(
                manager, kv_buffers=pool, ring_bytes=g.ring_bytes, stall_timeout_s=timeout_s
            )
            self.tally.tap(handler)
            self.handlers.append(handler)
        timeouts = PrefillTimeouts(deadline_s=timeout_s)
        self.writers = writers = [
            enable_prefill_staging(
                manager, kv_buffers=pool, max_chunk_pages=g.chunk_pages, timeouts=timeouts
            )
            for manager, pool in zip(prefill, self.prefill_pools, strict=True)
        ]
        everyone = [*prefill, *decode]
        for manager in everyone:
            for peer in everyone:
                if peer is not manager:
                    manager.trust_peer(peer.endpoint, peer.curve_key)
        for manager in everyone:
            manager.start()
        for sender in prefill:
            for receiver in decode:
                sender.engine.add_peer(receiver.engine.session_id, receiver.engine.metadata())
        self.targets = [
            DecodeTarget(
                d, m.engine.session_id, m.endpoint, handler.allocator.base_ptr, g.ring_bytes
            )
            for d, (m, handler) in enumerate(zip(decode, self.handlers, strict=True))
        ]
        self.prefill_transfers = [
            PrefillTransfers(m, w, meta_timeout_s=timeout_s)
            for m, w in zip(prefill, writers, strict=True)
        ]
        for transfers in self.prefill_transfers:
            stack.callback(transfers.close, _TEARDOWN_S)
        endpoints = [m.endpoint for m in prefill]
        self.decode_transfers = [
            DecodeTransfers(m, h, endpoints) for m, h in zip(decode, self.handlers, strict=True)
        ]
        self.rooms: list[_Room] = []
        self.elapsed_s = 0.0
        self.notifications = False

    # ------------------------------------------------------------------ the rooms

    def _make_room(self, index: int, generator: torch.Generator, free: list[int]) -> _Room:
        g = self.g
        tokens = g.room_pages * g.page_size
        shape = (tokens, g.total_kv_heads, g.head_dim)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
            torch.empty((), dtype=g.dtype).element_size()
        ]
        low, high = (0, 255) if bits is torch.uint8 else (-(2**14), 2**14)

        def data() -> torch.Tensor:
            raw = torch.randint(low, high, shape, generator=generator)
            return raw.to(bits).view(g.dtype)

        prefill_pages = tuple(free[: g.room_pages])
        decode_pages = tuple(free[g.room_pages : 2 * g.room_pages])
        del free[: 2 * g.room_pages]
        return _Room(
            _ROOM_BASE + index,
            [data() for _ in range(g.num_layers)],
            [data() for _ in range(g.num_layers)],
            prefill_pages,
            decode_pages,
        )

    def _place(
        self, pool: KVBufferTensors, room: _Room, pages: Sequence[int], heads: list[int]
    ) -> None:
        ps = pool.page_size
        index = torch.tensor([p * ps + t for p in pages for t in range(ps)], dtype=torch.int64)
        for layer in range(len(pool.k_buffers)):
            pool.k_buffers[layer][index] = room.k[layer][:, heads]
            pool.v_buffers[layer][index] = room.v[layer][:, heads]

    def _start_room(self, room: _Room) -> None:
        g = self.g
        for decode_side in self.decode_transfers:
            receiver = KVReceiver(decode_side, room.room)
            receiver.init(room.decode_pages, chunk_pages=g.chunk_pages)
            room.receivers.append(receiver)
        for receiver in room.receivers:
            receiver.send_metadata()
        for prefill_side in self.prefill_transfers:
            sender = KVSender(prefill_side, room.room)
            sender.init(g.room_pages, self.targets)
            room.senders.append(sender)
        starts = range(0, g.room_pages, g.chunk_pages)
        for start in starts:
            pages = room.prefill_pages[start : start + g.chunk_pages]
            last = start + g.chunk_pages >= g.room_pages
            for sender in room.senders:
                sender.send(pages, last=last)

    def execute(self, count: int, seed: int) -> None:
        """Run ``count`` rooms to the end or the deadline; note each rank's verdict, then fail
        the rooms still running (the managers are still open)."""
        g = self.g
        generator = torch.Generator().manual_seed(seed)
        free = torch.randperm(g.pool_pages, generator=generator).tolist()
        self.rooms = [self._make_room(i, generator, free) for i in range(count)]
        for room in self.rooms:
            for p, pool in enumerate(self.prefill_pools):
                self._place(pool, room, room.prefill_pages, g.heads(len(self.prefill), p))
        started = time.monotonic()
        deadline = started + self.timeout_s
        for room in self.rooms:
            self._start_room(room)
        for room in self.rooms:
            for receiver in room.receivers:
                receiver.wait(max(0.0, deadline - time.monotonic()))
            for sender in room.senders:
                sender.wait(max(0.0, deadline - time.monotonic()))
        self.elapsed_s = time.monotonic() - started
        for room in self.rooms:
            room.decode_states = tuple(r.poll() for r in room.receivers)
            room.prefill_states = tuple(s.poll() for s in room.senders)
            room.reason = self._reason(room)
        self.notifications = all(w.arrival == "notification" for w in self.writers)
        self._fail_unfinished()

    def report(self, name: str) -> TransferReport:
        """The report, built once every manager is closed (no arrival or scatter is late)."""
        return TransferReport(
            backend=name,
            prefill_tp=len(self.prefill),
            decode_tp=len(self.decode),
            notifications=self.notifications,
            rooms=tuple(self._report(room) for room in self.rooms),
            decode_stats=tuple(m.staging_stats() for m in self.decode),
            prefill_stats=tuple(m.staging_stats() for m in self.prefill),
            stray_pages=self._stray_pages(),
            elapsed_s=self.elapsed_s,
            timeout_s=self.timeout_s,
        )

    # ------------------------------------------------------------------ verdicts

    def _chunk_ok(self, room: _Room, start: int) -> bool:
        g = self.g
        pages = room.decode_pages[start : start + g.chunk_pages]
        tokens = torch.tensor(
            [p * g.page_size + t for p in pages for t in range(g.page_size)], dtype=torch.int64
        )
        rows = slice(start * g.page_size, (start + len(pages)) * g.page_size)
        for d, pool in enumerate(self.decode_pools):
            heads = g.heads(len(self.decode), d)
            for layer in range(g.num_layers):
                for got, want in (
                    (pool.k_buffers[layer][tokens], room.k[layer][rows][:, heads]),
                    (pool.v_buffers[layer][tokens], room.v[layer][rows][:, heads]),
                ):
                    if not torch.equal(_bits(got), _bits(want)):
                        return False
        return True

    def _report(self, room: _Room) -> RoomReport:
        g = self.g
        verified = sum(
            self._chunk_ok(room, start) for start in range(0, g.room_pages, g.chunk_pages)
        )
        writers = sum(
            len(_writers(len(self.prefill), len(self.decode), d)) for d in range(len(self.decode))
        )
        reason = room.reason
        if reason is None and verified < g.chunks_per_room:
            reason = (
                f"every rank reported success but {g.chunks_per_room - verified} chunk(s) do "
                "not hold the staged bytes"
            )
        return RoomReport(
            room=room.room,
            succeeded=reason is None,
            reason=reason,
            decode_states=room.decode_states,
            prefill_states=room.prefill_states,
            chunks=g.chunks_per_room,
            chunks_verified=verified,
            arrivals=self.tally.count(room.room),
            expected_arrivals=g.chunks_per_room * writers,
        )

    def _reason(self, room: _Room) -> str | None:
        """Why the room did not succeed on every rank (``None`` if it did)."""
        decode_states, prefill_states = room.decode_states, room.prefill_states
        if all(s is KVPoll.Success for s in (*decode_states, *prefill_states)):
            return None
        for d, receiver in enumerate(room.receivers):
            if decode_states[d] is KVPoll.Failed:
                return f"decode rank {d}: {receiver.failure() or 'failed'}"
        for p, sender in enumerate(room.senders):
            if prefill_states[p] is KVPoll.Failed:
                return f"prefill rank {p}: {sender.failure() or 'failed'}"
        states = ", ".join(
            [f"decode {d} {s.name}" for d, s in enumerate(decode_states)]
            + [f"prefill {p} {s.name}" for p, s in enumerate(prefill_states)]
        )
        return f"timed out after {self.timeout_s:g}s ({states})"

    def _stray_pages(self) -> int:
        used = {page for room in self.rooms for page in room.decode_pages}
        others = [p for p in range(self.g.pool_pages) if p not in used]
        if not others:
            return 0
        ps = self.g.page_size
        index = torch.tensor([p * ps + t for p in others for t in range(ps)], dtype=torch.int64)
        stray: set[int] = set()
        for pool in self.decode_pools:
            for tensor in (*pool.k_buffers, *pool.v_buffers):
                rows = _bits(tensor[index]).reshape(len(others), -1)
                stray.update(others[i] for i in torch.nonzero(rows.any(dim=1)).flatten().tolist())
        return len(stray)

    def _fail_unfinished(self) -> None:
        """Fail every room still running, on decode and (through ROOM_FAILED) on prefill, so
        that the prefill workers drop its chunks and stop promptly."""
        unfinished: list[KVSender] = []
        for room in self.rooms:
            for d, receiver in enumerate(room.receivers):
                if receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
                    self.handlers[d].fail_room(room.room, "the harness's time ran out")
                    receiver.poll()  # reports the failure to its prefill ranks
            unfinished.extend(
                s for s in room.senders if s.poll() not in (KVPoll.Success, KVPoll.Failed)
            )
        deadline = time.monotonic() + _TEARDOWN_S
        for sender in unfinished:
            sender.wait(max(0.0, deadline - time.monotonic()))


def _writers(prefill_tp: int, decode_tp: int, decode_rank: int) -> range:
    """The prefill ranks that write into a decode rank (from first principles)."""
    if prefill_tp >= decode_tp:
        per = prefill_tp // decode_tp
        return range(decode_rank * per, (decode_rank + 1) * per)
    return range(
        decode_rank // (decode_tp // prefill_tp), decode_rank // (decode_tp // prefill_tp) + 1
    )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    element = tensor.element_size()
    return tensor.contiguous().view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[element]
    )
