"""Wiring shared by every staging backend: contexts, handler, writer, listener hooks.

Backends differ only in their engine and bootstrap; everything else about staging is the same,
so it lives here, in functions of the host (typed by :class:`StagingBackend`), rather than in
a base class every backend would have to inherit in a particular order.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

import torch

from .. import config
from .._control.integrity import ArrivalKeys
from .._control.liveness import PeerLiveness
from .._control.room_messages import RoomFence, RoomFenced
from .._control.security import ControlSecurity
from .._control.transport import LogThrottle, PeerSockets
from .._control.wire import MalformedMessage
from .._decode.handler import DecodeStagingHandler
from .._prefill.books import RegionAnswerTable, WatermarkTracker
from .._prefill.writer import ArrivalMode, PrefillTimeouts, StagingWriter
from .._staging.allocator import StagingAllocator
from ..protocols import (
    ArrivalOutcome,
    DecodeStagingContext,
    KVBufferTensors,
    PrefillStagingContext,
    StagingHandler,
    StagingHostCore,
    TransferEngine,
)
from ..stats import StagingStats
from ._drain import join_drain

__all__ = [
    "StagingBackend",
    "enable_decode_staging",
    "enable_prefill_staging",
    "staging_idle",
]

logger = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.01
"""How often the listener's idle hook completes scatters and checks stalled rooms."""


class StagingBackend(StagingHostCore, Protocol):
    """A staging host built on ``CommonKVManager``: the contract plus engine and sockets.

    ``kv_buffer_tensors`` is not a member: it is optional in the contract (a host need not
    declare it), so a host that leaves it out is still a ``StagingBackend``; the set-up
    functions below assign it (see :func:`_give_pool`).
    """

    engine: TransferEngine
    peers: PeerSockets
    liveness: PeerLiveness
    pp_size: int
    security: ControlSecurity | None
    unauthorized: int

    @property
    def endpoint(self) -> str: ...

    def register_control(self, kind: bytes, handler: Callable[[list[bytes]], None]) -> None: ...

    def add_authorizer(self, authorizer: Callable[[list[bytes], str], bool]) -> None: ...

    def attach_staging_handler(self, handler: StagingHandler) -> None: ...
    def _handle_chunk_notification(self, payload: bytes) -> ArrivalOutcome | None: ...
    def staging_stats(self) -> StagingStats: ...


def _give_pool(backend: StagingBackend, kv_buffers: KVBufferTensors) -> None:
    """Set the optional ``kv_buffer_tensors`` member, declared or not.

    A host that declares it gets the pool in its declared attribute; one that does not gets
    an instance attribute. Either way the contract's type (``KVBufferTensors | None``) holds.
    """
    setattr(backend, "kv_buffer_tensors", kv_buffers)  # noqa: B010 - optional member, not in the Protocol


def _set_context(
    backend: StagingBackend, ctx: DecodeStagingContext | PrefillStagingContext
) -> None:
    """Assign the host's ``_staging_ctx`` by name: it is read-only in the Protocol (so that a
    host may declare it the way the runtime check accepts, a narrower type included)."""
    setattr(backend, "_staging_ctx", ctx)  # noqa: B010 - read-only in the Protocol


