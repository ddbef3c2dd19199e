"""The one body of a rank: what a demo rank (``_cluster.rank``, a list of requests), a soak
rank (``_cluster.soak_rank``, served commands) and the harness's ranks (``testing._harness``,
in one process or a process each) build alike.

:class:`RankBody` is a rank's backend (built in this process from a spec string, a backend
class or a factory) and what
every path does with it: trust peers, count registered regions, close. The staged sides add
their staging set-up: :class:`DecodeBody` (an empty pool, the decode handler, the published
ring) and :class:`PrefillBody` (a filled pool, the staging writer and its transfers). A demo
rank's per-token and raw paths (``_cluster.plain_paths``) use :class:`RankBody` as it is.

Nothing here starts the control listener: the caller does (``body.common.start()``), after
whatever must precede it (a metrics pusher, a fault on the peer sockets, device settling).

**Thread:** the rank's main thread (the harness's, in one process) builds and closes a body.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypeAlias

import torch

from .. import config as settings
from .._decode.handler import DecodeStagingHandler
from .._prefill.writer import DecodeTarget, PrefillTimeouts, StagingWriter
from ..backends import resolve_backend
from ..backends._common import CommonKVManager, Role
from ..backends._kv_requests import DecodeTransfers, KVReceiver, KVSender, PrefillTransfers
from ..backends._staging_setup import StagingBackend, enable_decode_staging, enable_prefill_staging
from ..protocols import KVBufferTensors
from ._rank_info import RankInfo, curve_key_text
from .workload import RequestPlan, TransferConfig, fill_prefill_pool, ring_bytes

logger = logging.getLogger(__name__)

BackendRef: TypeAlias = str | type | Callable[..., object]
"""What builds a rank's manager: a backend spec string, class or factory."""


def demo_prefill_timeouts() -> PrefillTimeouts:
    """The demo's chunk bounds unless the environment sets them (a deadline well past the
    library's 30 s: a slow machine's first chunk is not a stall); read when a rank's options
    are made, so that a bad variable is the driver's preflight error, not an import's."""
    return PrefillTimeouts(
        answer_s=settings.PREFILL_ANSWER_S.value_or(0.5),
        ready_s=settings.PREFILL_READY_S.value_or(0.5),
        deadline_s=settings.PREFILL_DEADLINE_S.value_or(60.0),
    )


@dataclass(frozen=True, slots=True)
class BodyOptions:
    """How a rank's backend and staging are set up beyond the workload (``None``: the
    library's default)."""

    host: str | None = "127.0.0.1"
    """Where the control listener and the engine bind (``None``: the backend's default, and
    no ``host`` argument, as the standard constructor has none)."""
    log_level: int | None = logging.WARNING
    """The rank's log level (a soak rank's lines; the floor of NIXL's own logger); ``None``
    leaves the loggers as they are (the harness, in the caller's process)."""
    liveness_timeout_s: float | None = None
    liveness_interval_s: float | None = None
    """Peer liveness bounds; they reach the manager's ``PeerLiveness`` through this process's
    environment (its settings), so that its constructor checks the interval against the
    timeout."""
    stall_timeout_s: float | None = None
    integrity: bool | None = None
    prefill_timeouts: PrefillTimeouts = field(default_factory=demo_prefill_timeouts)
    meta_timeout_s: float | None = None
    prepare: Callable[[StagingBackend], None] | None = None
    """Called with the backend before staging is enabled (the soak's ``drop`` fault)."""


