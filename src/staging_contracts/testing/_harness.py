"""``run_transfer``: a staged transfer through any backend, every decode page verified.

Every rank is a body of the run layer (:mod:`staging_contracts._run._rank_body`), built with
the backend's standard constructor and wired as a bootstrap would. In one process the harness
takes each step on every rank in turn; across processes (``processes=True``) each rank runs in
a spawned process of its own (:mod:`~staging_contracts.testing._processes`), in lockstep with
the harness on typed messages (:mod:`~staging_contracts.testing._rank_steps`). What a run does,
reports and raises: ``docs/writing-a-backend.md``, section 5.

**Thread:** call it from any thread but a listener's; it blocks until the report is ready.
Across processes, call it from the main module's ``if __name__ == "__main__":`` block or a
test (ranks are spawned).
"""

from __future__ import annotations

import inspect
import logging
import pickle
import threading
import time
import traceback
from collections.abc import Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Final, Protocol

import torch

from .._decode.handler import DecodeStagingHandler
from .._prefill.writer import DecodeTarget, PrefillTimeouts
from .._run._codec import Message
from .._run._rank_body import BodyOptions, DecodeBody, PrefillBody
from .._run._rank_info import RankInfo
from .._run.workload import (
    TransferConfig,
    chunks_landed,
    request_plans,
    require_positive,
    stray_pages,
)
from .._staging.layout import prefill_ranks_for_decode, validate_tp_pair
from ..backends import StagingBackend, process_local_reason, resolve_backend
from ..backends._common import Role
from ..backends._kv_requests import (
    DecodeTransfers,
    KVPoll,
    KVReceiver,
    KVSender,
)
from ..protocols import ArrivalOutcome, KVArgs, StagingReqOutcome
from ..stats import StagingStats
from ._decode_setup import StartableBackend
from ._processes import Failure, ParentLink, RankFailed, RankGroup
from ._rank_steps import (
    Arm,
    Armed,
    Close,
    DecodeReport,
    DecodeReported,
    Finish,
    Finished,
    Go,
    Joined,
    Outcome,
    PrefillReported,
    ProcessLocal,
    Settled,
    Wire,
    Wired,
)

__all__ = [
    "IDLE_HOOK_HINT",
    "ManagerFactory",
    "ProcessesUnavailable",
    "RankFailed",
    "RoomReport",
    "TransferGeometry",
    "TransferManager",
    "TransferReport",
    "process_local_reason",
    "run_transfer",
]

logger = logging.getLogger(__name__)

IDLE_HOOK_HINT: Final = (
    "is the listener's idle hook wired to staging_idle? (arrivals by engine notification "
    "are delivered there: '_on_idle(self): staging_idle(self)')"
)
"""What the diagnosis asks when a notifying engine's arrivals never reached decode."""

_TEARDOWN_S: Final = 5.0
"""Longest the teardown waits for prefill to hear that the unfinished rooms failed."""

_DONE: Final = (KVPoll.Success, KVPoll.Failed)

HARNESS_ENDED: Final = "the harness's time ran out"
"""The reason the harness fails the rooms still running when it ends a run."""

_STALL_POLL_S: Final = 0.05
"""How often a run with ``stall_s`` looks for progress."""
_START_S: Final = 120.0
"""Across processes: longest a rank process may take to start and build its manager."""
_STEP_S: Final = 60.0
"""Across processes: longest any other step of a rank (wiring, arming rooms, closing) takes."""