def enable_decode_staging(
    backend: StagingBackend,
    *,
    kv_buffers: KVBufferTensors,
    ring_bytes: int | None = None,
    scatter_stream: torch.cuda.Stream | None = None,
    stall_timeout_s: float | None = None,
    ring_share: float | None = None,
    room_timeout_s: float | None = None,
    integrity: bool | None = None,
    fence_timeout_s: float | None = None,
    max_rooms_per_peer: int | None = None,
) -> DecodeStagingHandler:
    """Give a decode backend its staging ring, context and handler.

    The ring (one ``uint8`` tensor on ``kv_args.device``) is registered with the engine once.
    ``ring_share`` caps the share of the ring one prefill instance may hold at once (see
    :class:`~staging_contracts._decode.handler.DecodeStagingHandler`; 1.0, no cap, by default).
    ``stall_timeout_s`` (10 s) and ``room_timeout_s`` (30 s) bound a room without progress,
    with and without a ring region (see the handler). ``integrity`` checks the staged bytes
    against their tags (``None``: ``STAGING_CONTRACTS_INTEGRITY``, else off); with the cluster
    secret, arrivals need a valid MAC (the others are dropped and counted in the manager's
    ``unauthorized``).
    A room that leaves a writable region unwritten for ``stall_timeout_s`` has its regions
    taken back, and ``fence_timeout_s`` (10 s) frees a fence that live writers left unanswered
    that long (the handler's **A fair ring**).
    ``max_rooms_per_peer`` (1024) caps the rooms registered at once for one prefill instance.
    Every argument left ``None`` reads its ``STAGING_CONTRACTS_*`` variable, else takes its
    default (:mod:`~staging_contracts.config`; ``ring_bytes``: ``STAGING_CONTRACTS_RING_BYTES``,
    else 64 MiB). The handler is registered with the manager's drain gate, where it has one
    (``CommonKVManager.close(drain_s=...)``).

    **Side:** decode. **Called by:** the backend's constructor or the scheduler, before the
    listener starts.

    Returns:
        The attached handler (register rooms on it).

    Raises:
        ConfigError: a variable read for an argument left ``None`` is unusable.
    """
    ring_bytes = config.RING_BYTES.value(ring_bytes)
    kv_args = backend.kv_args
    allocator = StagingAllocator(ring_bytes, device=kv_args.device)
    backend.engine.register(allocator.base_ptr, ring_bytes)
    _give_pool(backend, kv_buffers)
    _set_context(backend, DecodeStagingContext(allocator))
    handler = DecodeStagingHandler(
        allocator=allocator,
        kv_buffers=kv_buffers,
        decode_tp=backend.attn_tp_size,
        decode_rank=kv_args.engine_rank,
        total_kv_heads=kv_args.total_kv_head_num,
        session_id=backend.engine.session_id,
        sender=backend.peers,
        scatter_stream=scatter_stream,
        stall_timeout_s=stall_timeout_s,
        room_timeout_s=room_timeout_s,
        ring_share=ring_share,
        fence_timeout_s=fence_timeout_s,
        max_rooms_per_peer=max_rooms_per_peer,
        endpoint=backend.endpoint,
        liveness=backend.liveness,
        integrity=integrity,
        arrival_keys=_arrival_keys(backend),
    )
    backend.attach_staging_handler(handler)

    def on_fenced(frames: list[bytes]) -> None:
        answer = RoomFenced.from_frames(frames)
        handler.writer_fenced(answer.room, answer.session_id, answer.writer_rank)

    backend.register_control(RoomFenced.KIND, on_fenced)
    backend.add_authorizer(handler.authorize)
    backend.liveness.subscribe(handler.peer_dead)
    join_drain(backend, handler)
    return handler


