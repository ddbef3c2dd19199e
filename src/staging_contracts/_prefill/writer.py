"""``StagingWriter``: the prefill side of the staging path (SPEC §5).

Per chunk and per decode rank it feeds: make sure a ``STAGING_REQ`` was sent (prefetch,
deduplicated), wait for decode's region (bounded; re-request on timeout, which recovers a lost
``STAGING_RSP``), wait until the watermark says the region is free (bounded; re-request,
which makes decode re-send its watermark), gather this rank's heads into a private staging
buffer, write it with the engine in one bulk write, and signal arrival: the write's
notification where the engine has them, else ``CHUNK_READY`` over ZMQ once the write completed
(``arrival="zmq"`` chooses the latter with any engine: the reference's NIXL decode reads only it).

**Integrity.** Each arrival carries the region's epoch (its ring round) and a tag of the staged
bytes (:mod:`~staging_contracts._control.integrity`): their digest, unless integrity is off, and
with a cluster secret a MAC keyed for the decode session, so that decode can tell the writer's
arrival from a forged one and its bytes from any that landed in the region since.

Every failure of a chunk (decode refused it, no answer before the deadline, an engine error)
raises :class:`StagingFailed` for that room; the worker thread that called lives on.

**Fencing.** When decode fails a room it sends ``ROOM_FENCE``; from then on this writer never
writes into that room's regions of that decode session, and it answers ``ROOM_FENCED`` as
soon as no such write is in flight (right away, or when the running write returns). Waits of
a fenced room, or of a decode rank declared dead by peer liveness, end within a wait slice.

**Closed rooms.** :meth:`StagingWriter.forget_room` (the room was closed) also remembers the
room among the last :data:`FORGOTTEN_ROOMS` forgotten ones: a chunk of it then fails at once
("the room was closed") instead of waiting for an answer that was dropped, and a late
``prefetch`` of it neither asks decode nor watches its ranks again. A room id used again is
opened again by :meth:`StagingWriter.track_room` (the per-request layer calls it when the
room opens).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

import torch

from .. import config
from .._control.integrity import (
    ArrivalKeys,
    ChunkIdentity,
    chunk_digest,
    integrity_enabled,
    make_tag,
)
from .._control.liveness import PeerLiveness
from .._control.room_messages import RoomFence, RoomFenced
from .._control.transport import PeerSockets
from .._control.wire import ChunkReady, StagingReq
from .._staging.host_view import host_view
from .._staging.kernels import PagedKVPools
from .._staging.layout import (
    compute_head_slice_params,
    compute_staging_layout,
    decode_ranks_for_prefill,
    num_writers,
    validate_tp_pair,
    writer_index,
)
from .._staging.ordering import DeviceOrdering, ordering_for
from ..outcomes import FailureReason
from ..protocols import (
    ArrivalMode,
    KVBufferTensors,
    RegionAnswer,
    Transfer,
    TransferEngine,
    TransferError,
    Watermark,
)
from .arrival_resends import ArrivalResends
from .books import RegionAnswerTable, WatermarkTracker

__all__ = [
    "ArrivalMode",
    "ChunkSpec",
    "DecodeTarget",
    "PrefillTimeouts",
    "StagingFailed",
    "StagingWriter",
]

logger = logging.getLogger(__name__)

_SESSION_FRAME: Final = {b"STAGING_RSP": 6, b"WATERMARK": 3, RoomFence.KIND: 2}
"""The frame that names the decode session, per message the writer authorises."""

WAIT_SLICE_S: Final = 0.05
"""Longest a wait for a region or the watermark goes without checking fences and liveness."""

FORGOTTEN_ROOMS: Final = 4096
"""How many of the most recently forgotten (closed) rooms a writer remembers, so that a chunk
or a prefetch of one that comes after its close is refused rather than waited for (a few
hundred KiB at most). A room forgotten longer ago than that is treated as never seen; a chunk
of it that comes so late is still bounded by its ``deadline_s``."""


def _arrival_mode(engine: TransferEngine, arrival: ArrivalMode | None) -> ArrivalMode:
    """The writer's arrival mode: ``arrival``, or the engine's natural one when ``None``."""
    if arrival is None:
        return "notification" if engine.supports_notifications else "zmq"
    if arrival not in ("notification", "zmq"):
        raise ValueError(f"arrival={arrival!r} must be 'notification', 'zmq' or None")
    if arrival == "notification" and not engine.supports_notifications:
        raise ValueError(
            f"arrival='notification' needs an engine with notifications; {engine!r} has none"
        )
    return arrival


class StagingFailed(RuntimeError):
    """A room's staged transfer failed on prefill (the room fails; the thread lives on).

    Attributes:
        room: the room.
        reason: what went wrong.
        kind: why, typed where the writer knows it (an engine write that failed is
            ``ENGINE_ERROR`` whatever the engine said); ``None``: read from ``reason``.
    """

    def __init__(self, room: int, reason: str, kind: FailureReason | None = None) -> None:
        super().__init__(f"room {room}: {reason}")
        self.room = room
        self.reason = reason
        self.kind = kind


@dataclass(frozen=True, slots=True)
class DecodeTarget:
    """One decode rank as prefill reaches it (learned at bootstrap)."""

    tp_rank: int
    """The decode rank's attention-TP rank."""
    session_id: str
    """Its engine session id (Mooncake ``host:port``, NIXL agent name)."""
    endpoint: str
    """Its control listener (``STAGING_REQ`` and ``CHUNK_READY`` go there)."""
    ring_base: int
    """Address of its staging ring."""
    ring_size: int
    """Bytes of its staging ring."""
    liveness: bool = True
    """Whether peer liveness watches this rank while a room needs it (the default): it is sent
    ``PING`` every ``PeerLiveness.interval_s`` and, silent for ``PeerLiveness.timeout_s``,
    declared dead, which fails its rooms at once. ``False`` for a rank that never answers
    ``PING``, such as the reference's decode (docs/differences.md): it is
    never pinged and no room fails for its silence; the chunk's ``PrefillTimeouts.deadline_s``
    still bounds every wait on it, and a ``ROOM_FENCE`` from it still fails the room. Give
    every target naming one rank the same value (a rank that any room watches is pinged)."""


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """One chunk of a request, as this prefill rank holds it."""

    chunk_idx: int
    """Index of the chunk in the request."""
    page_start: int
    """Index of the chunk's first page in the transferred part of the request."""
    pages: tuple[int, ...]
    """This rank's KV-pool pages of the chunk, in token order."""


