"""The per-request API, in the style of the serving stack: ``KVSender``, ``KVReceiver``, ``KVPoll``.

Prefill: ``KVSender(transfers, room)``; ``init(num_pages)``; ``send(pages, last=...)`` once per
chunk of the chunked prefill; ``poll()``. Decode: ``KVReceiver(transfers, room)``;
``init(page_indices, chunk_pages=...)`` registers the room; ``send_metadata()`` tells the
prefill ranks it is ready; ``poll()``.

:class:`PrefillTransfers` owns the prefill worker thread that stages queued chunks one at a
time, taking first the oldest chunk whose decode regions are writable now (so a chunk waiting
for ring space never blocks one that could go: no circular wait between rooms);
:class:`DecodeTransfers` ties receivers to the decode handler. Both route the
per-request control messages (``ROOM_META``, ``ROOM_FAILED``, ``ROOM_FAILED_ACK``) through
the manager's listener. ``ROOM_FAILED`` names the decode rank's opening of the room (from its
``ROOM_META``) and is re-sent until acknowledged (see
:mod:`~staging_contracts._control.room_messages`); one naming another opening is ignored and
counted in ``stale_room_failed``.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from .. import config
from .._control.resend import ResendBox
from .._control.room_messages import RoomFailed, RoomFailedAck, RoomMeta
from .._control.transport import SocketsClosed
from .._decode.handler import (
    ROOM_FAILED_COPIES,
    ROOM_FAILED_MAX_INTERVAL_S,
    DecodeStagingHandler,
    RoomPlan,
    RoomStatus,
    peers_for,
)
from .._prefill.writer import ChunkSpec, DecodeTarget, StagingFailed, StagingWriter
from ..outcomes import (
    FailureReason,
    Outcome,
    RoomEnd,
    RoomFailure,
    TransferRecord,
    classify,
)
from ..protocols import KVArgs
from ..stats import RoomTally, RoomTallySnapshot
from ..tracing import room_tracer
from ._drain import join_drain

__all__ = ["DecodeTransfers", "KVPoll", "KVReceiver", "KVSender", "PrefillTransfers"]

logger = logging.getLogger(__name__)


class KVPoll(enum.IntEnum):
    """State of one request's transfer (values as in the reference)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class ControlHost(Protocol):
    """What the per-request layer needs of a manager (``CommonKVManager`` provides it)."""

    @property
    def kv_args(self) -> KVArgs: ...

    def register_control(self, kind: bytes, handler: Callable[[list[bytes]], None]) -> None: ...

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool: ...

    def add_authorizer(self, authorizer: Callable[[list[bytes], str], bool]) -> None: ...


# --------------------------------------------------------------------------- prefill


@dataclass
class _SendState:
    num_pages: int
    decode: tuple[DecodeTarget, ...] = ()
    """Every decode rank of the request (known from ``init``)."""
    fed: frozenset[int] | None = None
    """Decode ranks this prefill rank writes to (``None`` until ``init``)."""
    ready: set[int] = field(default_factory=set)
    chunk_pages: int | None = None
    prefetched: bool = False
    submitted_pages: int = 0
    chunks: int = 0
    pending: int = 0
    last_submitted: bool = False
    status: KVPoll = KVPoll.Bootstrapping
    failure: str | None = None
    kind: FailureReason | None = None
    """Why it failed, typed where it failed (set with ``failure``)."""
    openings: dict[int, int] = field(default_factory=dict)
    """Decode rank -> its opening of the room (from its ``ROOM_META``)."""
    told: set[int] = field(default_factory=set)
    """Decode ranks sent this room's ``ROOM_FAILED`` (once its opening was known)."""
    opened: float = field(default_factory=time.monotonic)
    """When ``open_room`` created it (its first ``STAGING_REQ`` goes out then), for latency."""
    ended: bool = False
    """Its end was counted in the room tally."""
    ended_at: tuple[float, float] | None = None
    """When it succeeded or failed (``time.monotonic()``, ``time.time()``)."""
    chunks_written: int = 0
    """Chunks this rank wrote for the room (every decode rank's share of each)."""
    bytes_written: int = 0
    """Bytes this rank wrote for the room, over every decode rank it feeds."""


CLOSED_IN_FLIGHT: Final = "draining: the transfers closed with the room in flight"
"""The failure reason of a room still in flight when :meth:`PrefillTransfers.close` ran."""


@dataclass
class _Job:
    """One queued chunk of a room, as the worker sees it."""

    room: int
    chunk: ChunkSpec
    queued: float
    """When it was queued (its ``ROOM_META`` wait starts then)."""
    opened: _SendState
    """The room as it was open when the chunk was queued: once that room was closed the job
    is dropped, even if the room id was opened again since (it is not the new room's)."""
    deadline: float | None = None
    """Give up when no progress by then (set once the room is ready; extended on progress)."""
    marker: tuple[object, ...] = ()
    """What progress looked like at the last check (answers and watermarks)."""
    asked: float = 0.0
    """When ``STAGING_REQ`` was last re-sent for it."""


DEFAULT_EARLY_META_PER_PEER: Final = config.EARLY_META_PER_PEER.default
"""Most ``ROOM_META`` for rooms not opened yet that prefill holds per sender (decode rank, or
everyone alike without a secret); past it the oldest of that sender's is dropped."""


@dataclass(frozen=True, slots=True)
class _EarlyMeta:
    """A ``ROOM_META`` that came before its room was opened: held, not applied."""

    meta: RoomMeta
    sender: str | None
    received: float