def enable_prefill_staging(
    backend: StagingBackend,
    *,
    kv_buffers: KVBufferTensors,
    max_chunk_pages: int,
    timeouts: PrefillTimeouts | None = None,
    stream: torch.cuda.Stream | None = None,
    arrival: ArrivalMode | None = None,
    integrity: bool | None = None,
) -> StagingWriter:
    """Give a prefill backend its staging context and writer.

    **Side:** prefill. **Called by:** the backend's constructor or the scheduler, on its own
    thread, once per rank before the first room (the writer's mode is fixed from then on).

    Args:
        backend: the prefill manager.
        kv_buffers: this rank's paged KV pool (read in place by the writer's gathers).
        max_chunk_pages: the largest chunk, in pages (sizes the staging buffer).
        timeouts: bounds of each chunk's waits (defaults of :class:`PrefillTimeouts`).
        stream: CUDA only: the stream gathers run on.
        arrival: how the writer tells decode that a write landed (see
            :data:`~staging_contracts._prefill.writer.ArrivalMode`): ``"notification"``, in
            the bulk write's own notification (the engine must have notifications); ``"zmq"``,
            a ``CHUNK_READY`` message to decode's listener, sent by the prefill transfer
            worker's thread once the write returned (what the reference's NIXL decode reads;
            any engine can). ``None`` (default): the manager's own mode, its ``arrival``
            (a member of the contract): ``"notification"`` for ``NixlKVManager`` by default
            and ``LocalKVManager``, ``"zmq"`` for Mooncake, Ascend and
            ``NixlKVManager(arrival="zmq")``, whose agent has no notifications. Our decode
            accepts both.
        integrity: tag each write with the digest of its staged bytes (``None``:
            ``STAGING_CONTRACTS_INTEGRITY``, else off); with the cluster secret every arrival
            also carries a MAC.

    Returns:
        The writer (one per rank; its staging buffer is registered with the engine).

    Raises:
        NotImplementedError: ``pp_size > 1`` (writers split by pipeline stage are not
            staged yet).
        ValueError: ``arrival="notification"`` on a backend whose engine has no
            notifications, or an unknown ``arrival`` (checked by the writer; the backend is
            left without staging).
    """
    if backend.pp_size != 1:
        raise NotImplementedError(
            f"staging with a pipeline-parallel prefill (pp_size={backend.pp_size}) is not "
            "supported yet: each writer must carry every layer of a chunk"
        )
    kv_args = backend.kv_args
    watermarks = WatermarkTracker()
    regions = RegionAnswerTable(gated=True)  # answers only for chunks of open rooms asked
    writer = StagingWriter(
        kv_buffers=kv_buffers,
        engine=backend.engine,
        sender=backend.peers,
        watermarks=watermarks,
        regions=regions,
        prefill_tp=backend.attn_tp_size,
        prefill_rank=kv_args.engine_rank,
        total_kv_heads=kv_args.total_kv_head_num,
        max_chunk_pages=max_chunk_pages,
        pp_rank=None if backend.pp_size == 1 else kv_args.pp_rank,
        timeouts=timeouts,
        stream=stream,
        liveness=backend.liveness,
        arrival=backend.arrival if arrival is None else arrival,
        integrity=integrity,
        arrival_keys=_arrival_keys(backend),
    )
    # only once the writer exists: a refused arrival leaves the backend as it was
    _give_pool(backend, kv_buffers)
    _set_context(backend, PrefillStagingContext(watermarks, regions, idle=writer.resend_arrivals))
    backend.register_control(
        RoomFence.KIND, lambda frames: writer.handle_room_fence(RoomFence.from_frames(frames))
    )
    backend.add_authorizer(writer.authorize)
    backend.liveness.subscribe(writer.peer_dead)
    return writer


def _arrival_keys(backend: StagingBackend) -> ArrivalKeys | None:
    security = backend.security
    return None if security is None else security.arrival_keys


_forged_log = LogThrottle(logger, "unauthenticated notifications")
_forged_lock = threading.Lock()
"""Guards ``_forged_log``: every listener thread of the process may drop a forged one."""


def _note_forged(peer: str) -> None:
    with _forged_lock:
        admitted = _forged_log.admit()
    if admitted:
        logger.warning("notification from %s without a valid MAC: dropped", peer)


def staging_idle(backend: StagingBackend) -> None:
    """The listener's idle work for a staging backend.

    Delivers the engine's arrival notifications (NIXL) to the mixin, pings watched peers and
    declares silent ones dead (peer liveness), and every ``PROGRESS_INTERVAL_S`` lets the
    decode handler free finished scatters, fail stalled rooms and re-send fences; on prefill
    it runs the writer's idle work (re-sends of unacknowledged ``CHUNK_READY``). With the
    cluster secret a notification without a valid MAC is dropped and counted in
    ``unauthorized`` (whoever sent it). A malformed notification is counted and logged, any
    other error delivering one is logged with its cause, and the remaining notifications are
    still delivered; the listener keeps serving.

    **Called by:** the backend's ``_on_idle``, on the listener thread.
    """
    engine = backend.engine
    handler = backend._staging_handler
    if engine.supports_notifications:
        for note in engine.poll_notifications():
            if isinstance(handler, DecodeStagingHandler) and not handler.authentic_notification(
                note.payload
            ):
                backend.unauthorized += 1
                _note_forged(note.peer)
                continue
            try:
                backend._handle_chunk_notification(note.payload)
            except MalformedMessage as exc:
                logger.warning("malformed notification from %s dropped: %s", note.peer, exc)
            except Exception:  # one bad arrival must not lose the others of the batch
                logger.exception("delivering a notification from %s failed", note.peer)
    backend.liveness.tick()
    if isinstance(handler, DecodeStagingHandler):
        handler.progress(min_interval_s=PROGRESS_INTERVAL_S)
    ctx = backend._staging_ctx
    if isinstance(ctx, PrefillStagingContext) and ctx.idle is not None:
        ctx.idle()  # re-sends of CHUNK_READY not yet acknowledged
