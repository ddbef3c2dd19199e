"""``DecodeStagingHandler``: the decode side of the staging path (SPEC §4).

One handler per decode rank. It implements :class:`~staging_contracts.protocols.StagingHandler`
(the mixin hands it decoded ``STAGING_REQ`` and arrival messages from the listener thread) and
offers the scheduler room registration, status polling and teardown.

Threads: the **listener** thread calls ``handle_staging_req`` and ``handle_chunk_arrival``;
the **scheduler** calls ``register_room``, ``poll_room`` and ``release_room``; anyone may call
``progress``. One lock guards the room table; scatters run outside it, and teardown waits for
them.

**Fencing.** A failed or released-before-the-end room does not free its ring regions at once:
a writer may still hold the room's ``STAGING_RSP`` and write into a region that meanwhile
belongs to another room. The regions are *fenced* instead: every writer that had not arrived
is sent ``ROOM_FENCE`` (again every ``fence_resend_s`` until it answers), and the regions are
freed once each has answered ``ROOM_FENCED`` (no write of the room in flight, none to come) or
has been declared dead by peer liveness. So no region is ever reused while a writer of its
old room can still write into it.

**Integrity.** An arrival counts only if it is authentic (with a cluster secret: a valid MAC,
see :mod:`~staging_contracts._decode.integrity`) and names the region's current epoch (its
ring round; a stale one is dropped). Once a region is complete and scattered, each writer's
bytes in it are checked against the digest its arrival carried, before the region is freed; a
mismatch fails the room with a reason starting ``integrity``, so a late write that landed in
the region (a paused writer that came back) never makes a room report SUCCESS.
**A fair ring.** A prefill instance that reserves regions and never writes them cannot hold
the ring: a room holding a writable region with no arrival for ``stall_timeout_s`` (10 s by
default) fails, and so, at once, does every other room of the same instance that never had an
arrival and holds only regions reserved as long ago (else regions it reserved rounds ahead
would each take their own turn, and a tenant behind them wait once per round). A fence that a
live writer leaves unanswered for ``fence_timeout_s`` (10 s by default) frees its regions
anyway. So another tenant's region is writable within about ``stall_timeout_s +
fence_timeout_s`` (20 s by default) of the last arrival of the instance that blocks it.

Every send is non-blocking (:class:`~staging_contracts._control.transport.PeerSockets`): a dead
prefill never blocks a decode thread.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

import torch

from .. import config
from .._control.integrity import INTEGRITY_FAILURE, ArrivalKeys, integrity_enabled
from .._control.liveness import PeerLiveness
from .._control.resend import DEFAULT_RESEND_S, ResendBox
from .._control.room_messages import RoomFailed, RoomFailedAck, RoomFence, RoomFenced
from .._control.transport import PeerSockets
from .._control.wire import StagingRsp, WatermarkUpdate
from .._staging.allocator import StagingAllocator
from .._staging.layout import (
    prefill_ranks_for_decode,
    validate_tp_pair,
)
from .._staging.ordering import DeviceOrdering
from ..outcomes import FailureReason, Outcome, RoomEnd, RoomFailure, classify
from ..protocols import ArrivalOutcome, KVBufferTensors, StagingReqOutcome, Watermark
from ..stats import RoomTally, RoomTallySnapshot
from ..tracing import room_tracer
from .integrity import ArrivalVerifier
from .publisher import PrefillPublisher
from .rooms import ChunkRegion, PrefillPeer, RoomPlan, RoomState, RoomStatus
from .scatter import ChunkScatter

__all__ = [
    "DEFAULT_FENCE_RESEND_S",
    "DEFAULT_FENCE_TIMEOUT_S",
    "DEFAULT_MAX_ROOMS_PER_PEER",
    "DEFAULT_ROOM_TIMEOUT_S",
    "DEFAULT_STALL_TIMEOUT_S",
    "ROOM_FAILED_COPIES",
    "ROOM_FAILED_MAX_INTERVAL_S",
    "WAIT_SLICE_S",
    "DecodeStagingHandler",
    "PrefillPeer",
    "RoomPlan",
    "RoomStatus",
]

logger = logging.getLogger(__name__)

_wall_clock: Final = time.time
"""A room's end in wall time (for its transfer record; the latency uses ``time.monotonic``)."""

WAIT_SLICE_S = 0.01
"""``wait_room`` re-checks finished scatters at least this often (CUDA events complete
without waking anyone)."""


_CHUNK_READY = b"CHUNK_READY"
_ROOM_META = b"ROOM_META"
_ROOM_KINDS = frozenset({b"STAGING_REQ", _CHUNK_READY, RoomFailed.KIND, RoomFenced.KIND})
"""Messages whose sender must be one of the room's peers (see ``authorize``)."""


def _owner(plan: RoomPlan) -> tuple[str, ...]:
    """The prefill instance of a room, for the ring share: its writers' endpoints."""
    return tuple(sorted(peer.endpoint for peer in plan.peers))


def _shown(state: RoomState) -> RoomStatus:
    """The status the scheduler sees: a failed room whose scatters still run or are queued
    is ``TRANSFERRING`` until they end (``FAILED`` means no write into its pages can land)."""
    if state.status is RoomStatus.FAILED and (state.scattering or state.pending_events):
        return RoomStatus.TRANSFERRING
    return state.status


def _room_of(frame: bytes) -> int | None:
    """A non-negative decimal frame as an int (``None`` if it is not one)."""
    return int(frame) if 0 < len(frame) <= 18 and frame.isdigit() else None


ROOM_FAILED_COPIES = 8
"""``ROOM_FAILED`` goes again at most this many times to a peer that does not acknowledge it
(0.5 s, then twice as long each time up to :data:`ROOM_FAILED_MAX_INTERVAL_S`: about 23 s)."""

ROOM_FAILED_MAX_INTERVAL_S = 4.0
"""The longest wait between two copies of one ``ROOM_FAILED``."""


def new_opening() -> int:
    """A random non-zero 64-bit opening id (one per registration of a room id)."""
    return secrets.randbits(64) or 1


DEFAULT_ROOM_TIMEOUT_S = config.ROOM_TIMEOUT_S.default
"""Default bound of a room without progress that holds no ring region (``room_timeout_s``)."""

DEFAULT_FENCE_RESEND_S = 0.5
"""``ROOM_FENCE`` is sent again this often to a writer that has not answered it."""

DEFAULT_STALL_TIMEOUT_S = config.STALL_TIMEOUT_S.default
"""A room holding a writable ring region with no arrival for this long fails (its regions are
taken back)."""

DEFAULT_MAX_ROOMS_PER_PEER = config.MAX_ROOMS_PER_PEER.default
"""Most rooms registered at once whose writers are one prefill instance; registering one more
fails that room at once (it is not kept)."""

MAX_REFUSALS_KEPT = 1024
"""Most refused registrations whose reason ``room_failure`` still tells (the oldest go first)."""

DEFAULT_FENCE_TIMEOUT_S = config.FENCE_TIMEOUT_S.default
"""A fence still waiting for a live writer's ``ROOM_FENCED`` after this long frees its regions
anyway (a writer that answers PINGs but not ROOM_FENCE would otherwise hold them for good)."""


@dataclass(slots=True)
class _Fence:
    """The ring regions of a failed room, held until its writers can no longer write."""

    room: int
    reason: str
    allocations: list[int]
    awaiting: dict[int, str]
    """Writer rank -> its endpoint, for the writers that have not answered ``ROOM_FENCED``."""
    last_sent: float = float("-inf")
    started: float = 0.0
    """When the fence was set up (it frees its regions ``fence_timeout_s`` later at most)."""