WORKER_SLICE_S: Final = 0.01
"""The worker re-checks waiting chunks at least this often (and at once when decode answers,
a watermark moves, a room is lost or a chunk is queued)."""


class PrefillTransfers:
    """Prefill side: queued chunks staged by one worker thread.

    The worker writes one chunk at a time, the oldest one whose regions are writable now (in
    submission order when all are): a chunk whose region waits for ring space never blocks
    another room's chunk that could free that space. A chunk that waits re-requests its
    region every ``answer_s``; it fails after ``deadline_s`` without progress (no answer, no
    movement of its decode rings' watermarks), or at once when decode fences its room or a
    decode rank it feeds is declared dead. Any error while staging a chunk fails that room
    only, with the error named; the worker lives on.

    **Side:** prefill. **Thread-safety:** senders may be used from any thread; the listener
    thread delivers ``ROOM_META`` and ``ROOM_FAILED``.

    **ROOM_META before the room is opened** (decode was quicker than this rank's
    ``KVSender.init``) creates no room: it is held aside, at most ``early_meta_per_peer`` per
    sender (the oldest of that sender's go first) and for ``meta_timeout_s``, and applied when
    the room is opened, only if it came from the decode rank it names (with a secret, read from
    the manager's ``message_sender()``, which ``CommonKVManager`` has; a host without it is
    taken as unauthenticated); the others are dropped and counted in
    :attr:`early_meta_dropped`. So nobody can pre-fail
    another tenant's room, and a flood of them costs a bounded amount of memory.

    Args:
        manager: the prefill manager (its listener must route control messages).
        writer: the rank's staging writer.
        meta_timeout_s: how long a chunk waits for decode's ``ROOM_META`` before the room
            fails; also how long an early ``ROOM_META`` is held (``None``:
            ``STAGING_CONTRACTS_META_TIMEOUT_S``, else 30 s; see :mod:`~staging_contracts.config`).
        early_meta_per_peer: most early ``ROOM_META`` held per sender (``None``:
            ``STAGING_CONTRACTS_EARLY_META_PER_PEER``, else 256).

    **Drain.** It joins the manager's drain gate (``CommonKVManager.close(drain_s=...)``):
    while the manager drains, :meth:`open_room` fails each new room at once (reason
    ``refused: the manager is draining``), and the rooms still in flight when the drain's
    time ran out fail and tell decode.

    Raises:
        ConfigError: a variable read for an argument left ``None`` is unusable.
    """

    def __init__(
        self,
        manager: ControlHost,
        writer: StagingWriter,
        *,
        meta_timeout_s: float | None = None,
        early_meta_per_peer: int | None = None,
    ) -> None:
        meta_timeout_s = config.META_TIMEOUT_S.value(meta_timeout_s)
        early_meta_per_peer = config.EARLY_META_PER_PEER.value(early_meta_per_peer)
        self._manager = manager
        self._writer = writer
        self._meta_timeout = meta_timeout_s
        self._cond = threading.Condition()
        self._rooms: dict[int, _SendState] = {}
        self._early_cap = early_meta_per_peer
        sender_of = getattr(manager, "message_sender", None)
        self._sender_of: Callable[[], str | None] | None = (
            sender_of if callable(sender_of) else None
        )
        self._early: dict[str | None, OrderedDict[tuple[int, int], _EarlyMeta]] = {}
        """Sender -> its early ROOM_META by (room, decode rank), oldest first (lock held)."""
        self._early_rooms: dict[int, set[tuple[str | None, int]]] = {}
        """Room -> (sender, decode rank) of each early ROOM_META held for it (lock held)."""
        self.early_meta_held = 0
        """Early ``ROOM_META`` received (each held until applied at open, replaced by a copy
        decode sent again, or dropped)."""
        self.early_meta_dropped = 0
        """Early ``ROOM_META`` dropped: evicted past the cap, expired, or (with a secret) not
        from the decode rank it names once the room opened."""
        self._endpoint: str = getattr(manager, "endpoint", "")
        self._failed_resend = ResendBox(
            time.monotonic, backoff=2.0, max_interval_s=ROOM_FAILED_MAX_INTERVAL_S
        )
        """``ROOM_FAILED`` copies to decode ranks, until acknowledged, spent, or their decode
        rank is declared dead by the manager's peer liveness (they go on after
        ``close_room``: the opening they name keeps them from failing a later one)."""
        self.stale_room_failed = 0
        """``ROOM_FAILED`` received for an opening that is not one of the room's (ignored)."""
        self._tally = RoomTally()
        """Rooms ended here, by outcome and reason, with latencies (``_cond`` held)."""
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._tracer = room_tracer("prefill")
        """Spans of the rooms, when a tracer provider is configured (else ``None``)."""
        self._refusal: tuple[str, Callable[[int], None]] | None = None
        """Set by a drain: every room opened from then on fails at once with this reason."""
        manager.register_control(RoomMeta.KIND, self._on_room_meta)
        manager.register_control(RoomFailed.KIND, self._on_room_failed)
        manager.register_control(RoomFailedAck.KIND, self._on_room_failed_ack)
        writer.on_idle(self._flush_room_failed)
        manager.add_authorizer(self._authorize)
        writer.on_room_lost(self._on_room_lost)
        # A decode rank declared dead hears no more ROOM_FAILED copies (nor acknowledges).
        liveness = getattr(manager, "liveness", None)
        subscribe = getattr(liveness, "subscribe", None)
        if callable(subscribe):
            subscribe(self._failed_resend.cancel_endpoint)
        self._wakeup = threading.Event()
        """Set when a waiting chunk may be able to go: an answer, a watermark, a new job."""
        writer.on_progress(self._wakeup.set)
        join_drain(manager, self)
        rank = manager.kv_args.engine_rank
        self._thread = threading.Thread(
            target=self._run, name=f"prefill-transfer-{rank}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ senders' calls

    def open_room(self, room: int, num_pages: int, decode: Sequence[DecodeTarget]) -> None:
        """Start tracking a room (``KVSender.init``).

        This is also how a room id is used again after :meth:`close_room`: the writer's
        ``track_room`` below opens it again (until then the writer refuses the closed room).

        Args:
            room: the request's room.
            num_pages: pages of the request.
            decode: every decode rank of the request, indexed by TP rank (from bootstrap).
        """
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be >= 1")
        targets = tuple(decode)
        fed = frozenset(t.tp_rank for t in self._writer.targets_of(targets))
        with self._cond:
            state = self._rooms.setdefault(room, _SendState(num_pages))
            if self._tracer is not None:
                self._tracer.start(room)
            state.decode = targets
            state.fed = fed
            for meta in self._take_early(room, targets):
                state.chunk_pages = meta.chunk_pages
                state.ready.add(meta.decode_rank)
                if meta.opening:
                    state.openings[meta.decode_rank] = meta.opening
                if meta.num_pages != num_pages:  # decode's ROOM_META came first and disagrees
                    self._fail(
                        room, state, f"decode expects {meta.num_pages} pages, prefill {num_pages}"
                    )
                    return
            if self._refusal is not None:
                reason, refused = self._refusal
                refused(room)
                self._fail(room, state, reason, FailureReason.DRAINING)
                return
            self._check_meta(state)
            prefetch = self._take_prefetch(state)
            self._cond.notify_all()
        # Watch the decode ranks from now on: one that dies before its ROOM_META fails the
        # room within the liveness bound, not at the ROOM_META timeout.
        self._writer.track_room(room, self._writer.targets_of(targets))
        self._prefetch(room, prefetch)

    def submit(self, room: int, pages: Sequence[int], last: bool) -> None:
        """Queue the next chunk of a room (``KVSender.send``)."""
        with self._cond:
            state = self._rooms.get(room)
            if state is None:
                raise KeyError(f"room {room} was not initialised")
            if state.last_submitted:
                raise ValueError(f"room {room}: a chunk after the last one")
            chunk = ChunkSpec(state.chunks, state.submitted_pages, tuple(pages))
            state.chunks += 1
            state.submitted_pages += len(pages)
            state.pending += 1
            state.last_submitted = last
            if state.status in (KVPoll.Bootstrapping, KVPoll.WaitingForInput):
                state.status = KVPoll.Transferring
        self._jobs.put(_Job(room, chunk, time.monotonic(), state))
        self._wakeup.set()

    def status(self, room: int) -> tuple[KVPoll, str | None]:
        """The room's state and failure reason."""
        with self._cond:
            state = self._rooms.get(room)
            if state is None:
                return KVPoll.Failed, "unknown room"
            return state.status, state.failure

    def failure_of(self, room: int) -> RoomFailure | None:
        """Why the room failed, typed where it failed (``None``: it did not, or unknown)."""
        with self._cond:
            state = self._rooms.get(room)
            if state is None or state.failure is None:
                return None
            return RoomFailure(state.kind or classify(state.failure), state.failure)

    def room_end(self, room: int) -> RoomEnd | None:
        """How the room ended, stamped then (``None``: not ended, or unknown room).
        **Called by:** :meth:`KVSender.get_transfer_metric`, any thread."""
        with self._cond:
            state = self._rooms.get(room)
            if state is None or state.ended_at is None:
                return None
            failure = None
            if state.status is not KVPoll.Success:
                detail = state.failure or ""
                failure = RoomFailure(state.kind or classify(detail), detail)
            return RoomEnd(
                state.status is KVPoll.Success,
                failure,
                *state.ended_at,
                state.chunks_written,
                state.bytes_written,
            )

    def written(self, room: int) -> tuple[int, int] | None:
        """``(chunks, bytes)`` this rank wrote for the room so far (``None``: unknown room).
        **Called by:** :meth:`KVSender.get_transfer_metric`, any thread."""
        with self._cond:
            state = self._rooms.get(room)
            return None if state is None else (state.chunks_written, state.bytes_written)

    def wait(self, room: int, timeout_s: float) -> tuple[KVPoll, str | None]:
        """Block until the room succeeded or failed, or ``timeout_s`` passed; then
        :meth:`status`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                state = self._rooms.get(room)
                if state is None or state.status in (KVPoll.Success, KVPoll.Failed):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
        return self.status(room)

    def close_room(self, room: int) -> None:
        """Forget a finished or failed room (``KVSender.release``; any thread).

        The writer forgets it too and refuses it until :meth:`open_room` opens the id again:
        a chunk of it that the worker already took fails at once ("the room was closed")
        instead of waiting up to ``deadline_s`` for answers that were dropped, and a late
        prefetch of it neither asks decode nor watches its ranks again.
        """
        with self._cond:
            self._rooms.pop(room, None)
            if self._tracer is not None:  # still open: released before it ended
                self._tracer.end(room, "released before it finished", FailureReason.RELEASED_EARLY)
        self._writer.forget_room(room)

    def rooms_in_flight(self) -> frozenset[int]:
        """The rooms opened and neither succeeded nor failed (for a drain; any thread)."""
        with self._cond:
            done = (KVPoll.Success, KVPoll.Failed)
            return frozenset(room for room, st in self._rooms.items() if st.status not in done)

    def abandon_room(self, room: int, reason: str) -> None:
        """Fail a room still in flight and tell its decode ranks (``ROOM_FAILED``); its
        queued chunks are dropped. **Called by:** the drain gate, any thread."""
        with self._cond:
            state = self._rooms.get(room)
            if state is not None and state.status not in (KVPoll.Success, KVPoll.Failed):
                self._fail(room, state, reason)
        self._wakeup.set()

    def refuse_new_rooms(self, reason: str, refused: Callable[[int], None]) -> None:
        """From now on :meth:`open_room` fails each new room at once with ``reason`` and
        calls ``refused(room)`` (lock held). **Called by:** the drain gate."""
        with self._cond:
            self._refusal = (reason, refused)

    @property
    def writer(self) -> StagingWriter:
        """The rank's staging writer (its ``bytes_written`` and ``chunks_written``)."""
        return self._writer

    def room_tally(self) -> RoomTallySnapshot:
        """How rooms ended on this rank so far; a success's latency runs from ``open_room``
        (when the first ``STAGING_REQ`` goes out) to its last chunk's write.

        **Called by:** monitoring, any thread.
        """
        with self._cond:
            return self._tally.snapshot()

    def _ended(self, state: _SendState) -> None:
        """Count a room that just succeeded or failed, once (lock held)."""
        if state.ended:
            return
        state.ended = True
        state.ended_at = (time.monotonic(), time.time())
        if state.status is KVPoll.Success:
            self._tally.ended(Outcome.SUCCESS, latency_s=state.ended_at[0] - state.opened)
        else:
            kind = state.kind or classify(state.failure or "")
            self._tally.ended(Outcome.FAILED, kind)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker after the queued chunks, then fail the rooms still in flight
        (reason :data:`CLOSED_IN_FLIGHT`, *draining*: their spans end and they are counted);
        safe to call twice."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout)
        with self._cond:
            done = (KVPoll.Success, KVPoll.Failed)
            for room, state in list(self._rooms.items()):
                if state.status not in done:
                    self._fail(room, state, CLOSED_IN_FLIGHT, FailureReason.DRAINING)

    # ------------------------------------------------------------------ listener thread

    def _on_room_meta(self, frames: list[bytes]) -> None:
        meta = RoomMeta.from_frames(frames)
        if self._writer.closed(meta.room):
            # A late copy of a closed room's ROOM_META (decode re-sends it): nothing to keep.
            # A new opening's is sent again until it is heard, after open_room opened it.
            return
        with self._cond:
            state = self._rooms.get(meta.room)
            if state is None:
                sender = None if self._sender_of is None else self._sender_of()
                self._hold_early(meta, sender)
                return
            state.chunk_pages = meta.chunk_pages
            state.ready.add(meta.decode_rank)
            if meta.opening:
                state.openings[meta.decode_rank] = meta.opening
            if state.status is KVPoll.Failed:  # failed before this rank's opening was known
                self._tell_failed(meta.room, state)
                return
            if meta.num_pages != state.num_pages:
                self._fail(
                    meta.room,
                    state,
                    f"decode expects {meta.num_pages} pages, prefill {state.num_pages}",
                )
                return
            self._check_meta(state)
            prefetch = self._take_prefetch(state)
            self._cond.notify_all()
        self._prefetch(meta.room, prefetch)

    def _hold_early(self, meta: RoomMeta, sender: str | None) -> None:
        """Hold a ROOM_META of a room not opened yet, within its sender's cap (lock held)."""
        now = time.monotonic()
        self._expire_early(now)
        held = self._early.setdefault(sender, OrderedDict())
        key = (meta.room, meta.decode_rank)
        held.pop(key, None)  # a copy decode sent again replaces the one held (and its time)
        held[key] = _EarlyMeta(meta, sender, now)
        self._early_rooms.setdefault(meta.room, set()).add((sender, meta.decode_rank))
        self.early_meta_held += 1
        while len(held) > self._early_cap:
            self._drop_oldest(sender, held)

    def _drop_oldest(
        self, sender: str | None, held: OrderedDict[tuple[int, int], _EarlyMeta]
    ) -> None:
        """Drop a sender's oldest early ROOM_META (lock held)."""
        (room, rank), _ = held.popitem(last=False)
        self.early_meta_dropped += 1
        held_for_room = self._early_rooms.get(room)
        if held_for_room is not None:
            held_for_room.discard((sender, rank))
            if not held_for_room:
                del self._early_rooms[room]

    def _expire_early(self, now: float) -> None:
        """Drop the early ROOM_META held longer than ``meta_timeout_s`` (lock held)."""
        for sender, held in list(self._early.items()):
            while held:
                oldest = next(iter(held.values()))
                if now - oldest.received <= self._meta_timeout:
                    break
                self._drop_oldest(sender, held)
            if not held:
                del self._early[sender]

    def _take_early(self, room: int, targets: Sequence[DecodeTarget]) -> list[RoomMeta]:
        """The held ROOM_META of a room being opened, each from the decode rank it names
        (with a secret; without one, whoever sent it); the rest of the room's are dropped
        (lock held)."""
        self._expire_early(time.monotonic())
        taken: list[RoomMeta] = []
        for sender, rank in self._early_rooms.pop(room, set()):
            held = self._early.get(sender)
            early = None if held is None else held.pop((room, rank), None)
            if held is not None and not held:
                del self._early[sender]
            if early is None:
                continue
            named = targets[rank].endpoint if rank < len(targets) else None
            if sender is None or sender == named:
                taken.append(early.meta)
                continue
            self.early_meta_dropped += 1
            logger.warning(
                "room %d: early ROOM_META naming decode rank %d came from %s: dropped",
                room,
                rank,
                sender,
                extra={"room": room},
            )
        return taken

    @staticmethod
    def _check_meta(state: _SendState) -> None:
        """Move a room to WaitingForInput once every decode rank it feeds is ready (lock held)."""
        ready = state.fed is not None and state.fed <= state.ready
        if ready and state.status is KVPoll.Bootstrapping:
            state.status = KVPoll.WaitingForInput

    def _take_prefetch(self, state: _SendState) -> list[tuple[int, int]] | None:
        """The chunks to prefetch, once, when the room became ready (lock held)."""
        if state.prefetched or state.fed is None or not state.fed <= state.ready:
            return None
        if state.chunk_pages is None or state.status is KVPoll.Failed:
            return None
        state.prefetched = True
        grid = state.chunk_pages
        count = -(-state.num_pages // grid)
        return [(i, min(grid, state.num_pages - i * grid)) for i in range(count)]

    def _prefetch(self, room: int, chunks: list[tuple[int, int]] | None) -> None:
        if chunks is None:
            return
        with self._cond:
            state = self._rooms.get(room)
            decode = state.decode if state is not None else ()
        if decode:
            self._writer.prefetch(room, chunks, decode)

    def _authorize(self, frames: list[bytes], sender: str) -> bool:
        """``ROOM_META`` and ``ROOM_FAILED`` of a room only from its decode ranks (those it
        was opened with); for a room not opened yet the codec and the open check decide."""
        kind = bytes(frames[0]) if frames else b""
        if kind not in (RoomMeta.KIND, RoomFailed.KIND) or len(frames) < 2:
            return True
        if not (frames[1].isdigit() and len(frames[1]) <= 18):
            return True
        with self._cond:
            state = self._rooms.get(int(frames[1]))
            decode = state.decode if state is not None else ()
        if not decode:
            return True
        if kind == RoomMeta.KIND and len(frames) > 2 and frames[2].isdigit():
            rank = int(frames[2])
            return rank < len(decode) and decode[rank].endpoint == sender
        return any(target.endpoint == sender for target in decode)

    def _on_room_failed(self, frames: list[bytes]) -> None:
        message = RoomFailed.from_frames(frames)
        with self._cond:
            state = self._rooms.get(message.room)
            known = set() if state is None else set(state.openings.values())
            stale = state is not None and message.opening != 0 and message.opening not in known
            # A stale one is acknowledged only when this room's opening of every decode rank it
            # feeds is known (else it may be the current opening's, its ROOM_META not heard).
            all_known = state is None or (
                state.fed is not None and state.fed <= set(state.openings)
            )
            targets = () if state is None else tuple(t.endpoint for t in state.decode)
            if stale:
                self.stale_room_failed += 1
        acknowledge = message.opening and self._endpoint and (not stale or all_known)
        if acknowledge and (not targets or message.reply_to in targets):
            ack = RoomFailedAck(message.room, message.opening, self._endpoint)
            self._manager.send(message.reply_to, ack.to_frames())
        if stale:
            logger.info(
                "room %d: ROOM_FAILED of another opening ignored (%s)",
                message.room,
                message.reason,
                extra={"room": message.room},
            )
            return
        self._lose(message.room, f"decode failed the room: {message.reason}")

    def _on_room_failed_ack(self, frames: list[bytes]) -> None:
        ack = RoomFailedAck.from_frames(frames)
        self._failed_resend.ack(ack.room, ack.endpoint, RoomFailed.KIND, ack.opening)

    def _flush_room_failed(self) -> None:
        """Send the ``ROOM_FAILED`` copies that are due (the writer's idle hook)."""
        for endpoint, frames in self._failed_resend.take_due():
            self._manager.send(endpoint, frames)

    @property
    def early_meta_count(self) -> int:
        """Early ``ROOM_META`` held now, over every sender (each within its sender's cap)."""
        with self._cond:
            return sum(len(held) for held in self._early.values())

    @property
    def room_failed_unacked(self) -> int:
        """``ROOM_FAILED`` messages still to be re-sent (not acknowledged yet)."""
        return len(self._failed_resend)

    def _on_room_lost(self, room: int, reason: str) -> None:
        """The writer's news: decode fenced the room, or one of its decode ranks died."""
        self._lose(room, reason)

    def _lose(self, room: int, reason: str, kind: FailureReason | None = None) -> None:
        """Fail a room that the other side gave up or lost (nothing is sent back);
        ``kind``: its reason, ``None`` to read it from ``reason`` (another side's words)."""
        with self._cond:
            state = self._rooms.get(room)
            if state is not None and state.status is not KVPoll.Failed:
                state.status = KVPoll.Failed
                state.failure = reason
                state.kind = kind or classify(reason)
                if self._tracer is not None:
                    self._tracer.end(room, reason, state.kind)
                self._ended(state)
                logger.warning("room %d failed on prefill: %s", room, reason, extra={"room": room})
                self._cond.notify_all()

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        pending: list[_Job] = []
        stopping = False
        while not (stopping and not pending):
            stopping |= self._take_jobs(pending, block=not pending)
            self._wakeup.clear()
            job = self._next_job(pending)
            if job is None:
                self._wakeup.wait(WORKER_SLICE_S)
                continue
            pending.remove(job)
            try:
                self._stage(job)
            except StagingFailed as exc:
                self._fail_job(job, exc.reason, exc.kind)
            except Exception as exc:  # any error fails this room, never the worker
                logger.exception(
                    "room %d chunk %d: staging failed",
                    job.room,
                    job.chunk.chunk_idx,
                    extra={"room": job.room},
                )
                self._fail_job(job, f"chunk {job.chunk.chunk_idx}: {type(exc).__name__}: {exc}")

    def _take_jobs(self, pending: list[_Job], *, block: bool) -> bool:
        """Move queued jobs to ``pending``; ``True`` once ``close`` asked to stop."""
        stop = False
        try:
            item = self._jobs.get() if block else self._jobs.get_nowait()
            while True:
                if item is None:
                    stop = True
                else:
                    pending.append(item)
                item = self._jobs.get_nowait()
        except queue.Empty:
            return stop

    def _fail_job(self, job: _Job, reason: str, kind: FailureReason | None = None) -> None:
        with self._cond:
            state = self._rooms.get(job.room)
            if state is job.opened and state.status is not KVPoll.Failed:
                self._fail(job.room, state, reason, kind)

    def _next_job(self, pending: list[_Job]) -> _Job | None:
        """The oldest job that can go now (or must fail now); re-requests for the others."""
        now = time.monotonic()
        timeouts = self._writer.timeouts
        for job in pending:
            with self._cond:
                state = self._rooms.get(job.room)
                if state is not job.opened or state.status is KVPoll.Failed:
                    return job  # _stage drops it (closed, perhaps opened again, or failed)
                ready = state.fed is not None and state.fed <= state.ready
                decode = state.decode
            if not ready:
                if now - job.queued > self._meta_timeout:
                    return job  # _stage fails it: no ROOM_META
                continue
            if self._writer.chunk_ready(job.room, job.chunk.chunk_idx, decode):
                return job
            marker = (
                *self._writer.ring_marker(decode),
                *self._writer.answers_marker(job.room, job.chunk.chunk_idx, decode),
            )
            if job.deadline is None:
                job.asked = now  # its STAGING_REQ went out with the prefetch
            if job.deadline is None or marker != job.marker:
                job.deadline = now + timeouts.deadline_s
                job.marker = marker
            elif now >= job.deadline:
                return job  # _stage fails it: no progress before the deadline
            if now - job.asked >= min(timeouts.answer_s, timeouts.ready_s):
                self._writer.rerequest(job.room, job.chunk.chunk_idx, len(job.chunk.pages), decode)
                job.asked = now
        return None

    def _stage(self, job: _Job) -> None:
        room, chunk = job.room, job.chunk
        with self._cond:
            state = self._rooms.get(room)
            if state is not job.opened or state.status is KVPoll.Failed:
                return
            if state.fed is None or not state.fed <= state.ready:
                raise StagingFailed(room, "decode never sent ROOM_META", FailureReason.NO_ROOM_META)
            expected = min(state.chunk_pages or 0, state.num_pages - chunk.page_start)
            if len(chunk.pages) != expected:
                raise StagingFailed(
                    room,
                    f"chunk {chunk.chunk_idx} has {len(chunk.pages)} pages, decode's grid of "
                    f"{state.chunk_pages} pages expects {expected}",
                )
            decode = state.decode
        if not self._writer.chunk_ready(room, chunk.chunk_idx, decode):
            raise StagingFailed(
                room,
                f"chunk {chunk.chunk_idx}: no region or ring space for "
                f"{self._writer.timeouts.deadline_s}s without progress",
                FailureReason.TIMEOUT,
            )
        written = self._writer.send_chunk(room, chunk, decode)
        with self._cond:
            state = self._rooms.get(room)
            if state is not job.opened:
                return
            state.pending -= 1
            state.chunks_written += 1
            state.bytes_written += written
            if self._tracer is not None:
                self._tracer.chunk(room, chunk.chunk_idx, len(chunk.pages))
            # The last chunk submitted may be written before an earlier one (the worker
            # takes whichever is writable first): the room is done when none is pending.
            if state.last_submitted and state.status is KVPoll.Transferring and not state.pending:
                state.status = KVPoll.Success
                if self._tracer is not None:
                    self._tracer.end(room, None)
                self._ended(state)
            self._cond.notify_all()

    def _fail(
        self, room: int, state: _SendState, reason: str, kind: FailureReason | None = None
    ) -> None:
        """Fail a room and tell the decode ranks it feeds (lock held); ``kind``: why, where
        the caller knows it (``None``: read from ``reason``)."""
        state.status = KVPoll.Failed
        state.failure = reason
        state.kind = kind or classify(reason)
        if self._tracer is not None:
            self._tracer.end(room, reason, state.kind)
        self._ended(state)
        self._cond.notify_all()
        logger.warning("room %d failed on prefill: %s", room, reason, extra={"room": room})
        self._tell_failed(room, state)

    def _tell_failed(self, room: int, state: _SendState) -> None:
        """Send ``ROOM_FAILED`` to each decode rank the failed room feeds whose opening is
        known and that was not told yet, then again with a bounded backoff until it
        acknowledges (lock held). A rank whose ``ROOM_META`` was not heard yet is told when
        it comes (decode sends it again until this writer is heard from): a ``ROOM_FAILED``
        without an opening could fail a later opening of the room id."""
        for target in state.decode:
            rank = target.tp_rank
            if state.fed is None or rank not in state.fed or rank in state.told:
                continue
            opening = state.openings.get(rank)
            reason = state.failure or ""
            if opening is not None and self._endpoint:
                state.told.add(rank)
                frames = RoomFailed(room, reason, opening, self._endpoint).to_frames()
                self._failed_resend.add(
                    room, target.endpoint, frames, copies=ROOM_FAILED_COPIES, tag=opening
                )
                self._tell(target.endpoint, frames)
            elif rank in state.ready or not self._endpoint:
                # A decode rank that names no opening (an older one), or no listener here to
                # be acknowledged at: sent once, as such peers expect.
                state.told.add(rank)
                self._tell(target.endpoint, RoomFailed(room, reason).to_frames())

    def _tell(self, endpoint: str, frames: Sequence[bytes]) -> None:
        """Send a ``ROOM_FAILED`` to a decode rank; nothing once the manager closed its
        sockets (a room failing then, on the worker thread, must not end the worker)."""
        try:
            self._manager.send(endpoint, frames)
        except SocketsClosed as exc:  # nobody left to tell
            logger.info("ROOM_FAILED to %s not sent: %s", endpoint, exc)


class _TransferClock:
    """Start time of one request and, once it ended, its :class:`TransferRecord` (kept: after
    ``release`` the record is the one kept then, or ``None``)."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.start: tuple[float, float] | None = None
        self.record: TransferRecord | None = None
        self.released = False

    def started(self) -> None:
        self.start = (time.monotonic(), time.time())
        self.record = None
        self.released = False

    def ended(self, end: RoomEnd | None) -> TransferRecord | None:
        """The record of the room's end as its book stamped it (kept from the first time)."""
        if self.record is None and self.start is not None and end is not None:
            self.record = TransferRecord(
                self.room,
                end.bytes,
                end.chunks,
                self.start[0],
                end.end_monotonic,
                self.start[1],
                end.end_wall,
                Outcome.SUCCESS if end.succeeded else Outcome.FAILED,
                end.failure,
            )
        return self.record


class KVSender:
    """One request on prefill (``init``, ``send`` per chunk, ``poll``).

    **Side:** prefill. **Called by:** the scheduler.
    """

    def __init__(self, transfers: PrefillTransfers, room: int) -> None:
        self._transfers = transfers
        self.room = room
        self._clock = _TransferClock(room)

    def init(self, num_pages: int, decode: Sequence[DecodeTarget]) -> None:
        """Announce the request's size in pages and the decode ranks it goes to.

        Args:
            num_pages: pages of the request.
            decode: every decode rank of the request's decode instance, indexed by TP rank.
        """
        self._clock.started()
        self._transfers.open_room(self.room, num_pages, decode)

    def send(self, pages: Sequence[int], *, last: bool = False) -> None:
        """Queue the next chunk (this rank's KV-pool pages of it, in token order)."""
        self._transfers.submit(self.room, pages, last)

    def poll(self) -> KVPoll:
        """The request's state."""
        return self._transfers.status(self.room)[0]

    def wait(self, timeout_s: float) -> KVPoll:
        """Block until the request succeeded or failed, or ``timeout_s`` passed; its state.

        For drivers and tests that have nothing else to do (a scheduler polls instead).
        **Blocking:** up to ``timeout_s``; woken when the worker finishes the last chunk.
        """
        return self._transfers.wait(self.room, timeout_s)[0]

    def failure(self) -> str | None:
        """Why the request failed, if it did."""
        return self._transfers.status(self.room)[1]

    def failure_record(self) -> RoomFailure | None:
        """Why the request failed, typed where it failed (``None`` if it did not)."""
        failure = self._transfers.failure_of(self.room)
        if failure is not None:
            return failure
        detail = self.failure()
        return None if detail is None else RoomFailure.from_detail(detail)

    def get_transfer_metric(self) -> TransferRecord | None:
        """What the request's transfer did, once it ended (``None`` before): ``chunks`` and
        ``bytes`` this rank wrote for it, over every decode rank it feeds (K and V, every
        layer); its end and latency are the room's (stamped when it ended, not when asked).
        **Called by:** the scheduler, any thread. After :meth:`release`, the record kept
        then (``None`` if the room had not ended)."""
        if self._clock.released:
            return self._clock.record
        return self._clock.ended(self._transfers.room_end(self.room))

    def release(self) -> None:
        """Forget the request (after success or failure); its record is kept."""
        self.get_transfer_metric()
        self._clock.released = True
        self._transfers.close_room(self.room)


# --------------------------------------------------------------------------- decode


class DecodeTransfers:
    """Decode side: the handler, the prefill endpoints, and ``ROOM_FAILED`` from prefill.

    Args:
        manager: the decode manager.
        handler: its attached staging handler.
        prefill_endpoints: every prefill rank's control listener, indexed by TP rank.
    """

    def __init__(
        self, manager: ControlHost, handler: DecodeStagingHandler, prefill_endpoints: Sequence[str]
    ) -> None:
        self.manager = manager
        self.handler = handler
        self.prefill_tp = len(prefill_endpoints)
        kv_args = manager.kv_args
        self.decode_rank = kv_args.engine_rank
        decode_tp = handler.decode_tp
        self.peers = peers_for(prefill_endpoints, self.prefill_tp, decode_tp, self.decode_rank)
        manager.register_control(RoomFailed.KIND, self._on_room_failed)
        manager.register_control(RoomFailedAck.KIND, self._on_room_failed_ack)

    def _on_room_failed(self, frames: list[bytes]) -> None:
        self.handler.handle_room_failed(RoomFailed.from_frames(frames))

    def _on_room_failed_ack(self, frames: list[bytes]) -> None:
        self.handler.room_failed_acked(RoomFailedAck.from_frames(frames))


class KVReceiver:
    """One request on decode (``init``, ``send_metadata``, ``poll``).

    **Side:** decode. **Called by:** the scheduler.
    """

    def __init__(self, transfers: DecodeTransfers, room: int) -> None:
        self._transfers = transfers
        self.room = room
        self._plan: RoomPlan | None = None
        self._meta_sent = False
        self._failure_reported = False
        self._clock = _TransferClock(room)
        self._refused: RoomEnd | None = None
        """The end of a registration refused at ``init`` (not kept by the handler)."""

    def init(
        self, page_indices: Sequence[int], *, chunk_pages: int, prefix_tokens: int = 0
    ) -> None:
        """Register the room on decode (before its metadata goes to prefill)."""
        t = self._transfers
        self._clock.started()
        self._refused = None
        self._plan = RoomPlan(
            self.room, tuple(page_indices), chunk_pages, t.prefill_tp, t.peers, prefix_tokens
        )
        status = t.handler.register_room(self._plan)
        if status is RoomStatus.FAILED and t.handler.room_end(self.room) is None:
            # Refused, not kept by the handler: the room ended here.
            failure = t.handler.room_failure_record(self.room)
            self._refused = RoomEnd(False, failure, time.monotonic(), time.time(), 0, None)

    def send_metadata(self) -> None:
        """Tell the prefill ranks feeding this decode rank that the room is ready."""
        if self._plan is None:
            raise RuntimeError(f"room {self.room}: send_metadata before init")
        t = self._transfers
        meta = RoomMeta(
            self.room,
            t.decode_rank,
            len(self._plan.page_indices),
            self._plan.chunk_pages,
            t.handler.opening(self.room) or 0,
        )
        # Sent now and again to each writer not heard from yet (a lost one is recovered).
        t.handler.announce(self.room, meta.to_frames())
        self._meta_sent = True

    def poll(self) -> KVPoll:
        """The request's state on this decode rank."""
        status = self._transfers.handler.poll_room(self.room)
        if status is None or status is RoomStatus.FAILED:
            self._report_failure()
            return KVPoll.Failed
        if status is RoomStatus.SUCCESS:
            return KVPoll.Success
        if status is RoomStatus.TRANSFERRING:
            return KVPoll.Transferring
        return KVPoll.WaitingForInput if self._meta_sent else KVPoll.Bootstrapping

    def wait(self, timeout_s: float) -> KVPoll:
        """Block until the request succeeded or failed on this rank, or ``timeout_s``
        passed; then :meth:`poll`.

        For drivers and tests that have nothing else to do (a scheduler polls instead).
        **Blocking:** up to ``timeout_s``; woken when the listener completes the room.
        """
        self._transfers.handler.wait_room(self.room, timeout_s)
        return self.poll()

    def failure(self) -> str | None:
        """Why the request failed, if it did."""
        return self._transfers.handler.room_failure(self.room)

    def failure_record(self) -> RoomFailure | None:
        """Why the request failed, typed where it failed (``None`` if it did not)."""
        failure = self._transfers.handler.room_failure_record(self.room)
        if failure is not None:
            return failure
        detail = self.failure()
        return None if detail is None else RoomFailure.from_detail(detail)

    def get_transfer_metric(self) -> TransferRecord | None:
        """What the request's transfer did on this rank, once it ended (``None`` before):
        ``chunks`` and ``bytes`` scattered into this rank's KV pool for it (every writer's,
        K and V, every layer); its end and latency are the room's (stamped when it ended,
        not when asked). **Called by:** the scheduler, any thread. After :meth:`release`,
        the record kept then (``None`` if the room had not ended)."""
        if self._clock.released:
            return self._clock.record
        end = self._refused or self._transfers.handler.room_end(self.room)
        return self._clock.ended(end)

    def release(self) -> None:
        """Tear the room down on decode (frees any ring regions it still holds); its record
        is kept."""
        self.get_transfer_metric()
        self._transfers.handler.release_room(self.room)
        self._clock.released = True

    def _report_failure(self) -> None:
        if self._failure_reported:
            return
        self._failure_reported = True
        t = self._transfers
        reason = self.failure() or "room unknown on decode"
        if t.handler.opening(self.room) is not None:
            t.handler.report_failure(self.room, reason)  # re-sent until acknowledged
            return
        frames = RoomFailed(self.room, reason).to_frames()  # no opening to name: once
        for peer in t.peers:
            try:
                t.manager.send(peer.endpoint, frames)
            except SocketsClosed as exc:  # the manager closed: nobody left to tell
                logger.info("ROOM_FAILED to %s not sent: %s", peer.endpoint, exc)
                return