class ProcessesUnavailable(RuntimeError):
    """``run_transfer(..., processes=True)`` cannot run this backend's ranks in separate
    processes (its engine works within one process); the text says why."""


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
        require_positive(self, "TransferGeometry.")

    @property
    def chunks_per_room(self) -> int:
        """Chunks of one room."""
        return -(-self.room_pages // self.chunk_pages)

    def config(
        self, backend: str, prefill_tp: int, decode_tp: int, rooms: int, seed: int
    ) -> TransferConfig:
        """The run as the one workload states it: the cluster's pages, data and checks."""
        return TransferConfig(
            backend=backend,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
            kv_heads=self.total_kv_heads,
            layers=self.num_layers,
            head_dim=self.head_dim,
            tokens=self.room_pages * self.page_size,
            page_size=self.page_size,
            requests=rooms,
            dtype=self.dtype,
            seed=seed,
            chunk_tokens=self.chunk_pages * self.page_size,
            separate_layers=True,
            pool_size=self.pool_pages,
            ring_size=self.ring_bytes,
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
    processes: bool = False
    """Every rank ran in a process of its own (``run_transfer(..., processes=True)``)."""
    stopped: str | None = None
    """Why the run ended before ``timeout_s`` because no progress was possible (``stall_s``),
    or ``None``."""

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
        though ring regions were allocated (by notification: the idle hook; by
        ``CHUNK_READY``: the message routing), in the same words for every engine; rooms
        that reported success with wrong bytes; otherwise the rooms' own reasons.
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
        )  # without allocation, a write is done only by a backend that skips the ring
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
            # One wording whatever the engine: LocalEngine finishes its writes without the
            # idle hook, NIXL does not (its progress is driven by poll_notifications, which
            # staging_idle calls), so whether the writes were done says nothing more here.
            if self.notifications:
                return (
                    "no arrivals were delivered at all (ring regions were allocated): "
                    f"{IDLE_HOOK_HINT}"
                )
            return (
                "no CHUNK_READY arrived (ring regions were allocated): does the decode "
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
        """A few lines for a test failure or a log: the run, each room (once), the likely
        cause."""
        head = (
            f"{self.backend}: prefill TP {self.prefill_tp} -> decode TP {self.decode_tp}"
            f"{' (a process per rank)' if self.processes else ''}, {len(self.rooms)} rooms, "
            f"{'ok' if self.ok else 'FAILED'} in {self.elapsed_s:.2f}s"
        )
        lines = [head, *(f"  {room.line()}" for room in self.rooms)]
        if not self.ok:  # each room is listed once, above; the cause comes after
            cause = self._cause()
            if cause:
                lines.append(f"diagnosis: {cause}")
            if self.stray_pages:
                lines.append(f"{self.stray_pages} decode page(s) outside every room were written")
        return "\n".join(lines)


class _ArrivalTally:
    """Writer arrivals per room, counted as one decode handler accepts them.

    **Threads:** the listener thread counts; any thread reads.
    """

    def __init__(self, handler: DecodeStagingHandler) -> None:
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}
        accept = handler.handle_chunk_arrival

        def counted(room: int, chunk_idx: int, **arrival: Any) -> ArrivalOutcome:
            outcome = accept(room, chunk_idx, **arrival)
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


def _backend_name(backend: ManagerFactory | str) -> str:
    """``module.QualName`` of a class or function, the spec of a string, else ``repr``."""
    if isinstance(backend, str):
        return backend
    if isinstance(backend, type) or inspect.isfunction(backend) or inspect.ismethod(backend):
        return f"{backend.__module__}.{backend.__qualname__}"
    return repr(backend)


def run_transfer(
    backend: ManagerFactory | str,
    *,
    prefill_tp: int = 2,
    decode_tp: int = 1,
    rooms: int = 3,
    geometry: TransferGeometry | None = None,
    timeout_s: float = 30.0,
    seed: int = 0,
    processes: bool = False,
    stall_s: float | None = None,
) -> TransferReport:
    """Stage ``rooms`` multi-chunk requests from ``prefill_tp`` to ``decode_tp`` ranks.

    Args:
        backend: a backend class with the standard constructor, any
            :class:`ManagerFactory`, or a backend spec string (a registry name,
            ``MODULE:CLASS`` or ``MODULE:CLASS=MODULE:FACTORY``, see
            :func:`~staging_contracts.backends.resolve_backend`); called once per rank.
        prefill_tp: prefill ranks (attention TP size of prefill).
        decode_tp: decode ranks.
        rooms: requests, all in flight at once.
        geometry: sizes (default :class:`TransferGeometry`'s).
        timeout_s: bound on the whole transfer; rooms still running then fail as timed out.
        seed: seed of the KV data and page choice.
        processes: run every rank in a process of its own (spawned), over the backend's
            engine across processes: the same rooms, checks and report. ``backend`` must
            then be importable by reference (a class, a module-level function or a spec
            string), and its engine must cross processes.
        stall_s: (in one process) end the run before ``timeout_s`` when no progress at all
            is possible: decode's staging handler got no message within ``stall_s`` of the
            start, or every prefill write was done and no arrival reached decode within
            ``stall_s`` after. The rooms still running then fail with the reason (and
            :attr:`TransferReport.stopped` says it); ``None`` (the default) waits up to
            ``timeout_s``. Ignored with ``processes=True``.

    Returns:
        The per-room report (see :attr:`TransferReport.ok` and
        :meth:`TransferReport.diagnosis`).

    Raises:
        ValueError: the TP pair does not fit the head count, the rooms do not fit the
            pools, the backend does not resolve (a spec string, a class or a callable is
            checked the same way, before anything is built or spawned: see
            :func:`~staging_contracts.backends.resolve_backend`), or (``processes=True``)
            ``backend`` cannot be pickled.
        TypeError: a factory returned something that is not a staging backend (of the
            class a spec or the factory's return annotation names).
        ProcessesUnavailable: ``processes=True`` and the backend's engine works within one
            process only (the text says so; a test may skip with it).
        RankFailed: ``processes=True`` and a rank process failed to build or wire its
            manager, died, or did not answer in time (the text names the rank and its error).
        Exception: (in one process) whatever the factory, the staging set-up or the engine
            wiring raised; every manager built so far is closed first.
    """
    g = geometry or TransferGeometry()
    validate_tp_pair(prefill_tp, decode_tp, g.total_kv_heads)
    if rooms < 1 or timeout_s <= 0:
        raise ValueError(f"rooms={rooms} must be >= 1 and timeout_s={timeout_s} > 0")
    if stall_s is not None and stall_s <= 0:
        raise ValueError(f"stall_s={stall_s} must be > 0 (or None)")
    if 2 * rooms * g.room_pages > g.pool_pages:
        raise ValueError(
            f"{rooms} rooms of {g.room_pages} pages need {2 * rooms * g.room_pages} pool pages "
            f"(prefill and decode pages apart), the pools have {g.pool_pages}"
        )
    name = _backend_name(backend)
    resolve_backend(backend)  # refused here, in one line, before anything is built
    config = g.config(name, prefill_tp, decode_tp, rooms, seed)
    jobs = [
        _RankJob(backend, role, rank, config, timeout_s)
        for role, tp in ((Role.PREFILL, prefill_tp), (Role.DECODE, decode_tp))
        for rank in range(tp)
    ]
    report = _run_across_processes(jobs) if processes else _run_in_process(jobs, stall_s)
    logger.log(logging.DEBUG if report.ok else logging.WARNING, "%s", report.summary())
    return report


# --------------------------------------------------------------------------- shared by both modes


@dataclass(frozen=True, slots=True)
class _RankJob:
    """One rank of a run: what builds its body (pickled to its process across processes)."""

    backend: ManagerFactory | str
    role: Role
    rank: int
    config: TransferConfig
    timeout_s: float


def _refuse_process_local(manager: StagingBackend) -> None:
    """Across processes: stop the rank as soon as its manager is built, before any staging
    set-up, when its engine stays within one process."""
    reason = process_local_reason(manager.engine)
    if reason is not None:
        raise ProcessesUnavailable(reason)


def _build(job: _RankJob, processes: bool = False) -> _DecodeRank | _PrefillRank:
    """The rank, on a body of the run layer's (as every cluster rank's): its pool, its
    manager built by the backend's standard constructor (no ``host``), staging enabled with
    every bound the run's."""
    options = BodyOptions(
        host=None,
        log_level=None,
        stall_timeout_s=job.timeout_s,
        prefill_timeouts=PrefillTimeouts(deadline_s=job.timeout_s),
        meta_timeout_s=job.timeout_s,
        prepare=_refuse_process_local if processes else None,
    )
    if job.role is Role.PREFILL:
        return _PrefillRank(PrefillBody(job.config, job.rank, options, job.backend))
    body = DecodeBody(job.config, job.rank, options, job.backend)
    try:
        return _DecodeRank(body)  # taps the handler's arrivals
    except BaseException:
        body.close()
        raise


def _trust_and_start(body: DecodeBody | PrefillBody, infos: Sequence[RankInfo]) -> None:
    """Trust every other rank, as a bootstrap would, then start the listener."""
    me = (body.role.value, body.rank)
    body.trust([info for info in infos if (info.role, info.tp_rank) != me])
    body.common.start()


class _DecodeRank:
    """A decode rank's steps (see :class:`_PrefillRank`)."""

    notifies = False

    def __init__(self, body: DecodeBody) -> None:
        self.body = body
        self.tally = _ArrivalTally(body.handler)
        self.ends: list[KVReceiver] = []
        self._transfers: DecodeTransfers

    def wire(self, infos: Sequence[RankInfo]) -> None:
        _trust_and_start(self.body, infos)
        prefill = sorted(
            (i for i in infos if i.role == Role.PREFILL.value), key=lambda i: i.tp_rank
        )
        endpoints = [info.endpoint for info in prefill]
        self._transfers = DecodeTransfers(self.body.common, self.body.handler, endpoints)

    def arm(self) -> None:
        self.ends = [
            self.body.receive(self._transfers, plan.room, plan.decode_pages)
            for plan in request_plans(self.body.config)
        ]

    def go(self) -> None:
        """Prefill stages the rooms."""

    def finish(self) -> None:
        """Fail the rooms still running, telling their prefill ranks (ROOM_FAILED)."""
        for receiver in self.ends:
            if receiver.poll() not in _DONE:
                self.body.handler.fail_room(receiver.room, HARNESS_ENDED)
                receiver.poll()  # reports the failure to its prefill ranks

    def close(self) -> None:
        self.body.close()

    def report(self) -> DecodeReport:
        body, config = self.body, self.body.config
        plans = request_plans(config)
        return DecodeReport(
            chunks_ok=[chunks_landed(body.pool, config, body.rank, plan) for plan in plans],
            arrivals=[self.tally.count(plan.room) for plan in plans],
            stray=stray_pages(body.pool, config, plans),
            stats=body.manager.staging_stats(),
        )


class _PrefillRank:
    """A prefill rank's steps, alike in one process (the harness takes each on every rank in
    turn) and across processes (:func:`_step_by_step`): ``wire``, ``arm`` (decode registers
    the rooms), ``go`` (prefill stages them), ``finish`` (after the verdicts), ``close``, and
    (once closed) ``report``."""

    def __init__(self, body: PrefillBody) -> None:
        self.body = body
        self.notifies = body.writer.arrival == "notification"
        self.ends: list[KVSender] = []
        self._targets: list[DecodeTarget] = []

    def wire(self, infos: Sequence[RankInfo]) -> None:
        _trust_and_start(self.body, infos)
        self._targets = self.body.meet([info for info in infos if info.role == Role.DECODE.value])

    def arm(self) -> None:
        """Decode registers the rooms."""

    def go(self) -> None:
        self.ends = [
            self.body.send(plan.room, plan, self._targets)
            for plan in request_plans(self.body.config)
        ]

    def finish(self, deadline: float | None = None) -> None:
        """Wait (until ``deadline``; by default :data:`_TEARDOWN_S` from now) for the rooms
        still running to hear that they failed, so that the workers drop their chunks and
        stop promptly."""
        unfinished = [s for s in self.ends if s.poll() not in _DONE]
        _wait_all(unfinished, time.monotonic() + _TEARDOWN_S if deadline is None else deadline)

    def close(self) -> None:
        self.body.close_side(_TEARDOWN_S)  # the workers (bounded), then the manager
        self.body.close()

    def report(self) -> StagingStats:
        return self.body.manager.staging_stats()


def _room_reason(
    decode: Sequence[tuple[KVPoll, str | None]],
    prefill: Sequence[tuple[KVPoll, str | None]],
    timeout_s: float,
    ended: str | None = None,
) -> str | None:
    """Why a room did not succeed on every rank (``None`` if it did), from each rank's final
    state and failure text (decode ranks, then prefill ranks, by TP rank)."""
    if all(state is KVPoll.Success for state, _ in (*decode, *prefill)):
        return None
    for d, (state, failure) in enumerate(decode):
        if state is KVPoll.Failed:
            return f"decode rank {d}: {failure or 'failed'}"
    for p, (state, failure) in enumerate(prefill):
        if state is KVPoll.Failed:
            return f"prefill rank {p}: {failure or 'failed'}"
    states = ", ".join(
        [f"decode {d} {s.name}" for d, (s, _) in enumerate(decode)]
        + [f"prefill {p} {s.name}" for p, (s, _) in enumerate(prefill)]
    )
    if ended is not None:
        return f"{ended} ({states})"
    return f"timed out after {timeout_s:g}s ({states})"


def _outcomes(ends: Sequence[KVReceiver | KVSender]) -> list[Outcome]:
    return [(end.poll(), end.failure()) for end in ends]


def _wait_all(ends: Sequence[KVReceiver | KVSender], deadline: float) -> None:
    for end in ends:
        end.wait(max(0.0, deadline - time.monotonic()))


def _report(
    config: TransferConfig,
    timeout_s: float,
    outcomes: Sequence[Sequence[Outcome]],
    decode: Sequence[DecodeReport],
    prefill_stats: Sequence[StagingStats],
    notifications: bool,
    elapsed_s: float,
    *,
    processes: bool = False,
    stopped: str | None = None,
) -> TransferReport:
    """The run's report from every rank's (``outcomes``: per rank, prefill ranks then decode
    ranks, per room)."""
    prefill_tp, decode_tp = config.prefill_tp, config.decode_tp
    chunks = len(list(config.chunks()))
    writers = sum(len(prefill_ranks_for_decode(prefill_tp, decode_tp, d)) for d in range(decode_tp))
    rooms = []
    for i in range(config.requests):
        prefill_side = [rank[i] for rank in outcomes[:prefill_tp]]
        decode_side = [rank[i] for rank in outcomes[prefill_tp:]]
        reason = _room_reason(decode_side, prefill_side, timeout_s, stopped)
        verified = sum(all(out.chunks_ok[i][c] for out in decode) for c in range(chunks))
        if reason is None and verified < chunks:
            reason = (
                f"every rank reported success but {chunks - verified} chunk(s) do "
                "not hold the staged bytes"
            )
        rooms.append(
            RoomReport(
                room=config.room(i),
                succeeded=reason is None,
                reason=reason,
                decode_states=tuple(state for state, _ in decode_side),
                prefill_states=tuple(state for state, _ in prefill_side),
                chunks=chunks,
                chunks_verified=verified,
                arrivals=sum(out.arrivals[i] for out in decode),
                expected_arrivals=chunks * writers,
            )
        )
    return TransferReport(
        backend=config.backend,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        notifications=notifications,
        rooms=tuple(rooms),
        decode_stats=tuple(out.stats for out in decode),
        prefill_stats=tuple(prefill_stats),
        stray_pages=len(set().union(*(out.stray for out in decode))),
        elapsed_s=elapsed_s,
        timeout_s=timeout_s,
        processes=processes,
        stopped=stopped,
    )


# --------------------------------------------------------------------------- one process


def _run_in_process(jobs: Sequence[_RankJob], stall_s: float | None) -> TransferReport:
    """Every rank's body in this process: run the rooms to the end or the deadline, note each
    rank's verdict, fail the rooms still running (the managers still open), close everything,
    then report (no arrival or scatter is late)."""
    config, timeout_s = jobs[0].config, jobs[0].timeout_s
    stopped: str | None = None
    with ExitStack() as stack:  # closes, last first: prefill workers, then every body
        ranks: list[_DecodeRank | _PrefillRank] = []
        for job in jobs:
            rank = _build(job)
            stack.callback(rank.body.close)
            ranks.append(rank)
        prefill = [rank for rank in ranks if isinstance(rank, _PrefillRank)]
        decode = [rank for rank in ranks if isinstance(rank, _DecodeRank)]
        for p in prefill:  # the prefill workers stop first (bounded)
            stack.callback(p.body.close_side, _TEARDOWN_S)
        infos = [rank.body.info() for rank in ranks]
        for rank in ranks:
            rank.wire(infos)
        logger.debug(
            "%s: %d prefill and %d decode ranks built",
            config.backend,
            config.prefill_tp,
            config.decode_tp,
        )
        started = time.monotonic()
        deadline = started + timeout_s
        for rank in ranks:
            rank.arm()
        for rank in ranks:
            rank.go()
        if stall_s is None:
            _wait_all([end for rank in ranks for end in rank.ends], deadline)
        else:
            stopped = _wait_while_progress(config, prefill, decode, started, deadline, stall_s)
        elapsed_s = time.monotonic() - started
        outcomes = [_outcomes(rank.ends) for rank in ranks]
        for d in decode:  # on decode, and (ROOM_FAILED) on prefill
            d.finish()
        teardown = time.monotonic() + _TEARDOWN_S  # one bound for every prefill rank
        for p in prefill:
            p.finish(teardown)
    return _report(
        config,
        timeout_s,
        outcomes,
        [rank.report() for rank in decode],
        [rank.report() for rank in prefill],
        all(rank.notifies for rank in prefill),
        elapsed_s,
        stopped=stopped,
    )


def _wait_while_progress(
    config: TransferConfig,
    prefill: Sequence[_PrefillRank],
    decode: Sequence[_DecodeRank],
    started: float,
    deadline: float,
    stall_s: float,
) -> str | None:
    """Wait for every room until ``deadline``, or until no progress is possible; why it
    stopped early, or ``None``. Bounded by ``deadline``; polls every 50 ms."""
    writes_done_at: float | None = None
    rooms = [config.room(i) for i in range(config.requests)]
    senders = [s for p in prefill for s in p.ends]
    waiting: list[KVReceiver | KVSender] = [*senders, *(r for d in decode for r in d.ends)]
    while True:
        if all(x.poll() in _DONE for x in waiting):
            return None
        now = time.monotonic()
        if now >= deadline:
            return None
        received = sum(d.body.manager.staging_stats().received for d in decode)
        if received == 0 and now - started >= stall_s:
            return f"stopped after {now - started:.1f}s: decode got no staging message"
        arrivals = sum(d.tally.count(room) for d in decode for room in rooms)
        if writes_done_at is None and all(s.poll() is KVPoll.Success for s in senders):
            writes_done_at = now
        if writes_done_at is not None and arrivals == 0 and now - writes_done_at >= stall_s:
            return (
                f"stopped after {now - started:.1f}s: every write was done {stall_s:g}s "
                "ago and no arrival reached decode"
            )
        pending = next(x for x in waiting if x.poll() not in _DONE)
        pending.wait(min(_STALL_POLL_S, max(0.0, deadline - now)))


# --------------------------------------------------------------------------- across processes


def _run_across_processes(jobs: Sequence[_RankJob]) -> TransferReport:
    """``run_transfer(..., processes=True)``: the parent's side (arguments checked)."""
    config, timeout_s = jobs[0].config, jobs[0].timeout_s
    name, prefill_tp = config.backend, config.prefill_tp
    try:
        pickle.dumps(jobs[0].backend)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"processes=True needs a backend the rank processes can import: a class, a "
            f"module-level function or a spec string; {name} cannot be pickled ({exc})"
        ) from None
    labels = [f"{job.role.value} rank {job.rank}" for job in jobs]
    everyone = list(range(len(jobs)))
    prefill = everyone[:prefill_tp]
    decode = everyone[prefill_tp:]
    group = RankGroup(_rank_process, jobs, labels)
    try:
        try:
            joined = group.gather(everyone, Joined, _START_S)
        except RankFailed as exc:
            if exc.sent == ProcessLocal.__name__:
                raise ProcessesUnavailable(
                    f"{name} cannot run across processes: {exc.detail}"
                ) from None
            raise
        group.send(everyone, Wire(tuple(rank.info for rank in joined)))
        group.gather(everyone, Wired, _STEP_S)
        group.send(everyone, Arm())
        group.gather(everyone, Armed, _STEP_S)
        started = time.monotonic()
        group.send(everyone, Go())
        settled = group.gather(everyone, Settled, timeout_s + _STEP_S)
        elapsed = time.monotonic() - started
        group.send(everyone, Finish())
        group.gather(everyone, Finished, _TEARDOWN_S + _STEP_S)
        group.send(prefill, Close())  # prefill workers first, as in one process
        prefill_reports = group.gather(prefill, PrefillReported, _TEARDOWN_S + _STEP_S)
        group.send(decode, Close())
        decode_reports = group.gather(decode, DecodeReported, _STEP_S)
    finally:
        group.close()
    return _report(
        config,
        timeout_s,
        [rank.outcomes for rank in settled],
        [rank.report for rank in decode_reports],
        [rank.stats for rank in prefill_reports],
        all(joined[r].notifies for r in prefill),
        elapsed,
        processes=True,
    )