class _Outgoing(NamedTuple):
    """A message to send once the lock is released."""

    endpoint: str
    frames: list[bytes]
    watermark: bool = False
    """A ``WATERMARK``: skipped if the peer already has it, unless ``force``."""
    force: bool = False


class DecodeStagingHandler:
    """Decode-side staging: ring regions, arrivals, scatter, watermarks, room lifecycle.

    **Side:** decode. Implements ``StagingHandler``.

    Args:
        allocator: the decode rank's staging ring (registered with the engine by the host).
        kv_buffers: the decode rank's paged KV pool (scattered into in place).
        decode_tp: attention TP size of decode.
        decode_rank: this rank's attention-TP rank.
        total_kv_heads: KV heads of the whole model.
        session_id: this rank's engine session id (carried by every message it answers).
        sender: non-blocking PUSH sockets to the prefill ranks' listeners.
        scatter_stream: CUDA only: the dedicated stream scatters run on.
        ordering: when a scatter has completed, so that its region is freed only then
            (default: the device's; see :mod:`~staging_contracts._staging.ordering`).
        stall_timeout_s: a room that holds a writable ring region without progress for this
            long fails (its regions are fenced, then freed), so one stuck prefill cannot pin
            the shared ring; the instance's other rooms that never had an arrival and hold
            only regions reserved as long ago fail with it (see **A fair ring**). Time spent
            waiting for ring space is not counted. ``None``: ``STAGING_CONTRACTS_STALL_TIMEOUT_S``,
            else :data:`DEFAULT_STALL_TIMEOUT_S` (as every ``None`` below: the variable of
            :mod:`~staging_contracts.config`, else the default).
        room_timeout_s: a room that holds no region and gets no ``STAGING_REQ`` for this
            long (from its registration, or from its last request or arrival) fails, so a
            room whose ``ROOM_META`` or ``ROOM_FAILED`` was lost for good, or whose prefill
            never starts it, still ends. ``None``: ``STAGING_CONTRACTS_ROOM_TIMEOUT_S``, else
            :data:`DEFAULT_ROOM_TIMEOUT_S`.
        clock: monotonic clock (tests pass a fake one).
        endpoint: this rank's control listener, where writers answer ``ROOM_FENCE``.
        liveness: peer liveness of the host; the handler watches each room's writers (and
            each fence's) while it needs them. ``None``: no watching (a dead writer's fence
            then holds its regions until the writer answers).
        fence_resend_s: how often an unanswered ``ROOM_FENCE`` is sent again.
        fence_timeout_s: a fence unanswered this long by live writers frees its regions
            anyway. ``None``: ``STAGING_CONTRACTS_FENCE_TIMEOUT_S``, else
            :data:`DEFAULT_FENCE_TIMEOUT_S`.
        max_rooms_per_peer: most rooms registered at once for one prefill instance (the set
            of a room's writers); one more is refused by ``register_room`` (see there).
            ``None``: ``STAGING_CONTRACTS_MAX_ROOMS_PER_PEER``, else
            :data:`DEFAULT_MAX_ROOMS_PER_PEER`.
        accept_anonymous_arrivals: count arrivals without a writer rank in regions of several
            writers (the reference's prefill sends none). Off by default: such arrivals cannot
            be told apart, so a duplicate could start the scatter before every writer landed;
            with it off, such an arrival fails the room.
        ring_share: the largest share of the ring one prefill instance (the set of writers of
            a room) may hold at once; a request past it is deferred (not answered) until the
            instance's own regions free, so one peer cannot pin the ring and starve the
            others. An instance that holds nothing always gets its region. ``None``:
            ``STAGING_CONTRACTS_RING_SHARE``, else 1.0: no cap, every request is answered (the
            ring overcommits, SPEC §2).
        resend_s: how often a room's ``ROOM_META`` (:meth:`announce`) goes again to a
            writer not heard from yet.
        integrity: check each writer's bytes against the digest its arrival carried (on
            CUDA the scatter is then waited for, and the region copied to the host);
            ``None`` (default): ``STAGING_CONTRACTS_INTEGRITY``, else off.
        arrival_keys: the MAC keys derived from the cluster secret: arrivals without a valid
            MAC are not authentic (``authorize`` refuses such a ``CHUNK_READY``,
            ``authentic_notification`` such a notification). ``None``: no secret.

    Raises:
        ConfigError: a variable of the environment that a ``None`` argument reads is
            unusable (a ``ValueError``, naming it).
        ValueError: the KV pool does not match ``total_kv_heads // decode_tp`` heads, or
            ``ring_share`` is not in ``(0, 1]``.
    """

    def __init__(
        self,
        *,
        allocator: StagingAllocator,
        kv_buffers: KVBufferTensors,
        decode_tp: int,
        decode_rank: int,
        total_kv_heads: int,
        session_id: str,
        sender: PeerSockets,
        scatter_stream: torch.cuda.Stream | None = None,
        stall_timeout_s: float | None = None,
        room_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        endpoint: str = "",
        liveness: PeerLiveness | None = None,
        fence_resend_s: float = DEFAULT_FENCE_RESEND_S,
        fence_timeout_s: float | None = None,
        max_rooms_per_peer: int | None = None,
        accept_anonymous_arrivals: bool = False,
        ring_share: float | None = None,
        ordering: DeviceOrdering | None = None,
        resend_s: float = DEFAULT_RESEND_S,
        integrity: bool | None = None,
        arrival_keys: ArrivalKeys | None = None,
    ) -> None:
        stall_timeout_s = config.STALL_TIMEOUT_S.value(stall_timeout_s)
        room_timeout_s = config.ROOM_TIMEOUT_S.value(room_timeout_s)
        fence_timeout_s = config.FENCE_TIMEOUT_S.value(fence_timeout_s)
        max_rooms_per_peer = config.MAX_ROOMS_PER_PEER.value(max_rooms_per_peer)
        ring_share = config.RING_SHARE.value(ring_share)
        self._resend = ResendBox(clock, resend_s)
        """``ROOM_META`` copies (see :meth:`announce`), flushed by :meth:`progress`."""
        self._failed_resend = ResendBox(
            clock, resend_s, backoff=2.0, max_interval_s=ROOM_FAILED_MAX_INTERVAL_S
        )
        """``ROOM_FAILED`` copies (see :meth:`report_failure`): kept past ``release_room``,
        until acknowledged, the peer is dead or their copies are spent."""
        self.stale_room_failed = 0
        """``ROOM_FAILED`` received for an opening that is not the room's current one
        (ignored: a late copy of an earlier registration of the room id)."""
        self._scatterer = ChunkScatter(
            allocator,
            kv_buffers,
            decode_tp=decode_tp,
            decode_rank=decode_rank,
            total_kv_heads=total_kv_heads,
            stream=scatter_stream,
            ordering=ordering,
        )
        self._geometry = self._scatterer.geometry
        self._allocator = allocator
        self._page_size = kv_buffers.page_size
        self._decode_tp = decode_tp
        self._decode_rank = decode_rank
        self._total_heads = total_kv_heads
        self.session_id = session_id
        self._verifier = ArrivalVerifier(
            self._scatterer,
            session_id=session_id,
            integrity=integrity_enabled(integrity),
            keys=arrival_keys,
        )
        self._stall_timeout = stall_timeout_s
        self._room_timeout = room_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._rooms: dict[int, RoomState] = {}
        self._tally = RoomTally()
        """Rooms ended here, by outcome and reason, with latencies (lock held)."""
        self.scattered_bytes = 0
        """Ring bytes of the regions scattered into the KV pool so far (lock held to add)."""
        self.chunks_scattered = 0
        """Regions (one per chunk) scattered so far (lock held to add)."""
        self._publisher = PrefillPublisher(sender)
        self._last_pass = 0.0
        self._watermark_cache: tuple[Watermark, list[bytes]] | None = None
        self._endpoint = endpoint
        self._liveness = liveness
        self._fence_resend = fence_resend_s
        if not (stall_timeout_s > 0 and fence_timeout_s > 0):
            raise ValueError(
                f"stall_timeout_s={stall_timeout_s!r} and fence_timeout_s={fence_timeout_s!r} "
                "must be > 0"
            )
        self._fence_timeout = fence_timeout_s
        if max_rooms_per_peer < 1:
            raise ValueError(f"max_rooms_per_peer={max_rooms_per_peer!r} must be >= 1")
        self._max_rooms_per_peer = max_rooms_per_peer
        self._rooms_per_peer: dict[tuple[str, ...], int] = {}
        """Registered rooms per prefill instance (its writers' endpoints)."""
        self._refused: OrderedDict[int, str] = OrderedDict()
        """Rooms whose registration was refused -> why (the latest MAX_REFUSALS_KEPT)."""
        self._fences: dict[int, _Fence] = {}
        self._accept_anonymous = accept_anonymous_arrivals
        if not 0 < ring_share <= 1:
            raise ValueError(f"ring_share={ring_share!r} must be in (0, 1]")
        self._quota_bytes = None if ring_share == 1 else ring_share * allocator.total_size
        self._usage: dict[tuple[str, ...], int] = {}
        """Ring bytes held per prefill instance (its writers' endpoints)."""
        self._owners: dict[int, tuple[tuple[str, ...], int, float]] = {}
        """Allocation id -> (its prefill instance, its bytes, when it was assigned)."""
        self._tracer = room_tracer("decode")
        """Spans of the rooms, when a tracer provider is configured (else ``None``)."""
        self._refusal: tuple[str, Callable[[int], None]] | None = None
        """Set by a drain: every new registration is refused with this reason, and told."""

    accepts_arrival_tags = True
    """``handle_chunk_arrival`` takes ``epoch`` and ``tag`` (the mixin passes them)."""

    @property
    def integrity(self) -> bool:
        """Whether the staged bytes are checked against their digests (fixed)."""
        return self._verifier.integrity

    def authentic_notification(self, payload: bytes) -> bool:
        """Whether a NIXL notification may complete a chunk: always without a secret; with
        one, only with a valid MAC (the caller drops it otherwise, counted as unauthorized).

        **Called by:** the listener thread, before the notification is handed to the mixin.
        """
        return self._verifier.authentic_notification(payload)

    @property
    def decode_tp(self) -> int:
        """Attention TP size of decode."""
        return self._decode_tp

    @property
    def decode_rank(self) -> int:
        """This rank's attention-TP rank."""
        return self._decode_rank

    @property
    def allocator(self) -> StagingAllocator:
        """The staging ring (read its ``live_count``, watermark, peak use)."""
        return self._allocator

    @property
    def fenced_rooms(self) -> dict[int, frozenset[int]]:
        """Rooms whose regions wait for a fence: room -> writer ranks not yet answered."""
        with self._lock:
            return {room: frozenset(f.awaiting) for room, f in self._fences.items()}

    def room_tally(self) -> RoomTallySnapshot:
        """How rooms ended on this rank so far; a success's latency runs from the room's first
        ``STAGING_REQ`` to its last scatter. **Called by:** monitoring, any thread."""
        with self._lock:
            return self._tally.snapshot()

    # ------------------------------------------------------------------ scheduler side

    def register_room(self, plan: RoomPlan) -> RoomStatus:
        """Register a room before decode sends its metadata to prefill.

        Idempotent: registering a known room again keeps its in-flight state. A prefix that is
        not page-aligned, or a plan that does not fit this rank, fails that room only.

        While the manager drains, every new room is refused the same way, with the reason
        ``refused: the manager is draining`` (see :meth:`refuse_new_rooms`).

        A room past ``max_rooms_per_peer`` rooms of its prefill instance is refused: it is
        not kept (``poll_room`` says ``None``, ``room_failure`` says why, ``release_room`` is
        a no-op), so refusals cost no state but their reasons (the latest
        :data:`MAX_REFUSALS_KEPT`); it may be registered again once rooms were released.

        **Called by:** the scheduler. **Blocking:** no.

        Returns:
            The room's status after registration.
        """
        with self._lock:
            existing = self._rooms.get(plan.room)
            if existing is not None:
                return existing.status
            self._resend.cancel_room(plan.room)  # nothing of an earlier opening goes again
            if self._refuse_registration(plan):
                return RoomStatus.FAILED
            state = RoomState(
                plan=plan,
                pages=torch.tensor(
                    plan.page_indices, dtype=torch.int64, device=self._geometry.device
                ),
                writer_ranks=frozenset(),
                last_progress=self._clock(),
                opening=new_opening(),
            )
            self._rooms[plan.room] = state
            if self._tracer is not None:
                self._tracer.start(plan.room)
            self._watch(peer.endpoint for peer in plan.peers)
            problem = self._plan_problem(plan)
            if problem is not None:
                self._fail(state, problem, FailureReason.REFUSED)
                return state.status
            state.writer_ranks = frozenset(
                prefill_ranks_for_decode(plan.prefill_tp, self._decode_tp, self._decode_rank)
            )
            unanswered = sorted(state.writer_ranks - {peer.tp_rank for peer in plan.peers})
            dead = [peer for peer in plan.peers if self._is_dead(peer.endpoint)]
            if unanswered:
                self._fail(
                    state,
                    f"no endpoint registered for prefill writer ranks {unanswered}",
                    FailureReason.REFUSED,
                )
            elif dead:  # declared dead already: liveness will not say it again
                self._fail(
                    state,
                    f"prefill writer rank {dead[0].tp_rank} ({dead[0].endpoint}) is dead",
                    FailureReason.PEER_DEAD,
                )
            return state.status

    def announce(self, room: int, frames: Sequence[bytes]) -> None:
        """Send a registered room's ``ROOM_META`` to its prefill peers now, and again every
        ``resend_s`` to each writer not heard from yet (no arrival of its rank), until the
        room succeeds, fails or is released: one lost ``ROOM_META`` does not leave the
        room waiting for its timeout (prefill handles a copy idempotently).

        **Called by:** the scheduler (``KVReceiver.send_metadata``). **Blocking:** no.
        """
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                return
            peers = [p.endpoint for p in state.plan.peers]
            ongoing = state.status in (RoomStatus.REGISTERED, RoomStatus.TRANSFERRING)
            if ongoing and not state.closing:
                for endpoint in peers:
                    self._resend.add(room, endpoint, frames, copies=-1)
        for endpoint in peers:
            self._publisher.send(endpoint, list(frames))

    def opening(self, room: int) -> int | None:
        """The current registration's opening id of a room (``None`` if it is unknown): what
        its ``ROOM_META`` and ``ROOM_FAILED`` carry."""
        with self._lock:
            state = self._rooms.get(room)
            return None if state is None else state.opening

    def report_failure(self, room: int, reason: str) -> None:
        """Tell a failed room's prefill peers (``ROOM_FAILED`` with the room's opening), now
        and again with a bounded backoff until each acknowledges it (``ROOM_FAILED_ACK``), is
        declared dead, or :data:`ROOM_FAILED_COPIES` copies went; the copies go on after
        ``release_room``. Without an endpoint of its own (nowhere to acknowledge) it is sent
        once, without an opening. Once per registration: a second call (the drain reported it
        already) does nothing.

        **Called by:** the scheduler (``KVReceiver.poll`` when it first sees the room failed),
        the drain gate (:meth:`abandon_room`).
        **Blocking:** no.
        """
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.failure_told:
                return
            state.failure_told = True
            peers = [p.endpoint for p in state.plan.peers]
            if self._endpoint:
                message = RoomFailed(room, reason, state.opening, self._endpoint)
                frames = message.to_frames()
                for endpoint in peers:
                    self._failed_resend.add(
                        room, endpoint, frames, copies=ROOM_FAILED_COPIES, tag=state.opening
                    )
            else:
                frames = RoomFailed(room, reason).to_frames()
        for endpoint in peers:
            self._publisher.send(endpoint, frames)

    def handle_room_failed(self, message: RoomFailed) -> None:
        """A prefill peer gave a room up: fail it, unless the message names another opening
        of the room id than the current one (a late copy: ignored, counted in
        :attr:`stale_room_failed`); acknowledge it either way when it names an opening.

        **Called by:** the listener thread (``ROOM_FAILED`` from prefill). **Blocking:** no.
        """
        with self._lock:
            state = self._rooms.get(message.room)
            stale = state is not None and message.opening not in (0, state.opening)
            if stale:
                self.stale_room_failed += 1
            peers = () if state is None else tuple(p.endpoint for p in state.plan.peers)
        if message.opening and self._endpoint and (not peers or message.reply_to in peers):
            ack = RoomFailedAck(message.room, message.opening, self._endpoint)
            self._publisher.send(message.reply_to, ack.to_frames())
        if stale:
            logger.info(
                "room %d: ROOM_FAILED of an earlier opening ignored (%s)",
                message.room,
                message.reason,
                extra={"room": message.room},
            )
            return
        self.fail_room(message.room, f"prefill failed the room: {message.reason}")

    def room_failed_acked(self, ack: RoomFailedAck) -> None:
        """A prefill peer heard this rank's ``ROOM_FAILED``: it is not sent to it again.

        **Called by:** the listener thread. **Blocking:** no.
        """
        self._failed_resend.ack(ack.room, ack.endpoint, RoomFailed.KIND, ack.opening)

    @property
    def room_failed_unacked(self) -> int:
        """``ROOM_FAILED`` messages still to be re-sent (not acknowledged yet)."""
        return len(self._failed_resend)

    def _refuse_registration(self, plan: RoomPlan) -> bool:
        """Count the room against its prefill instance, or refuse it past the cap or while
        draining (lock held)."""
        self._refused.pop(plan.room, None)
        if self._refusal is not None:
            reason, refused = self._refusal
            self._keep_refusal(plan.room, reason)
            refused(plan.room)
            return True
        owner = _owner(plan)
        held = self._rooms_per_peer.get(owner, 0)
        if held < self._max_rooms_per_peer:
            self._rooms_per_peer[owner] = held + 1
            return False
        reason = (
            f"registration refused: prefill instance {', '.join(owner) or '(none)'} already "
            f"has {held} rooms registered (max_rooms_per_peer={self._max_rooms_per_peer})"
        )
        self._keep_refusal(plan.room, reason)
        return True

    def _keep_refusal(self, room: int, reason: str) -> None:
        """Note why a registration was refused (the latest MAX_REFUSALS_KEPT; lock held)."""
        self._refused[room] = reason
        while len(self._refused) > MAX_REFUSALS_KEPT:
            self._refused.popitem(last=False)
        logger.warning("room %d: %s", room, reason, extra={"room": room})

    def _plan_problem(self, plan: RoomPlan) -> str | None:
        if plan.prefix_tokens % self._page_size:
            return (
                f"decode prefix of {plan.prefix_tokens} tokens is not aligned to "
                f"page_size={self._page_size}"
            )
        if plan.chunk_pages < 1 or not plan.page_indices:
            return f"empty transfer or chunk_pages={plan.chunk_pages} < 1"
        try:
            validate_tp_pair(plan.prefill_tp, self._decode_tp, self._total_heads)
        except ValueError as exc:
            return str(exc)
        if any(page < 0 or page >= self._geometry.pool_pages for page in plan.page_indices):
            return f"page indices outside the pool of {self._geometry.pool_pages} pages"
        if len({peer.pp_rank for peer in plan.peers}) > 1:
            return (
                "a pipeline-parallel prefill (peers of several pp ranks) is not supported by "
                "the staging path yet: each writer must carry every layer"
            )
        return None

    def poll_room(self, room: int) -> RoomStatus | None:
        """The room's status (``None`` if unknown), after completing its finished scatters
        (and, at most once per ``WAIT_SLICE_S`` whoever polls, the pass over every room).

        ``FAILED`` means done: a failed room is shown ``TRANSFERRING`` until no scatter into
        its pages can still land (none runs on a thread, none is queued on the device), so a
        scheduler that reuses the pages of a failed room never has them overwritten.

        **Called by:** the scheduler, any thread.
        """
        self._catch_up(room)
        with self._lock:
            state = self._rooms.get(room)
            return None if state is None else _shown(state)

    def _catch_up(self, room: int) -> None:
        """Before ``room``'s status is read: its own finished scatters reaped now, and the
        pass over every room (stalls, fences, re-sends) made at most once per
        ``WAIT_SLICE_S``, whoever asks. A pass per call cost a scheduler that polls N rooms
        N passes over N rooms a step, and a demo rank's 150 waiters (one pass each per
        slice) so much of this lock that the listener starved and live peers died."""
        self.progress(min_interval_s=WAIT_SLICE_S)
        with self._lock:
            state = self._rooms.get(room)
            freed = state is not None and self._reap_events(state)
        if freed:
            self._broadcast_watermark()

    def wait_room(self, room: int, timeout_s: float) -> RoomStatus | None:
        """Block until the room succeeded or failed, or ``timeout_s`` passed; its status then
        (``None`` if unknown).

        **Called by:** the scheduler or a driver, any thread but the listener's (which
        completes the room). **Blocking:** up to ``timeout_s``; woken as soon as the room
        ends on CPU, within ``WAIT_SLICE_S`` on CUDA (whose scatters end asynchronously:
        each wake reaps the room's finished ones, see :meth:`_catch_up`).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self._catch_up(room)
            with self._lock:
                state = self._rooms.get(room)
                shown = None if state is None else _shown(state)
                if shown is None or shown in (RoomStatus.SUCCESS, RoomStatus.FAILED):
                    return shown
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return shown
                self._idle.wait(min(remaining, WAIT_SLICE_S))

    def room_scattered(self, room: int) -> tuple[int, int] | None:
        """``(chunks, bytes)`` scattered into the room's pages so far (``None``: not
        registered). **Called by:** the decode scheduler (a transfer record), any thread."""
        with self._lock:
            state = self._rooms.get(room)
            return None if state is None else (state.chunks_scattered, state.bytes_scattered)

    def room_end(self, room: int) -> RoomEnd | None:
        """How the room ended, stamped when it did (``None``: not shown ended yet, see
        :meth:`poll_room`, or not registered). **Called by:** the decode scheduler (a
        transfer record), any thread."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.ended_at is None:
                return None
            shown = _shown(state)
            if shown not in (RoomStatus.SUCCESS, RoomStatus.FAILED):
                return None
            failure = None
            if shown is RoomStatus.FAILED:
                detail = state.failure or ""
                failure = RoomFailure(state.kind or classify(detail), detail)
            return RoomEnd(
                shown is RoomStatus.SUCCESS,
                failure,
                *state.ended_at,
                state.chunks_scattered,
                state.bytes_scattered,
            )

    def room_failure_record(self, room: int) -> RoomFailure | None:
        """:meth:`room_failure` typed where the room failed (a refused registration's reason
        read from its text)."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                refused = self._refused.get(room)
                return None if refused is None else RoomFailure.from_detail(refused)
            if _shown(state) is not RoomStatus.FAILED or state.failure is None:
                return None
            return RoomFailure(state.kind or classify(state.failure), state.failure)

    def room_failure(self, room: int) -> str | None:
        """Why a failed room failed, or its registration was refused (``None`` if it did not,
        is unknown, or is not shown failed yet: see :meth:`poll_room`)."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                return self._refused.get(room)
            if _shown(state) is not RoomStatus.FAILED:
                return None
            return state.failure

    def fail_room(self, room: int, reason: str) -> None:
        """Fail a room from outside (e.g. its prefill reported failure); frees its regions."""
        with self._lock:
            state = self._rooms.get(room)
            if state is not None and state.status is not RoomStatus.FAILED:
                self._fail(state, reason)
        self._send_fences()
        self._broadcast_watermark()

    def release_room(self, room: int, timeout: float = 10.0) -> None:
        """Tear a room down (after success, failure or abort); safe to call twice.

        Stops new arrivals for the room first, waits for scatters in flight (up to
        ``timeout``), fences the regions of a room released before it finished (they are freed
        once its writers answer, see the module's **Fencing**), frees the rest and broadcasts
        the watermark.

        **Called by:** the scheduler. **Blocking:** until in-flight scatters of the room end
        (at most ``timeout``; the handler's lock is released while it waits, and queued device
        scatters are polled, never synchronized).

        Raises:
            TimeoutError: a scatter of the room did not finish (or, on the device, complete)
                within ``timeout`` (the room stays registered and closing; call again).
        """
        deadline = self._clock() + timeout
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                self._refused.pop(room, None)
                return
            state.closing = True
            while state.scattering:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise TimeoutError(f"room {room}: a scatter did not finish in {timeout}s")
                self._idle.wait(remaining)
            # Queued device scatters: polled (event.query()) until what is left of the bound
            # passed (in real time: the device completes them in real time), the lock released
            # between polls (the listener needs it); never an unbounded synchronize.
            events_deadline = time.monotonic() + max(0.0, deadline - self._clock())
            while True:
                self._reap_events(state)
                if not state.pending_events:
                    break
                remaining = events_deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"room {room}: a queued scatter did not complete in {timeout}s"
                    )
                self._idle.wait(min(remaining, WAIT_SLICE_S))
            if state.regions:
                self._fail(state, "released before it finished", FailureReason.RELEASED_EARLY)
            for alloc_id in state.held_allocations():
                self._free(alloc_id)
            state.pending_events.clear()
            del self._rooms[room]
            if self._tracer is not None:  # still open: released before it ended
                self._tracer.end(room, "released before it finished", FailureReason.RELEASED_EARLY)
            self._resend.cancel_room(room)
            owner = _owner(state.plan)
            left = self._rooms_per_peer.get(owner, 1) - 1
            if left > 0:
                self._rooms_per_peer[owner] = left
            else:
                self._rooms_per_peer.pop(owner, None)
            self._unwatch(peer.endpoint for peer in state.plan.peers)
        self._publisher.unsubscribe_room(room)
        self._send_fences()
        self._broadcast_watermark()

    def rooms_in_flight(self) -> frozenset[int]:
        """The rooms registered and not yet shown succeeded or failed (for a drain).

        **Called by:** the manager's drain gate, any thread. **Blocking:** no.
        """
        self.progress()
        with self._lock:
            return frozenset(
                room
                for room, state in self._rooms.items()
                if _shown(state) not in (RoomStatus.SUCCESS, RoomStatus.FAILED)
            )

    def abandon_room(self, room: int, reason: str) -> None:
        """Fail a room (:meth:`fail_room`) and tell its prefill peers (:meth:`report_failure`).

        **Called by:** the manager's drain gate, when the drain's time ran out.
        """
        self.fail_room(room, reason)
        self.report_failure(room, reason)

    def refuse_new_rooms(self, reason: str, refused: Callable[[int], None]) -> None:
        """From now on refuse every room ``register_room`` is given, with ``reason`` (as a
        registration past ``max_rooms_per_peer`` is refused: not kept), calling
        ``refused(room)`` for each, with the handler's lock held.

        **Called by:** the manager's drain gate, when a drain begins. **Blocking:** no.
        """
        with self._lock:
            self._refusal = (reason, refused)

    @property
    def live_rooms(self) -> int:
        """Rooms registered and not yet released."""
        with self._lock:
            return len(self._rooms)

    def progress(self, min_interval_s: float = 0.0) -> None:
        """Free regions whose scatters completed; fail rooms that stalled; re-send fences.

        A room stalls when it holds a region its writers could write (the watermark says it
        is free) and no writer arrived for ``stall_timeout_s``; a room whose regions all wait
        for ring space held by other rooms is not stalled. A stalled room's instance loses its
        other never-written rooms too, and fences older than ``fence_timeout_s`` free their
        regions (see **A fair ring**).

        **Called by:** the listener's idle hook and ``poll_room``; any thread.

        Args:
            min_interval_s: do nothing if the last pass was less than this long ago.
        """
        freed = False
        now = self._clock()
        if now - self._last_pass < min_interval_s:
            return
        self._last_pass = now
        with self._lock:
            stalled: dict[tuple[str, ...], int] = {}
            for state in self._rooms.values():
                freed |= self._reap_events(state)
                if self._idle_too_long(state, now):
                    self._fail(
                        state,
                        f"no STAGING_REQ for {self._room_timeout}s (a lost ROOM_META or "
                        "ROOM_FAILED, or a prefill that never started the room)",
                        FailureReason.ROOM_BOUND,
                    )
                    continue
                if state.status is not RoomStatus.TRANSFERRING or not state.regions:
                    continue
                if not any(self._allocator.is_ready(r.allocation) for r in state.regions.values()):
                    # Waiting for ring space that other rooms hold is not a stall.
                    state.last_progress = now
                elif now - state.last_progress > self._stall_timeout:
                    self._fail(
                        state,
                        f"no progress for {self._stall_timeout}s while holding a writable region",
                        FailureReason.STALLED,
                    )
                    stalled.setdefault(_owner(state.plan), state.plan.room)
                    freed = True
            if stalled:
                self._take_back_idle(stalled, now)
            freed |= self._expire_fences(now)
        self._send_fences()
        for endpoint, frames in self._resend.take_due() + self._failed_resend.take_due():
            self._publisher.send(endpoint, frames)
        if freed:
            self._broadcast_watermark()

    def _idle_too_long(self, state: RoomState, now: float) -> bool:
        """A room that holds no region and has no scatter running, waiting for its next
        ``STAGING_REQ`` (registered, or between chunks) past ``room_timeout_s`` (lock held)."""
        return (
            state.status in (RoomStatus.REGISTERED, RoomStatus.TRANSFERRING)
            and not state.closing
            and not state.regions
            and not state.scattering
            and not state.pending_events
            and now - state.last_progress > self._room_timeout
        )

    def _take_back_idle(self, stalled: dict[tuple[str, ...], int], now: float) -> None:
        """Fail the rooms of stalled prefill instances that never had an arrival and hold
        only regions reserved ``stall_timeout_s`` ago or more (lock held): regions reserved
        rounds ahead would otherwise each wait for their own stall, one after the other."""
        for state in self._rooms.values():
            room = stalled.get(_owner(state.plan))
            if (
                room is None
                or state.status is not RoomStatus.TRANSFERRING
                or not state.regions
                or state.consumed
            ):
                continue
            if all(self._idle_region(region, now) for region in state.regions.values()):
                self._fail(
                    state,
                    f"taken back with room {room}: its prefill instance left a writable region "
                    f"unwritten for {self._stall_timeout}s, and this room's regions were never "
                    "written either",
                    FailureReason.STALLED,
                )

    def _idle_region(self, region: ChunkRegion, now: float) -> bool:
        """A region nobody wrote, reserved at least ``stall_timeout_s`` ago (lock held)."""
        if region.arrived or region.anonymous:
            return False
        owner = self._owners.get(region.allocation.alloc_id)
        return owner is not None and now - owner[2] >= self._stall_timeout

    def _expire_fences(self, now: float) -> bool:
        """Free the fences that waited ``fence_timeout_s`` for live writers (lock held)."""
        freed = False
        for fence in list(self._fences.values()):
            if now - fence.started <= self._fence_timeout:
                continue
            logger.warning(
                "room %d: writers %s did not answer ROOM_FENCE in %gs; its regions are freed",
                fence.room,
                sorted(fence.awaiting),
                self._fence_timeout,
                extra={"room": fence.room},
            )
            # The epoch needs no bump here: a region's epoch is its ring round, and whatever
            # is assigned over these bytes next has a later round, so a late arrival of this
            # room is dropped as stale; late bytes fail that room's integrity check (when on).
            freed |= self._clear_fence(fence, list(fence.awaiting))
        return freed

    # ------------------------------------------------------------------ listener side

    def handle_staging_req(
        self, room: int, chunk_idx: int, *, num_pages: int, session_id: str, pp_rank: int | None
    ) -> StagingReqOutcome:
        """Assign (or re-announce) the chunk's region and answer the room's prefill ranks.

        One region per (room, chunk), shared by the chunk's writers. Every prefill rank of the
        room (only those of ``pp_rank`` when given) gets the answer, is subscribed to watermark
        broadcasts and receives the current watermark at once (which also recovers a lost
        ``WATERMARK``). A chunk already consumed, beyond the room, with a page count that
        disagrees with the registered geometry, or for another session, is refused with the
        failure answer (offset -2); a geometry mismatch fails the room.

        **Called by:** the listener thread, through the mixin. **Blocking:** no.
        """
        out: list[_Outgoing] = []
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.closing:
                logger.warning(
                    "STAGING_REQ for unknown room %d chunk %d dropped",
                    room,
                    chunk_idx,
                    extra={"room": room},
                )
                return StagingReqOutcome.UNKNOWN_ROOM
            if not state.regions:  # a room waiting for requests got one (room_timeout_s)
                state.last_progress = self._clock()
            if state.first_request is None:
                state.first_request = self._clock()
            failed = state.failure if state.status is RoomStatus.FAILED else None
            outcome = self._answer_request(state, chunk_idx, num_pages, session_id, pp_rank, out)
        if failed is not None:
            # The room failed here earlier: its ROOM_FAILED (the cause) goes before the
            # refusal, so the writer fails the room for that cause, not as "refused".
            self.report_failure(room, failed)
        self._flush(out)
        self._send_fences()
        return outcome

    def _answer_request(
        self,
        state: RoomState,
        chunk_idx: int,
        num_pages: int,
        session_id: str,
        pp_rank: int | None,
        out: list[_Outgoing],
    ) -> StagingReqOutcome:
        plan = state.plan
        peers = [p for p in plan.peers if pp_rank is None or p.pp_rank == pp_rank]
        problem = None
        if session_id != self.session_id:
            problem = f"STAGING_REQ for session {session_id!r}, this rank is {self.session_id!r}"
        elif state.status is RoomStatus.FAILED:
            problem = f"room failed earlier: {state.failure}"
        elif chunk_idx >= plan.num_chunks:
            problem = f"chunk {chunk_idx} is beyond the room's {plan.num_chunks} chunks"
        elif chunk_idx in state.consumed:
            problem = f"chunk {chunk_idx} was already consumed"
        elif num_pages != plan.chunk_page_count(chunk_idx):
            self._fail(
                state,
                f"chunk {chunk_idx}: STAGING_REQ says {num_pages} pages, decode registered "
                f"{plan.chunk_page_count(chunk_idx)}",
            )
            problem = state.failure
        if problem is not None:
            logger.warning(
                "room %d: STAGING_REQ refused: %s", plan.room, problem, extra={"room": plan.room}
            )
            refusal = StagingRsp.oversized(plan.room, chunk_idx, session_id).to_frames()
            out.extend(_Outgoing(p.endpoint, refusal) for p in peers)
            return StagingReqOutcome.REJECTED
        region = state.regions.get(chunk_idx)
        outcome = StagingReqOutcome.SHARED
        if region is None:
            size = self._scatterer.region_bytes(plan.prefill_tp, num_pages)
            owner = _owner(plan)
            held = self._usage.get(owner, 0)
            if self._quota_bytes is not None and held and held + size > self._quota_bytes:
                # Over this prefill's share: no region yet. Its writers ask again (every
                # answer_s) and are answered once its own regions free.
                return StagingReqOutcome.DEFERRED
            allocation = self._allocator.assign(size)
            if allocation is None:
                self._fail(
                    state,
                    f"chunk {chunk_idx} needs {size} bytes, "
                    f"the ring has {self._allocator.total_size}",
                )
                refusal = StagingRsp.oversized(plan.room, chunk_idx, session_id).to_frames()
                out.extend(_Outgoing(p.endpoint, refusal) for p in peers)
                return StagingReqOutcome.OVERSIZED
            self._owners[allocation.alloc_id] = (owner, size, self._clock())
            self._usage[owner] = held + size
            region = ChunkRegion(
                allocation=allocation,
                num_pages=num_pages,
                page_start=chunk_idx * plan.chunk_pages,
                expected_writers=len(state.writer_ranks),
            )
            state.regions[chunk_idx] = region
            state.status = RoomStatus.TRANSFERRING
            state.last_progress = self._clock()
            outcome = StagingReqOutcome.ALLOCATED
        alloc = region.allocation
        answer = StagingRsp(
            plan.room, chunk_idx, alloc.offset, alloc.round, alloc.end, self.session_id
        ).to_frames()
        update = self._watermark_frames()
        # The current watermark follows the answer: on a re-request (SHARED) always, since
        # the peer may have lost the last one; otherwise only if the peer lacks it.
        force = outcome is StagingReqOutcome.SHARED
        for peer in peers:
            self._publisher.subscribe(peer.endpoint, plan.room)
            out.append(_Outgoing(peer.endpoint, answer))
            out.append(_Outgoing(peer.endpoint, update, watermark=True, force=force))
        return outcome

    def handle_chunk_arrival(
        self,
        room: int,
        chunk_idx: int,
        *,
        page_start: int,
        num_pages: int,
        session_id: str,
        writer_rank: int | None,
        epoch: int | None = None,
        tag: str | None = None,
    ) -> ArrivalOutcome:
        """Count one writer's arrival; scatter, check, free and broadcast once all writers
        arrived.

        Arrivals are de-duplicated by writer rank; the geometry must agree with the region's;
        a writer that does not feed this rank, or a failed scatter, fails the room (the
        arrival is never silently lost). An ``epoch`` other than the region's (a stale
        arrival) is dropped (``UNKNOWN``); the digest in ``tag`` is checked against the
        writer's bytes after the scatter, and a mismatch fails the room (``integrity``).

        **Called by:** the listener thread (``CHUNK_READY`` or an engine notification).
        **Blocking:** on CPU, for the scatter.
        """
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.closing or state.status is RoomStatus.FAILED:
                return ArrivalOutcome.UNKNOWN
            region = state.regions.get(chunk_idx)
            if region is None:
                return (
                    ArrivalOutcome.DUPLICATE
                    if chunk_idx in state.consumed
                    else ArrivalOutcome.UNKNOWN
                )
            problem = self._arrival_problem(
                state, region, page_start, num_pages, session_id, writer_rank
            )
            if problem is not None:
                self._fail(state, problem)
                logger.warning(
                    "room %d chunk %d: arrival rejected: %s",
                    room,
                    chunk_idx,
                    problem,
                    extra={"room": room},
                )
                rejected = True
            elif epoch is not None and epoch != region.allocation.round:
                logger.warning(
                    "room %d chunk %d: arrival of writer %s for region epoch %d dropped (the "
                    "region's is %d)",
                    room,
                    chunk_idx,
                    writer_rank,
                    epoch,
                    region.allocation.round,
                    extra={"room": room},
                )
                return ArrivalOutcome.UNKNOWN
            else:
                rejected = False
                digest = self._verifier.digest_of(tag)
                if digest is not None and writer_rank is not None:
                    region.digests.setdefault(writer_rank, digest)
                if writer_rank is None:
                    region.anonymous += 1
                elif writer_rank in region.arrived:
                    return ArrivalOutcome.DUPLICATE
                else:
                    region.arrived.add(writer_rank)
                    for peer in state.plan.peers:  # it had the ROOM_META
                        if peer.tp_rank == writer_rank:
                            self._resend.ack(room, peer.endpoint, _ROOM_META)
                state.last_progress = self._clock()
                if not region.complete:
                    return ArrivalOutcome.WAITING
                del state.regions[chunk_idx]
                state.consumed.add(chunk_idx)
                state.scattering += 1
        if rejected:
            self._send_fences()
            self._broadcast_watermark()
            return ArrivalOutcome.REJECTED
        return self._scatter(state, chunk_idx, region)

    def _arrival_problem(
        self,
        state: RoomState,
        region: ChunkRegion,
        page_start: int,
        num_pages: int,
        session_id: str,
        writer_rank: int | None,
    ) -> str | None:
        if session_id != self.session_id:
            return f"arrival for session {session_id!r}, this rank is {self.session_id!r}"
        if page_start != region.page_start or num_pages != region.num_pages:
            return (
                f"arrival covers pages [{page_start}, {page_start + num_pages}), the region "
                f"holds [{region.page_start}, {region.page_start + region.num_pages})"
            )
        if writer_rank is not None and writer_rank not in state.writer_ranks:
            return f"writer rank {writer_rank} does not feed decode rank {self._decode_rank}"
        if writer_rank is None and region.expected_writers > 1 and not self._accept_anonymous:
            return (
                f"an arrival without a writer rank in a region of {region.expected_writers} "
                "writers cannot be told from a duplicate"
            )
        return None

    def _scatter(self, state: RoomState, chunk_idx: int, region: ChunkRegion) -> ArrivalOutcome:
        plan = state.plan
        alloc = region.allocation
        pages = state.pages[region.page_start : region.page_start + region.num_pages]
        try:
            event = self._scatterer.scatter(alloc, pages, plan.prefill_tp)
        except Exception as exc:  # any scatter failure fails the room, never the thread
            logger.exception(
                "room %d chunk %d: scatter failed", plan.room, chunk_idx, extra={"room": plan.room}
            )
            token, known = self._failed_scatter_token(plan.room, chunk_idx)
            with self._lock:
                state.scattering -= 1
                # Not at once: what the scatter enqueued before it raised may still read the
                # region. Freed once that completed, like a scatter that succeeded (held for
                # good when its completion cannot be told).
                if known and token is None:
                    self._free(alloc.alloc_id)
                elif known:
                    state.pending_events.append((token, alloc.alloc_id))
                self._fail(
                    state, f"scatter of chunk {chunk_idx} failed: {exc}", FailureReason.ENGINE_ERROR
                )
                self._idle.notify_all()
            self._broadcast_watermark()
            return ArrivalOutcome.REJECTED
        problem = self._check_region(state, chunk_idx, region, event)
        with self._lock:
            state.scattering -= 1
            if event is None:
                self._free(alloc.alloc_id)
            else:
                state.pending_events.append((event, alloc.alloc_id))
            if problem is None:
                self.scattered_bytes += alloc.end - alloc.offset
                self.chunks_scattered += 1
                state.bytes_scattered += alloc.end - alloc.offset
                state.chunks_scattered += 1
            if problem is not None and state.status is not RoomStatus.FAILED:
                self._fail(state, problem)
            elif problem is None and self._tracer is not None:
                self._tracer.chunk(plan.room, chunk_idx, region.num_pages)
            self._maybe_succeed(state)
            self._idle.notify_all()
        if event is None or problem is not None:
            self._send_fences()
            self._broadcast_watermark()
        return ArrivalOutcome.COMPLETE if problem is None else ArrivalOutcome.REJECTED

    def _check_region(
        self, state: RoomState, chunk_idx: int, region: ChunkRegion, event: object | None
    ) -> str | None:
        """The integrity check of a scattered region (``None``: it passed or has no digests);
        on CUDA the scatter is waited for first (bounded by the device)."""
        if not region.digests:
            return None
        try:
            if event is not None:
                self._scatterer.ordering.wait(event)
            return self._verifier.check(state.plan, chunk_idx, region)
        except Exception as exc:  # a check that cannot run must not pass the room
            logger.exception(
                "room %d chunk %d: integrity check failed",
                state.plan.room,
                chunk_idx,
                extra={"room": state.plan.room},
            )
            return f"{INTEGRITY_FAILURE}: chunk {chunk_idx}: the check could not run: {exc}"

    def _failed_scatter_token(self, room: int, chunk_idx: int) -> tuple[object | None, bool]:
        """The ordering's token for what a scatter enqueued before it raised, and whether
        there is one: a scatter that fails part-way may have left copies on its stream that
        still read the region, so the region is freed only once they completed. ``False``
        when even the token cannot be had (a broken device): the region then stays held, since
        a late copy could otherwise read a region that another room's writer fills."""
        try:
            return self._scatterer.ordering.scattered(), True
        except Exception:  # the device is unusable: hold the region rather than guess
            logger.exception(
                "room %d chunk %d: no completion token after the failed scatter; its region "
                "stays held",
                room,
                chunk_idx,
                extra={"room": room},
            )
            return None, False

    def authorize(self, frames: Sequence[bytes], sender: str) -> bool:
        """Whether an authenticated peer may send this message (authorisation per room).

        ``STAGING_REQ``, ``CHUNK_READY`` and ``ROOM_FAILED`` of a room are accepted only from
        that room's registered prefill peers, and a ``CHUNK_READY`` naming a writer rank only
        from that writer; ``ROOM_FENCED`` only from the writer it names, for a fence that
        waits for it. With a cluster secret a ``CHUNK_READY`` must also carry a valid MAC
        (see :mod:`~staging_contracts._decode.integrity`), whatever its room. A message for a
        room this rank does not know, or that cannot be parsed,
        is let through (the handler drops the first, the codec rejects the second); other
        kinds are not this handler's to judge.

        **Called by:** the listener thread, before the message is handled. **Blocking:** no.
        """
        kind = bytes(frames[0]) if frames else b""
        if kind not in _ROOM_KINDS or len(frames) < 2:
            return True
        if kind == _CHUNK_READY and not self._verifier.authentic_frames(frames):
            return False
        room = _room_of(frames[1])
        if room is None:
            return True
        with self._lock:
            if kind == RoomFenced.KIND:
                fence = self._fences.get(room)
                rank = _room_of(frames[3]) if len(frames) > 3 else None
                return fence is None or (rank is not None and fence.awaiting.get(rank) == sender)
            state = self._rooms.get(room)
            if state is None:
                return True
            peers = state.plan.peers
        if kind == _CHUNK_READY and len(frames) > 6:
            rank = _room_of(frames[6])
            return any(p.tp_rank == rank and p.endpoint == sender for p in peers)
        return any(p.endpoint == sender for p in peers)

    def writer_fenced(self, room: int, session_id: str, writer_rank: int) -> None:
        """A writer answered ``ROOM_FENCED``: it will not write into the room's regions again.

        Frees the room's fenced regions once every writer answered (or was declared dead).
        An answer for another session, or for no fence, is ignored.

        **Called by:** the listener thread. **Blocking:** no.
        """
        if session_id != self.session_id:
            logger.warning(
                "ROOM_FENCED for session %r ignored (this rank is %r)", session_id, self.session_id
            )
            return
        with self._lock:
            fence = self._fences.get(room)
            freed = fence is not None and self._clear_fence(fence, [writer_rank])
        if freed:
            self._broadcast_watermark()

    def peer_dead(self, endpoint: str) -> None:
        """A prefill peer was declared dead: fail every unfinished room it writes into, and
        stop waiting for its fence answers.

        **Called by:** the listener thread (peer liveness). **Blocking:** no.
        """
        freed = False
        self._failed_resend.cancel_endpoint(endpoint)
        with self._lock:
            for state in self._rooms.values():
                if state.status in (RoomStatus.SUCCESS, RoomStatus.FAILED):
                    continue
                dead = [p.tp_rank for p in state.plan.peers if p.endpoint == endpoint]
                if dead:
                    self._fail(
                        state,
                        f"prefill writer rank {dead[0]} ({endpoint}) is dead",
                        FailureReason.PEER_DEAD,
                    )
                    freed = True
            for fence in list(self._fences.values()):
                ranks = [rank for rank, e in fence.awaiting.items() if e == endpoint]
                if ranks:
                    freed |= self._clear_fence(fence, ranks)
        self._send_fences()
        if freed:
            self._broadcast_watermark()

    # ------------------------------------------------------------------ internals (lock held)

    def _maybe_succeed(self, state: RoomState) -> None:
        if (
            state.status is RoomStatus.TRANSFERRING
            and len(state.consumed) == state.plan.num_chunks
            and not state.pending_events
            and not state.scattering
        ):
            state.status = RoomStatus.SUCCESS
            if not state.ended:
                state.ended = True
                state.ended_at = (time.monotonic(), _wall_clock())
                start = state.first_request
                latency = None if start is None else self._clock() - start
                self._tally.ended(Outcome.SUCCESS, latency_s=latency)
            self._resend.cancel_room(state.plan.room)
            self._idle.notify_all()
            if self._tracer is not None:
                self._tracer.end(state.plan.room, None)

    def _reap_events(self, state: RoomState) -> bool:
        done_ = self._scatterer.ordering.done
        done = [(event, alloc_id) for event, alloc_id in state.pending_events if done_(event)]
        for item in done:
            state.pending_events.remove(item)
            self._free(item[1])
        if done:
            self._maybe_succeed(state)
            self._idle.notify_all()  # a failed room may be drained now (see _shown)
        return bool(done)

    def _fail(self, state: RoomState, reason: str, kind: FailureReason | None = None) -> None:
        """Fail the room; ``kind``: why, where the caller knows it (``None``: read from
        ``reason``, e.g. a prefill's ``ROOM_FAILED`` text)."""
        state.status = RoomStatus.FAILED
        state.failure = reason
        state.kind = kind or classify(reason)
        if self._tracer is not None:
            self._tracer.end(state.plan.room, reason, state.kind)
        if not state.ended:
            state.ended = True
            state.ended_at = (time.monotonic(), _wall_clock())
            self._tally.ended(Outcome.FAILED, state.kind)
        self._resend.cancel_room(state.plan.room)
        self._idle.notify_all()
        endpoints = {peer.tp_rank: peer.endpoint for peer in state.plan.peers}
        awaiting: dict[int, str] = {}
        held: list[int] = []
        for region in state.regions.values():
            held.append(region.allocation.alloc_id)
            # An anonymous arrival does not say who landed: every writer may still write.
            pending = (
                state.writer_ranks if region.anonymous else state.writer_ranks - region.arrived
            )
            for rank in pending:
                endpoint = endpoints.get(rank)
                if endpoint is not None and not self._is_dead(endpoint):
                    awaiting[rank] = endpoint
        state.regions.clear()
        if awaiting:
            fence = self._fences.get(state.plan.room)
            if fence is None:
                fence = self._fences[state.plan.room] = _Fence(
                    state.plan.room, reason, [], {}, started=self._clock()
                )
                self._watch(awaiting.values())
            else:
                self._watch(e for r, e in awaiting.items() if r not in fence.awaiting)
            fence.allocations.extend(held)
            fence.awaiting.update(awaiting)
            fence.last_sent = float("-inf")
        else:
            for alloc_id in held:
                self._free(alloc_id)
        logger.warning(
            "room %d failed: %s", state.plan.room, reason, extra={"room": state.plan.room}
        )

    def _free(self, alloc_id: int) -> None:
        """Free a region and take it off its prefill instance's share (lock held)."""
        self._allocator.free(alloc_id)
        owner = self._owners.pop(alloc_id, None)
        if owner is not None:
            left = self._usage[owner[0]] - owner[1]
            if left:
                self._usage[owner[0]] = left
            else:
                del self._usage[owner[0]]

    def _clear_fence(self, fence: _Fence, ranks: Sequence[int]) -> bool:
        """Drop answered (or dead) writers of a fence; free it when none is left."""
        for rank in ranks:
            endpoint = fence.awaiting.pop(rank, None)
            if endpoint is not None:
                self._unwatch([endpoint])
        if fence.awaiting:
            return False
        for alloc_id in fence.allocations:
            self._free(alloc_id)
        del self._fences[fence.room]
        return True

    def _is_dead(self, endpoint: str) -> bool:
        return self._liveness is not None and self._liveness.is_dead(endpoint)

    def _watch(self, endpoints: Iterable[str]) -> None:
        if self._liveness is not None:
            for endpoint in endpoints:
                self._liveness.watch(endpoint)

    def _unwatch(self, endpoints: Iterable[str]) -> None:
        if self._liveness is not None:
            for endpoint in endpoints:
                self._liveness.unwatch(endpoint)

    # ------------------------------------------------------------------ sending (no lock)

    def _watermark_frames(self) -> list[bytes]:
        """The current watermark, encoded (cached until it moves)."""
        watermark = self._allocator.get_watermark()
        cached = self._watermark_cache
        if cached is None or cached[0] != watermark:
            frames = WatermarkUpdate(watermark.round, watermark.tail, self.session_id).to_frames()
            cached = self._watermark_cache = (watermark, frames)
        return cached[1]

    def _send_fences(self) -> None:
        """Send ``ROOM_FENCE`` to every writer of a fence that is due (new, or unanswered for
        ``fence_resend_s``)."""
        now = self._clock()
        out: list[tuple[str, list[bytes]]] = []
        with self._lock:
            for fence in self._fences.values():
                if now - fence.last_sent < self._fence_resend:
                    continue
                fence.last_sent = now
                message = RoomFence(fence.room, self.session_id, self._endpoint, fence.reason)
                encoded = message.to_frames()
                out.extend((endpoint, encoded) for endpoint in fence.awaiting.values())
        for endpoint, frames in out:
            self._publisher.send(endpoint, frames)

    def _broadcast_watermark(self) -> None:
        self._publisher.broadcast_watermark(self._watermark_frames())

    def _flush(self, out: list[_Outgoing]) -> None:
        for message in out:
            if message.watermark:
                self._publisher.send_watermark(
                    message.endpoint, message.frames, force=message.force
                )
            else:
                self._publisher.send(message.endpoint, message.frames)


def peers_for(
    prefill_endpoints: Sequence[str], prefill_tp: int, decode_tp: int, decode_rank: int
) -> tuple[PrefillPeer, ...]:
    """The prefill peers of a decode rank, given every prefill rank's listener endpoint."""
    return tuple(
        PrefillPeer(rank, prefill_endpoints[rank])
        for rank in prefill_ranks_for_decode(prefill_tp, decode_tp, decode_rank)
    )