class RankBody:
    """One rank's backend, as the staging set-up (:attr:`manager`) and as the contract's
    ``CommonKVManager`` (:attr:`common`: every backend is one).

    ``backend`` builds the manager: a spec string, a backend class or a factory with the
    standard constructor (checked by :func:`~staging_contracts.backends.resolve_backend`);
    ``None`` is ``config.backend``.
    """

    side: ClassVar[Role | None] = None
    """The role of every body of the class (the staged sides'); a plain body is given one."""

    def __init__(
        self,
        config: TransferConfig,
        rank: int,
        options: BodyOptions,
        backend: BackendRef | None = None,
        *,
        role: Role | None = None,
    ) -> None:
        role = role if role is not None else self.side
        if role is None:
            raise ValueError("a plain rank body needs its role")
        self.config = config
        self.role = role
        self.rank = rank
        self._closed = False
        self._side_closed = False
        self._make_pool()
        tp = config.prefill_tp if role is Role.PREFILL else config.decode_tp
        factory = resolve_backend(config.backend if backend is None else backend)
        if options.log_level is not None:
            logging.getLogger("nixl").setLevel(max(logging.WARNING, options.log_level))
        for variable, value in (
            (settings.LIVENESS_TIMEOUT_S, options.liveness_timeout_s),
            (settings.LIVENESS_INTERVAL_S, options.liveness_interval_s),
        ):
            if value is not None:
                os.environ[variable.name] = repr(value)
        where = {} if options.host is None else {"host": options.host}
        manager = factory(config.kv_args(tp, rank), role=role, attn_tp_size=tp, **where)
        self.manager: StagingBackend = manager
        self.common: CommonKVManager = manager  # type: ignore[assignment]
        try:
            if options.prepare is not None:
                options.prepare(self.manager)
            self._stage(options)
        except BaseException:  # the body is never returned: nobody else could close it
            self.common.close()
            raise

    def _make_pool(self) -> None:
        """The side's KV pool, made before the backend (a plain rank's is the caller's)."""

    def _stage(self, options: BodyOptions) -> None:
        """The side's staging set-up, once the backend is built (none on a plain rank)."""

    def info(
        self, ring_base: int = 0, ring_size: int = 0, pool_ptrs: tuple[int, ...] = ()
    ) -> RankInfo:
        """What this rank publishes: its listener and engine (decode: and where peers write)."""
        engine = self.manager.engine
        return RankInfo(
            self.role.value,
            self.rank,
            self.common.endpoint,
            engine.session_id,
            engine.metadata(),
            ring_base,
            ring_size,
            curve_key_text(self.common.curve_key),
            pool_ptrs,
        )

    def trust(self, peers: Sequence[RankInfo]) -> None:
        """Trust each peer's listener by the key it published (a no-op without a secret)."""
        for info in peers:
            self.common.trust_peer(info.endpoint, info.curve_key.encode("ascii") or None)

    def registered(self) -> int:
        """Regions the engine still has registered (-1: it does not say)."""
        count = getattr(self.manager.engine, "registered_regions", -1)
        return int(count) if isinstance(count, int) else -1

    def deregister(self, regions: Sequence[tuple[int, int]]) -> int:
        """Deregister each ``(address, size)`` region from the engine; the regions still
        registered after (:meth:`registered`)."""
        for address, _ in regions:
            self.manager.engine.deregister(address)
        return self.registered()

    def close_side(self, timeout_s: float | None = None) -> None:
        """Close what the side opened beyond the backend (bounded by ``timeout_s`` where it
        waits); idempotent."""
        if not self._side_closed:
            self._side_closed = True
            self._close_side(timeout_s)

    def _close_side(self, timeout_s: float | None) -> None:
        del timeout_s  # a plain rank opened nothing more

    def close(self) -> None:
        """Close the side, then the backend; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.close_side()
        finally:
            self.common.close()


class DecodeBody(RankBody):
    """A staged decode rank: an empty pool, its staging handler and ring."""

    side = Role.DECODE
    pool: KVBufferTensors
    handler: DecodeStagingHandler

    def _make_pool(self) -> None:
        self.pool = self.config.empty_pool(self.config.decode_tp, self.rank)

    def _stage(self, options: BodyOptions) -> None:
        self.handler = enable_decode_staging(
            self.manager,
            kv_buffers=self.pool,
            ring_bytes=ring_bytes(self.config),
            stall_timeout_s=options.stall_timeout_s,
            integrity=options.integrity,
        )

    def info(
        self, ring_base: int = 0, ring_size: int = 0, pool_ptrs: tuple[int, ...] = ()
    ) -> RankInfo:
        allocator = self.handler.allocator
        return super().info(allocator.base_ptr, allocator.total_size, pool_ptrs)

    def receive(self, transfers: DecodeTransfers, room: int, pages: Sequence[int]) -> KVReceiver:
        """Register ``room`` for ``pages`` (``init``, ``send_metadata``); released if that
        fails."""
        receiver = KVReceiver(transfers, room)
        receiver.init(pages, chunk_pages=self.config.chunk_pages)
        try:
            receiver.send_metadata()
        except Exception:  # the caller reports the room failed: leave nothing held
            release_after_failure(room, receiver.release)
            raise
        return receiver

    def release_ring(self) -> int:
        """Deregister the ring; the regions still registered after."""
        allocator = self.handler.allocator
        return self.deregister([(allocator.base_ptr, allocator.total_size)])


class PrefillBody(RankBody):
    """A staged prefill rank: a pool holding every request, its writer and transfers."""

    side = Role.PREFILL
    pool: KVBufferTensors
    writer: StagingWriter
    transfers: PrefillTransfers
    sessions: dict[str, bytes]
    """Decode engines added so far (:meth:`meet`): session id -> its metadata."""

    def _make_pool(self) -> None:
        self.pool = filled_prefill_pool(self.config, self.rank)

    def _stage(self, options: BodyOptions) -> None:
        self.writer = enable_prefill_staging(
            self.manager,
            kv_buffers=self.pool,
            max_chunk_pages=self.config.chunk_pages,
            timeouts=options.prefill_timeouts,
            integrity=options.integrity,
        )
        self.transfers = PrefillTransfers(
            self.common, self.writer, meta_timeout_s=options.meta_timeout_s
        )
        self.sessions = {}

    def meet(self, decode: Sequence[RankInfo]) -> list[DecodeTarget]:
        """Trust the decode ranks, add the engines not known yet; their targets, by rank."""
        self.trust(decode)
        ordered = sorted(decode, key=lambda i: i.tp_rank)
        for info in ordered:
            if self.sessions.get(info.session_id) != info.metadata:
                self.manager.engine.add_peer(info.session_id, info.metadata)
                self.sessions[info.session_id] = info.metadata
        return [
            DecodeTarget(i.tp_rank, i.session_id, i.endpoint, i.ring_base, i.ring_size)
            for i in ordered
        ]

    def send(self, room: int, plan: RequestPlan, targets: Sequence[DecodeTarget]) -> KVSender:
        """Open ``room`` to ``targets`` and queue every chunk of ``plan``; released if that
        fails."""
        sender = KVSender(self.transfers, room)
        sender.init(self.config.num_pages, targets)
        chunks = list(self.config.chunks())
        try:
            for number, (start, count) in enumerate(chunks):
                pages = plan.prefill_pages[start : start + count]
                sender.send(pages, last=number == len(chunks) - 1)
        except Exception:  # the caller reports the room failed: leave nothing held
            release_after_failure(room, sender.release)
            raise
        return sender

    def _close_side(self, timeout_s: float | None) -> None:
        # the transfers' worker (bounded), then the writer
        if timeout_s is None:
            self.transfers.close()
        else:
            self.transfers.close(timeout_s)
        self.writer.close()


def settle(config: TransferConfig) -> None:
    """Wait until the device work this rank enqueued has run (zeroed allocations, filling,
    zeroing, copies), before an engine touches that memory: CUDA kernels run asynchronously,
    and an engine reads or writes device memory outside torch's streams, so a fill still
    queued could be read half done, or a zeroing still queued could land over a peer's
    write. Nothing to wait for on the CPU.

    **Blocking:** on CUDA, until the rank's device is idle (``torch.cuda.synchronize``).
    """
    if config.device == "cuda":
        torch.cuda.synchronize(config.torch_device)


def filled_prefill_pool(config: TransferConfig, rank: int) -> KVBufferTensors:
    """A prefill rank's KV pool holding every request's data, settled (:func:`settle`)
    before any engine reads it."""
    pool = config.empty_pool(config.prefill_tp, rank)
    fill_prefill_pool(pool, config, rank)
    settle(config)
    return pool


def freeze_heap() -> None:
    """Collect once and move every object made during start-up out of the collector's reach
    (``gc.freeze``), as serving engines do once they are up: otherwise the first full
    collection falls inside the transfer."""
    gc.collect()
    gc.freeze()


def release_after_failure(room: int, release: Callable[[], None]) -> None:
    """Release a room whose opening failed; a failing release is logged (the opening's error
    is the one reported)."""
    try:
        release()
    except Exception:  # the room already fails with the first error
        logger.exception(
            "room %d: releasing it after a failed opening failed too", room, extra={"room": room}
        )