def _rank_process(job: object, conn: Connection) -> None:
    """Entry point of one rank process (spawned): run the rank, report any failure."""
    timeout_s = job.timeout_s if isinstance(job, _RankJob) else 0.0
    link = ParentLink(conn, _START_S + 4 * _STEP_S + _TEARDOWN_S + timeout_s)
    try:
        if not isinstance(job, _RankJob):
            raise TypeError(f"not a rank job: {job!r}")
        torch.set_num_threads(1)
        rank = _build(job, processes=True)
        try:
            _step_by_step(rank, link, job.timeout_s)
        finally:
            rank.body.close()
    except ProcessesUnavailable as exc:  # the body closed its manager
        link.send(ProcessLocal(str(exc)))
    except (EOFError, BrokenPipeError):
        logger.debug("the harness closed the pipe; rank process ends")
    except BaseException as exc:  # noqa: BLE001 - the parent gets every failure, in words
        with suppress(OSError, ValueError):
            link.send(Failure(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        link.close()


def _step_by_step(rank: _DecodeRank | _PrefillRank, link: ParentLink, timeout_s: float) -> None:
    """A rank process's steps, each on the parent's command once every rank has taken the one
    before: no rank sends a room's message before every rank routes it, and prefill stages
    the rooms only once decode has registered them all."""
    link.send(Joined(rank.body.info(), rank.notifies))
    rank.wire(link.expect(Wire).ranks)
    _step(link, Wired(), Arm)
    rank.arm()
    _step(link, Armed(), Go)
    rank.go()
    _wait_all(rank.ends, time.monotonic() + timeout_s)
    _step(link, Settled(tuple(_outcomes(rank.ends))), Finish)
    rank.finish()
    _step(link, Finished(), Close)
    rank.close()
    report = rank.report()
    if isinstance(report, DecodeReport):
        link.send(DecodeReported(report))
    else:
        link.send(PrefillReported(report))


def _step(link: ParentLink, done: Message, then: type[Message]) -> None:
    """Tell the parent this rank has done ``done``; wait for ``then``, which the parent sends
    once every rank has."""
    link.send(done)
    link.expect(then)