@dataclass(frozen=True, slots=True)
class PrefillTimeouts:
    """Bounds of the waits of one chunk.

    A field not given reads its ``STAGING_CONTRACTS_PREFILL_*`` variable (see
    :mod:`~staging_contracts.config`), else takes its default; an unusable variable raises
    :class:`~staging_contracts.config.ConfigError` here.
    """

    answer_s: float = field(default_factory=config.PREFILL_ANSWER_S.value)
    """Wait this long for ``STAGING_RSP`` before re-sending ``STAGING_REQ`` (0.5 s)."""
    ready_s: float = field(default_factory=config.PREFILL_READY_S.value)
    """Wait this long for the watermark before re-sending ``STAGING_REQ`` (0.5 s)."""
    deadline_s: float = field(default_factory=config.PREFILL_DEADLINE_S.value)
    """Give the chunk up (the room fails) after this long without progress: no answer, or
    no movement of the decode ring's watermark while the region waits for it (waiting for
    ring space that other rooms hold and release is not a stall; 30 s)."""


class StagingWriter:
    """Writes this prefill rank's KV heads of each chunk into the decode rings.

    **Side:** prefill. **Thread-safety:** ``prefetch`` may be called from the scheduler
    while one worker thread calls ``send_chunk``; one staging buffer is used, so only one
    ``send_chunk`` runs at a time (an internal lock serializes them).

    Args:
        kv_buffers: this rank's paged KV pool (read in place).
        engine: the transfer engine; the staging buffer is registered with it here.
        sender: non-blocking PUSH sockets to the decode listeners.
        watermarks: fed by the host's listener from ``WATERMARK`` messages.
        regions: fed by the host's listener from ``STAGING_RSP`` messages.
        prefill_tp: attention TP size of prefill.
        prefill_rank: this rank's attention-TP rank.
        total_kv_heads: KV heads of the whole model.
        max_chunk_pages: the largest chunk, in pages (sizes the staging buffer).
        pp_rank: this rank's pipeline stage, sent with each ``STAGING_REQ`` when not ``None``.
        timeouts: bounds of the waits.
        stream: CUDA only: the stream gathers run on.
        liveness: peer liveness of the host; the writer watches the decode ranks of its rooms
            (those whose :attr:`DecodeTarget.liveness` is true) until it forgets them, and
            stops waiting on such a rank declared dead.
        ordering: when a gather has completed, so that the engine never reads the staging
            buffer before (default: the device's; see
            :mod:`~staging_contracts._staging.ordering`).
        arrival: how arrivals are signalled (see :data:`ArrivalMode`); ``None`` (default):
            by notification where ``engine.supports_notifications``, else over ZMQ.
        integrity: tag each write with the digest of its staged bytes (hashed once the gather
            completed, before the write); ``None`` (default): ``STAGING_CONTRACTS_INTEGRITY``,
            else off (see :func:`~staging_contracts._control.integrity.integrity_enabled`).
        arrival_keys: the MAC keys derived from the cluster secret (``None``: no secret, no
            MAC); with them every arrival carries a MAC that decode requires.

    Raises:
        ValueError: ``arrival="notification"`` with an engine without notifications, an
            unknown ``arrival``, or an unreadable ``STAGING_CONTRACTS_INTEGRITY``.
    """

    def __init__(
        self,
        *,
        kv_buffers: KVBufferTensors,
        engine: TransferEngine,
        sender: PeerSockets,
        watermarks: WatermarkTracker,
        regions: RegionAnswerTable,
        prefill_tp: int,
        prefill_rank: int,
        total_kv_heads: int,
        max_chunk_pages: int,
        pp_rank: int | None = None,
        timeouts: PrefillTimeouts | None = None,
        stream: torch.cuda.Stream | None = None,
        liveness: PeerLiveness | None = None,
        ordering: DeviceOrdering | None = None,
        arrival: ArrivalMode | None = None,
        integrity: bool | None = None,
        arrival_keys: ArrivalKeys | None = None,
    ) -> None:
        self._arrival = _arrival_mode(engine, arrival)
        self._integrity = integrity_enabled(integrity)
        self._arrival_keys = arrival_keys
        self._pools = PagedKVPools(kv_buffers.k_buffers, kv_buffers.v_buffers, kv_buffers.page_size)
        self._geometry = self._pools.geometry
        if max_chunk_pages < 1:
            raise ValueError(f"max_chunk_pages={max_chunk_pages!r} must be >= 1")
        self._max_chunk_pages = max_chunk_pages
        self._kv = kv_buffers
        self._engine = engine
        self._sender = sender
        self._watermarks = watermarks
        self._regions = regions
        self._resends = ArrivalResends(watermarks, sender)
        self._prefill_tp = prefill_tp
        self._prefill_rank = prefill_rank
        self._total_heads = total_kv_heads
        self._pp_rank = pp_rank
        self._timeouts = timeouts or PrefillTimeouts()
        self._stream = stream
        self._ordering = ordering or ordering_for(self._geometry.device, stream)
        geometry = self._geometry
        self._buffer_bytes = (
            max_chunk_pages
            * kv_buffers.page_size
            * geometry.num_heads
            * geometry.bytes_per_head_token
            * 2
            * geometry.num_layers
        )
        # Zeroed, so its pages are touched at start-up rather than during the first gathers.
        self._buffer = torch.zeros(self._buffer_bytes, dtype=torch.uint8, device=geometry.device)
        self._buffer_ptr = self._buffer.data_ptr()
        engine.register(self._buffer_ptr, self._buffer_bytes)
        self._write_lock = threading.Lock()
        self._requested: set[tuple[int, int, str]] = set()
        self._requested_lock = threading.Lock()
        self._liveness = liveness
        self._room_targets: dict[int, dict[str, DecodeTarget]] = {}
        """Room -> the decode sessions it was requested from -> their targets (those with
        ``liveness`` watched)."""
        self._session_endpoints: dict[str, str] = {}
        """Every decode session this writer requested from -> its endpoint (latest)."""
        self._fence_lock = threading.Lock()
        self._fenced: dict[tuple[int, str], str] = {}
        """(room, decode session) -> why decode fenced it: never written again."""
        self._in_flight: tuple[int, str] | None = None
        """(room, decode session) of the engine write running now."""
        self._fence_acks: dict[tuple[int, str], list[Callable[[], None]]] = {}
        self._drop_after_write: set[tuple[int, str]] = set()
        """Fences of a closed room whose write was in flight at the close: dropped when the
        write returns (under ``_fence_lock``)."""
        self._early_fences: dict[tuple[int, str], None] = {}
        """Fences that came before this rank opened their room, oldest first (at most
        :data:`FORGOTTEN_ROOMS`; under ``_fence_lock``)."""
        """Fences of a closed room whose write was in flight at the close: dropped when the
        write returns (under ``_fence_lock``)."""
        self._room_lost: list[Callable[[int, str], None]] = []
        self._idle_hooks: list[Callable[[], None]] = []
        self._closed = False
        self.requests_sent = 0
        """``STAGING_REQ`` messages sent, re-requests included."""
        self.bytes_written = 0
        self.chunks_written = 0
        """Chunks staged (each once, whatever number of decode ranks it fed)."""
        """Payload bytes written into decode rings."""
        self._forgotten: dict[int, str] = {}
        """The last :data:`FORGOTTEN_ROOMS` rooms forgotten and not opened again (oldest
        first) -> why a chunk of one fails (under ``_requested_lock``)."""

    @property
    def timeouts(self) -> PrefillTimeouts:
        """The bounds of the waits of one chunk."""
        return self._timeouts

    @property
    def arrival(self) -> ArrivalMode:
        """How this writer signals that a write landed (fixed at construction)."""
        return self._arrival

    @property
    def integrity(self) -> bool:
        """Whether writes are tagged with the digest of their staged bytes (fixed)."""
        return self._integrity

    @property
    def buffer_bytes(self) -> int:
        """Size of the private staging buffer."""
        return self._buffer_bytes

    @property
    def answers_held(self) -> int:
        """``STAGING_RSP`` answers held now (each for a chunk an open room asked for)."""
        return len(self._regions)

    @property
    def answers_dropped(self) -> int:
        """``STAGING_RSP`` answers not kept: no open room of this writer asked for them."""
        return self._regions.dropped

    # ------------------------------------------------------------------ requests

    def targets_of(self, decode: Sequence[DecodeTarget]) -> list[DecodeTarget]:
        """The decode ranks this prefill rank writes to, out of all of a request's ranks."""
        return [
            decode[d]
            for d in decode_ranks_for_prefill(self._prefill_tp, len(decode), self._prefill_rank)
        ]

    def prefetch(
        self, room: int, chunks: Iterable[tuple[int, int]], decode: Sequence[DecodeTarget]
    ) -> int:
        """Send one ``STAGING_REQ`` per (chunk, decode rank fed), skipping those already sent.

        A room forgotten by :meth:`forget_room` and not opened again by :meth:`track_room`
        is neither asked for nor tracked (its prefetch came after its close).

        **Called by:** the scheduler right after the batch is formed. **Blocking:** no.

        Args:
            room: the request's room.
            chunks: ``(chunk_idx, num_pages)`` of every chunk to come.
            decode: every decode rank of the request, indexed by TP rank.

        Returns:
            Requests sent now.
        """
        sent = 0
        targets = [t for t in self.targets_of(decode) if not self.fenced(room, t.session_id)]
        self._track(room, targets)
        for chunk_idx, num_pages in chunks:
            for target in targets:
                key = (room, chunk_idx, target.session_id)
                with self._requested_lock:
                    # Forgotten (now, or while this prefetch runs): nothing to ask for.
                    if key in self._requested or room in self._forgotten:
                        continue
                    self._requested.add(key)
                self._request(room, chunk_idx, num_pages, target)
                sent += 1
        return sent

    def track_room(self, room: int, targets: Sequence[DecodeTarget]) -> None:
        """Remember (and watch, until :meth:`forget_room`) the decode ranks a room goes to;
        a target with ``liveness=False`` is remembered, never watched.

        This is the (re-)open of a room: a room forgotten by :meth:`forget_room` is no longer
        refused from here on, so that a room id used again works (a late chunk or prefetch of
        a closed room must therefore come before its id is opened again).

        **Called by:** the per-request layer when a room opens (on the scheduler's thread), so
        that a decode rank that dies before it answers anything is noticed. **Blocking:** no.
        """
        with self._requested_lock:
            reopened = self._forgotten.pop(room, None) is not None
            if reopened or room not in self._room_targets:
                # A fresh opening: nothing of an earlier one (an answer that came after its
                # close) may be used by this one; no arrival of it goes again.
                self._regions.forget_room(room)
                self._resends.cancel_room(room)
            self._track_locked(room, targets)

    def _track(self, room: int, targets: Sequence[DecodeTarget]) -> None:
        """Remember and watch a room's targets, unless the room was forgotten."""
        with self._requested_lock:
            self._track_locked(room, targets)

    def _track_locked(self, room: int, targets: Sequence[DecodeTarget]) -> None:
        """``_track`` with ``_requested_lock`` held. The watches are taken under the lock too,
        so that a ``forget_room`` racing this call unwatches only after they were taken and
        leaves no orphan watch (``PeerLiveness.watch`` only counts, under its own lock)."""
        if room in self._forgotten:
            return
        if room not in self._room_targets:
            with self._fence_lock:  # its early fences are the open room's fences now
                for key in [k for k in self._early_fences if k[0] == room]:
                    del self._early_fences[key]
        known = self._room_targets.setdefault(room, {})
        for target in targets:
            self._session_endpoints[target.session_id] = target.endpoint
            if target.session_id not in known:
                known[target.session_id] = target
                if target.liveness and self._liveness is not None:
                    self._liveness.watch(target.endpoint)

    def _request(self, room: int, chunk_idx: int, num_pages: int, target: DecodeTarget) -> None:
        with self._requested_lock:
            if room in self._forgotten:  # closed meanwhile: ask nothing, expect nothing
                return
            # Before the request goes out, so that its answer is kept (a gated table keeps
            # only answers of chunks asked for by open rooms).
            self._regions.expect(room, chunk_idx, target.session_id)
        req = StagingReq(room, chunk_idx, num_pages, target.session_id, self._pp_rank)
        self._sender.send(target.endpoint, req.to_frames())
        self.requests_sent += 1

    def forget_room(self, room: int) -> None:
        """Drop a finished or failed room's requests, answers, fences and watches, and
        refuse the room until :meth:`track_room` opens it again: a chunk of it fails at once
        ("the room was closed") and a prefetch of it sends and tracks nothing. The last
        :data:`FORGOTTEN_ROOMS` rooms forgotten are remembered so.

        **Called by:** the per-request layer when a room is closed (any thread).
        **Blocking:** no.
        """
        with self._requested_lock:
            self._forgotten.pop(room, None)  # forgotten again: the most recent now
            self._forgotten[room] = "the room was closed"
            if len(self._forgotten) > FORGOTTEN_ROOMS:
                del self._forgotten[next(iter(self._forgotten))]
            self._requested = {key for key in self._requested if key[0] != room}
            # Under the lock, as the watches were taken (see _track_locked).
            for target in self._room_targets.pop(room, {}).values():
                if target.liveness and self._liveness is not None:
                    self._liveness.unwatch(target.endpoint)
            self._regions.forget_room(room)
        self._resends.close_room(room)
        with self._fence_lock:
            for key in [k for k in self._early_fences if k[0] == room]:
                del self._early_fences[key]
            for key in [k for k in self._fenced if k[0] == room]:
                if key == self._in_flight:
                    # Kept while the write runs (nothing more of it may start); dropped as
                    # soon as it returns, so that the room id can be used again.
                    self._drop_after_write.add(key)
                else:
                    del self._fenced[key]

    # ------------------------------------------------------------------ fences and liveness

    def on_progress(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever decode answers a region or a watermark moves, and when
        a room is lost: a waiting chunk may be writable (or must fail) now. Called on the
        listener thread; it must not block."""
        self._watermarks.add_listener(listener)
        self._regions.add_listener(listener)
        self._room_lost.append(lambda room, reason: listener())

    def on_room_lost(self, listener: Callable[[int, str], None]) -> None:
        """Call ``listener(room, reason)`` when decode fences a room or a decode rank of a
        room is declared dead (on the listener thread)."""
        self._room_lost.append(listener)

    def closed(self, room: int) -> bool:
        """Whether the room was closed (:meth:`forget_room`) and not opened again since
        (among the last :data:`FORGOTTEN_ROOMS` closes). **Blocking:** no."""
        with self._requested_lock:
            return room in self._forgotten

    def fenced(self, room: int, session_id: str) -> bool:
        """Whether decode ``session_id`` fenced ``room`` (it is never written again)."""
        with self._fence_lock:
            return (room, session_id) in self._fenced

    def handle_room_fence(self, fence: RoomFence) -> None:
        """Fence a room towards one decode session and answer ``ROOM_FENCED`` when no write of
        it is in flight (now, or when the running write returns).

        **Called by:** the listener thread (``ROOM_FENCE``). **Blocking:** no.
        """
        key = (fence.room, fence.session_id)
        # Decode gave the room up: no arrival of it goes there again (before the answer, so
        # that every copy already sent travels ahead of it).
        self._resends.cancel_session(fence.room, fence.session_id)
        answer = RoomFenced(fence.room, fence.session_id, self._prefill_rank).to_frames()

        def acknowledge() -> None:
            self._sender.send(fence.reply_to, answer)

        with self._requested_lock:
            room_open = fence.room in self._room_targets
            closed = fence.room in self._forgotten
        with self._fence_lock:
            in_flight = self._in_flight == key
            if closed and not in_flight:
                # Late, for a room closed here: no write of it can start, nothing to keep (a
                # room id opened again must not find it).
                first = False
                acknowledge_now = True
            else:
                first = key not in self._fenced
                self._fenced[key] = fence.reason
                if closed:  # a closed room's write in flight: kept until it returns
                    self._drop_after_write.add(key)
                else:
                    self._drop_after_write.discard(key)
                if not room_open and not closed:
                    # Before this rank opened the room (another writer's request got the
                    # region): kept for its opening, among a bounded number of such fences.
                    self._early_fences.pop(key, None)
                    self._early_fences[key] = None
                    if len(self._early_fences) > FORGOTTEN_ROOMS:
                        oldest = next(iter(self._early_fences))
                        del self._early_fences[oldest]
                        if oldest != self._in_flight:
                            self._fenced.pop(oldest, None)
                if in_flight:
                    self._fence_acks.setdefault(key, []).append(acknowledge)
                acknowledge_now = not in_flight
        if acknowledge_now:
            acknowledge()
        if first:
            self._tell_room_lost(fence.room, f"decode fenced the room: {fence.reason}")

    def peer_dead(self, endpoint: str) -> None:
        """A decode rank was declared dead: every room that watches it is lost (a room whose
        target for it has ``liveness=False`` is not).

        **Called by:** the listener thread (peer liveness). **Blocking:** no.
        """
        with self._requested_lock:
            rooms = [
                room
                for room, targets in self._room_targets.items()
                if any(t.liveness and t.endpoint == endpoint for t in targets.values())
            ]
        for room in rooms:
            self._tell_room_lost(room, f"decode rank at {endpoint} is dead")

    def authorize(self, frames: Sequence[bytes], sender: str) -> bool:
        """Whether an authenticated peer may send this message (authorisation per session).

        ``STAGING_RSP`` and ``ROOM_FENCE`` naming a decode session are accepted only from that
        session's endpoint as this writer learned it (from the targets it requested), and a
        ``ROOM_FENCE`` only with that endpoint as its reply address; ``WATERMARK`` only from
        the session it names or, without one, from any decode rank this writer requested
        from. Other kinds are not this writer's to judge.

        **Called by:** the listener thread, before the message is handled. **Blocking:** no.
        """
        kind = bytes(frames[0]) if frames else b""
        session_index = _SESSION_FRAME.get(kind)
        if session_index is None:
            return True
        session = frames[session_index] if len(frames) > session_index else b""
        with self._requested_lock:
            if not session:  # a WATERMARK without a session (the reference sends it so)
                return sender in self._session_endpoints.values()
            expected = self._session_endpoints.get(session.decode("ascii", "replace"))
        if kind == RoomFence.KIND:
            return expected == sender and len(frames) > 3 and frames[3] == sender.encode()
        return expected == sender

    def _tell_room_lost(self, room: int, reason: str) -> None:
        for listener in self._room_lost:
            try:
                listener(room, reason)
            except Exception:  # one listener's bug must not stop the others or the listener
                logger.exception("room %d: a room-lost listener failed", room, extra={"room": room})

    def _abort_reason(self, room: int, target: DecodeTarget) -> str | None:
        """Why a chunk of ``room`` must not be written to ``target`` (``None``: it may)."""
        with self._requested_lock:
            closed = self._forgotten.get(room)
        if closed is not None:
            return closed
        with self._fence_lock:
            reason = self._fenced.get((room, target.session_id))
        if reason is not None:
            return f"decode fenced the room: {reason}"
        if (
            target.liveness
            and self._liveness is not None
            and self._liveness.is_dead(target.endpoint)
        ):
            return f"decode rank {target.tp_rank} at {target.endpoint} is dead"
        return None

    def chunk_ready(self, room: int, chunk_idx: int, decode: Sequence[DecodeTarget]) -> bool:
        """Whether :meth:`send_chunk` would write the chunk without waiting: every decode
        rank it feeds answered a region whose watermark has passed, or one of them refused,
        fenced the room or is dead, or the room was forgotten (then ``send_chunk`` fails at
        once).

        **Called by:** the prefill transfer worker, to pick a chunk it can write now.
        **Blocking:** no.
        """
        for target in self.targets_of(decode):
            if self._abort_reason(room, target) is not None:
                return True
            answer = self._regions.get(room, chunk_idx, target.session_id)
            if answer is None:
                return False
            if answer.refused:
                return True
            if not self._watermarks.is_ready(target.session_id, answer.round, answer.end):
                return False
        return True

    def ring_marker(self, decode: Sequence[DecodeTarget]) -> tuple[Watermark, ...]:
        """The latest watermark of each decode rank this writer feeds: it changes whenever
        one of their rings moves (a waiting chunk is then not stalled)."""
        return tuple(self._watermarks.latest(t.session_id) for t in self.targets_of(decode))

    def answers_marker(
        self, room: int, chunk_idx: int, decode: Sequence[DecodeTarget]
    ) -> tuple[RegionAnswer | None, ...]:
        """The region answers of a chunk from each decode rank fed (``None``: none yet)."""
        return tuple(
            self._regions.get(room, chunk_idx, t.session_id) for t in self.targets_of(decode)
        )

    def rerequest(
        self, room: int, chunk_idx: int, num_pages: int, decode: Sequence[DecodeTarget]
    ) -> None:
        """Send ``STAGING_REQ`` again to every decode rank fed that has not made the chunk
        writable yet (recovers a lost ``STAGING_RSP`` or ``WATERMARK``).

        **Called by:** the prefill transfer worker, for a chunk that waits. **Blocking:** no.
        """
        for target in self.targets_of(decode):
            if self._abort_reason(room, target) is not None:
                continue
            answer = self._regions.get(room, chunk_idx, target.session_id)
            if answer is None or not self._watermarks.is_ready(
                target.session_id, answer.round, answer.end
            ):
                self._request(room, chunk_idx, num_pages, target)

    # ------------------------------------------------------------------ one chunk

    def send_chunk(self, room: int, chunk: ChunkSpec, decode: Sequence[DecodeTarget]) -> int:
        """Stage one chunk into every decode rank this prefill rank feeds.

        **Called by:** the prefill transfer worker. **Blocking:** until every write landed,
        or the deadline passed.

        Returns:
            Bytes written.

        Raises:
            StagingFailed: decode refused the chunk, no answer or readiness before the
                deadline, the region does not fit the layout, or the engine failed; at
                once (before any wait) when the room was forgotten (closed) and not opened
                again, or decode fenced it, and within a wait slice when that happens while
                the chunk waits.
        """
        if self._closed:
            raise StagingFailed(room, "the staging writer is closed")
        validate_tp_pair(self._prefill_tp, len(decode), self._total_heads)
        num_pages = len(chunk.pages)
        if num_pages > self._max_chunk_pages:  # the staging buffer holds no more
            raise StagingFailed(
                room,
                f"chunk {chunk.chunk_idx} of {num_pages} pages exceeds "
                f"max_chunk_pages={self._max_chunk_pages}",
            )
        self.prefetch(room, [(chunk.chunk_idx, num_pages)], decode)
        pages = torch.tensor(chunk.pages, dtype=torch.int64, device=self._geometry.device)
        written = 0
        with self._write_lock:
            for target in self.targets_of(decode):
                written += self._stage_into(room, chunk, pages, target, len(decode))
        self.bytes_written += written
        self.chunks_written += 1
        return written

    def _stage_into(
        self,
        room: int,
        chunk: ChunkSpec,
        pages: torch.Tensor,
        target: DecodeTarget,
        decode_tp: int,
    ) -> int:
        num_pages = len(chunk.pages)
        tokens = num_pages * self._kv.page_size
        layout = compute_staging_layout(
            self._prefill_tp,
            decode_tp,
            target.tp_rank,
            self._total_heads,
            tokens,
            self._geometry.bytes_per_head_token,
            self._geometry.num_layers,
        )
        writer = writer_index(self._prefill_tp, decode_tp, self._prefill_rank)
        offset_in_region = layout.writer_offsets[writer]
        nbytes = layout.writer_bytes[writer]
        deadline = time.monotonic() + self._timeouts.deadline_s
        answer = self._await_region(room, chunk.chunk_idx, num_pages, target, deadline)
        if answer.end - answer.offset < layout.total_bytes or answer.end > target.ring_size:
            raise StagingFailed(
                room,
                f"chunk {chunk.chunk_idx}: decode region [{answer.offset}, {answer.end}) does "
                f"not fit the layout of {layout.total_bytes} bytes",
            )
        self._await_ready(room, chunk.chunk_idx, num_pages, target, answer, deadline)
        head = compute_head_slice_params(
            self._prefill_tp, decode_tp, self._prefill_rank, target.tp_rank, self._total_heads
        )
        try:
            self._pools.gather(
                pages,
                head.src_head_start,
                head.num_heads,
                self._buffer[:nbytes],
                stream=self._stream,
            )
        finally:
            # The engine must not read the buffer before the gather completed; and a gather
            # that raised part-way must not leave copies into the buffer behind, to land in
            # the middle of the next chunk's write from it.
            self._ordering.gathered()
        arrival = self._arrival_of(room, chunk, target, answer.round, nbytes)
        notify = arrival.to_notification() if self._arrival == "notification" else None
        remote = target.ring_base + answer.offset + offset_in_region
        key = (room, target.session_id)
        with self._requested_lock:  # closed since the last wait slice: no write
            reason = self._forgotten.get(room)
        with self._fence_lock:
            fenced = self._fenced.get(key)
            if fenced is not None:
                reason = f"decode fenced the room: {fenced}"
            if reason is None:
                self._in_flight = key
        if reason is not None:
            raise StagingFailed(room, f"chunk {chunk.chunk_idx}: {reason}")
        try:
            self._engine.write(
                target.session_id, [Transfer(self._buffer_ptr, remote, nbytes)], notify
            )
        except TransferError as exc:
            raise StagingFailed(
                room,
                f"chunk {chunk.chunk_idx}: engine write failed: {exc}",
                FailureReason.ENGINE_ERROR,
            ) from exc
        finally:
            with self._fence_lock:
                self._in_flight = None
                acks = self._fence_acks.pop(key, [])
                if key in self._drop_after_write:  # its room was closed during the write
                    self._drop_after_write.discard(key)
                    self._fenced.pop(key, None)
            for acknowledge in acks:
                acknowledge()
        if notify is None:
            self._sender.send(target.endpoint, arrival.to_frames())
            # Again until decode's watermark shows the region consumed (a lost one is
            # recovered in a re-send interval, not at the room's timeout).
            sole = num_writers(self._prefill_tp, decode_tp) == 1
            self._resends.add(arrival, target.endpoint, answer.offset, sole_writer=sole)
        return nbytes

    def _arrival_of(
        self, room: int, chunk: ChunkSpec, target: DecodeTarget, epoch: int, nbytes: int
    ) -> ChunkReady:
        """The arrival of a gathered chunk: its identity, the region's epoch and its tag."""
        identity = ChunkIdentity(
            room,
            chunk.chunk_idx,
            chunk.page_start,
            len(chunk.pages),
            target.session_id,
            self._prefill_rank,
            epoch,
        )
        digest = (
            chunk_digest(identity, host_view(self._buffer[:nbytes])) if self._integrity else None
        )
        return ChunkReady(
            room,
            chunk.chunk_idx,
            chunk.page_start,
            len(chunk.pages),
            target.session_id,
            self._prefill_rank,
            epoch,
            make_tag(identity, digest, self._arrival_keys),
        )

    def _await_region(
        self, room: int, chunk_idx: int, num_pages: int, target: DecodeTarget, deadline: float
    ) -> RegionAnswer:
        asked = time.monotonic()
        while True:
            self._check_abort(room, chunk_idx, target)
            slice_s = min(WAIT_SLICE_S, self._timeouts.answer_s)
            answer = self._regions.wait(room, chunk_idx, target.session_id, slice_s)
            if answer is not None:
                if answer.refused:
                    raise StagingFailed(
                        room,
                        f"decode refused chunk {chunk_idx} (offset {answer.offset})",
                        FailureReason.REFUSED,
                    )
                return answer
            now = time.monotonic()
            if now >= deadline:
                raise StagingFailed(
                    room, f"no STAGING_RSP for chunk {chunk_idx} before the deadline"
                )
            if now - asked >= self._timeouts.answer_s:
                # Fenced, dead or closed during this slice: fail now, not ask once more.
                self._check_abort(room, chunk_idx, target)
                logger.info(
                    "room %d chunk %d: no STAGING_RSP yet, asking again",
                    room,
                    chunk_idx,
                    extra={"room": room},
                )
                self._request(room, chunk_idx, num_pages, target)
                asked = now

    def _check_abort(self, room: int, chunk_idx: int, target: DecodeTarget) -> None:
        reason = self._abort_reason(room, target)
        if reason is not None:
            raise StagingFailed(room, f"chunk {chunk_idx}: {reason}")

    def _await_ready(
        self,
        room: int,
        chunk_idx: int,
        num_pages: int,
        target: DecodeTarget,
        answer: RegionAnswer,
        deadline: float,
    ) -> None:
        session = target.session_id
        asked = time.monotonic()
        seen = self._watermarks.latest(session)
        while True:
            self._check_abort(room, chunk_idx, target)
            slice_s = min(WAIT_SLICE_S, self._timeouts.ready_s)
            if self._watermarks.wait_ready(session, answer.round, answer.end, slice_s):
                return
            now = time.monotonic()
            latest = self._watermarks.latest(session)
            if latest != seen:  # the ring moves: waiting for space is not a stall
                seen = latest
                deadline = max(deadline, now + self._timeouts.deadline_s)
            if now >= deadline:
                raise StagingFailed(
                    room,
                    f"chunk {chunk_idx}: region of round {answer.round} never became writable "
                    f"(watermark {tuple(latest)})",
                )
            if now - asked >= self._timeouts.ready_s:
                self._check_abort(room, chunk_idx, target)  # as in _await_region
                logger.info(
                    "room %d chunk %d: waiting for the watermark, asking again",
                    room,
                    chunk_idx,
                    extra={"room": room},
                )
                self._request(room, chunk_idx, num_pages, target)
                asked = now

    def on_idle(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` from :meth:`resend_arrivals` (the listener's idle hook), for other
        re-sends of the rank (the per-request layer's ``ROOM_FAILED``); it must not block."""
        self._idle_hooks.append(hook)

    def resend_arrivals(self) -> int:
        """Send again each ``CHUNK_READY`` that is due and whose region decode's watermark
        has not passed yet (see :mod:`~staging_contracts._prefill.arrival_resends`); the
        number sent. Runs the :meth:`on_idle` hooks too.

        **Called by:** the staging idle hook, on the listener thread. **Blocking:** no.
        """
        for hook in self._idle_hooks:
            try:
                hook()
            except Exception:  # a failing hook must not stop the arrivals' re-sends
                logger.exception("idle hook %r failed", hook)
        return self._resends.flush()

    @property
    def arrivals_resent(self) -> int:
        """``CHUNK_READY`` copies sent so far (first sends not counted)."""
        return self._resends.sent

    @property
    def arrivals_awaited(self) -> int:
        """``CHUNK_READY`` messages whose region decode has not shown consumed yet."""
        return len(self._resends)

    def close(self) -> None:
        """Deregister the staging buffer; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with self._write_lock:
            self._engine.deregister(self._buffer_ptr)
