"""One prefill or decode rank of a staged-transfer run, as an OS process of its own.

Started by :func:`staging_contracts._cluster.runner.run_cluster` (``multiprocessing`` spawn).
The rank builds its body (the run layer's ``DecodeBody`` or ``PrefillBody``), meets its peers
through the bootstrap server, runs every request of the
:class:`~staging_contracts._run.workload.TransferConfig` and reports to the driver
(:mod:`._messages`): ``Ready``, one ``RequestDone`` per finished request, a final
``RankSummary``.

**Modes and warm-up.** ``config.mode`` moves each request through the staging rings
(``"staged"``) or along an anchor path (``"per-token"``, ``"raw"``; see
:mod:`~staging_contracts._cluster.plain_paths`). ``config.warmup_requests`` untimed copies of
the timed requests run first (barrier ``warm-rooms``); decode then zeroes what they wrote, and
the timed requests start at barrier ``rooms``. Reported counts are the timed requests' only.

**Memory** (:class:`TransferMemory`): what the process held at the ``done`` barrier, before
verification, and ``ru_maxrss`` at the end (``peak_rss_bytes``).

**Per-request clocks.** ``time.monotonic()`` per request index: a prefill rank's
``room_first_request_s`` (its first ``STAGING_REQ`` of the room handed to the control socket;
in the anchor modes, its first write) and a decode rank's ``room_done_s`` (stamped by the
waiter thread the room's end wakes; in the anchor modes, as the last ``PLAIN_DONE`` arrives).
``CLOCK_MONOTONIC`` is system-wide on Linux, so stamps of different processes of one host
compare.

The rank binds and advertises ``config.host`` (Mooncake listens on every interface whatever
it is told, see :mod:`staging_contracts.engines.mooncake`).

``SIGTERM`` (the driver's "stop") raises :class:`RankStopped` in the main thread: the rank
closes its backend (its transfer worker given :data:`STOPPED_CLOSE_S`) and reports
``stopped``, the ``phase`` it was in, the ``rooms`` it finished and, on a staged prefill rank,
the bytes its timed requests wrote until then.
"""

from __future__ import annotations

import logging
import os
import queue
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Final, Protocol

import torch
import zmq

from .._control.transport import PeerSockets
from .._control.wire import StagingReq
from .._run._codec import Message, encode
from .._run._rank_body import (
    BodyOptions,
    DecodeBody,
    PrefillBody,
    RankBody,
    filled_prefill_pool,
    freeze_heap,
    settle,
)
from .._run.workload import (
    RequestPlan,
    TransferConfig,
    request_plans,
    verify_decode_pool,
    warmup_plans,
    zero_pool,
)
from .._staging.layout import (
    decode_ranks_for_prefill,
    prefill_ranks_for_decode,
)
from ..backends._common import Role
from ..backends._kv_requests import DecodeTransfers, KVPoll
from ..protocols import KVBufferTensors, Transfer, TransferError
from . import logformat
from ._messages import RankMemory, RankSummary, Ready, RequestDone
from .bootstrap import arrive, query_ranks, register_rank, wait_barrier
from .metrics_relay import MetricsPusher
from .plain_paths import (
    ArrivalBook,
    PlainDone,
    RoomWaiter,
    engine_name,
    per_token_batch,
    per_token_writes,
    pool_pointers,
    pool_regions,
    raw_offset,
    raw_request_bytes,
    raw_share,
    verify_raw,
)
from .preflight import proc_bytes

logger = logging.getLogger(__name__)

ROOM_TIMEOUT_S = 120.0
RENDEZVOUS_TIMEOUT_S = 120.0
"""How long a rank waits for the other side's ranks to register or reach a barrier: when
the two sides are started by hand on two machines, one may start well after the other."""
STOPPED_CLOSE_S = 0.5
"""How long a stopped rank waits for its transfer worker before it closes and reports."""
_FAULT_OFFSET = 1 << 40
_PROC_STATUS: Final = Path("/proc/self/status")
_CLEAR_REFS: Final = Path("/proc/self/clear_refs")


class RankStopped(BaseException):
    """The driver told this rank to stop (``SIGTERM``).

    A ``BaseException``, like ``KeyboardInterrupt``, so that no handler for ordinary errors
    on the way keeps the rank running.
    """

    so_far: RankSummary | None = None
    """What the rank's timed requests had moved when it came (prefill, staged), if known."""


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    del frame
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: let the rank close and report
    raise RankStopped(f"stopped by the driver ({signal.Signals(signum).name})")


def rank_main(
    role: str,
    rank: int,
    config: TransferConfig,
    bootstrap: str,
    report_to: str,
    metrics: bool = False,
) -> None:
    """Process entry point: run one rank; report the outcome; never raise.

    With ``metrics``, a staged rank also sends its counters to ``report_to`` every second
    (:class:`~.metrics_relay.MetricsPusher`).

    **Blocking:** until every request of the run finished on this rank, or ``SIGTERM``.
    """
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    logformat.install(role=role, rank=rank, level=logging.WARNING)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's C++ info and warning logs
    torch.set_num_threads(1)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    reporter = ctx.socket(zmq.PUSH)
    reporter.setsockopt(zmq.LINGER, 5000)
    reporter.connect(report_to)

    phase, rooms = "starting", dict[int, bool]()
    """What the rank did so far, for a report that ends the run early."""

    def report(event: Message) -> None:
        nonlocal phase
        if isinstance(event, Ready):
            phase = "running requests"
        elif isinstance(event, RequestDone):
            rooms[event.index] = event.ok
        reporter.send(encode(event, role, rank))

    pusher = MetricsPusher(ctx, report_to, role, rank, config.backend) if metrics else None
    try:
        path = _PATHS[role == "decode", config.mode == "staged"]
        summary = path(_RankRun(rank, config, bootstrap, report, pusher))
        phase = "done"
        # The kernel keeps its high-water marks lazily (and reads ru_maxrss from approximate
        # per-CPU counters): a peak read at ``done`` may exceed one read now. The larger is.
        seen = summary.memory.peak_rss_before_verify_bytes if summary.memory else 0
        peak = max(peak_rss_bytes(), seen)
        report(replace(summary, ok=True, mode=config.mode, peak_rss_bytes=peak))
    except BaseException as exc:  # noqa: BLE001 - a rank reports every failure, then exits
        so_far = exc.so_far if isinstance(exc, RankStopped) else None
        report(
            replace(
                so_far or RankSummary(),
                ok=False,
                stopped=isinstance(exc, RankStopped),
                error=f"{type(exc).__name__}: {exc}",
                trace=traceback.format_exc(),
                phase=phase,
                rooms=rooms,
            )
        )
    finally:
        reporter.close()


Report = Callable[[Message], None]
"""Where a rank's events go (the driver's socket; nowhere for the warm-up)."""


@dataclass(frozen=True, slots=True)
class _RankRun:
    """What every path of a rank runs with."""

    rank: int
    config: TransferConfig
    bootstrap: str
    """The bootstrap server (``tcp://host:port``)."""
    report: Report
    pusher: MetricsPusher | None = None
    """A staged rank's counters' pusher (the driver relays metrics), else ``None``."""

    @contextmanager
    def pushing(self, body: DecodeBody | PrefillBody) -> Iterator[None]:
        """A staged rank's run: its counters pushed while it lasts (with a pusher), then the
        pusher's last snapshot, while the counters are still there, and the body closed."""
        try:
            if self.pusher is not None:
                prefill = body.transfers if isinstance(body, PrefillBody) else None
                self.pusher.start(body.common, prefill)
            yield
        except RankStopped:  # the driver waits INTERRUPT_GRACE_S for the report: be brief
            # and quiet: every room in flight fails on the way, as the stop asked
            logging.getLogger("staging_contracts").setLevel(logging.ERROR)
            body.close_side(STOPPED_CLOSE_S)
            raise
        finally:
            if self.pusher is not None:
                self.pusher.stop()
            body.close()


def _run_decode(run: _RankRun) -> RankSummary:
    rank, config, bootstrap, report = run.rank, run.config, run.bootstrap, run.report
    body = DecodeBody(config, rank, BodyOptions(host=config.host))
    common, allocator = body.common, body.handler.allocator
    with run.pushing(body):
        settle(config)  # the pool's and the ring's zeros, before any peer may write
        common.start()
        register_rank(bootstrap, body.info())
        prefill = query_ranks(bootstrap, "prefill", config.prefill_tp, RENDEZVOUS_TIMEOUT_S)
        body.trust(prefill)
        transfers = DecodeTransfers(common, body.handler, [info.endpoint for info in prefill])
        freeze_heap()
        report(Ready())
        if config.warmup_requests:
            warm = {
                number: body.receive(transfers, plan.room, plan.decode_pages)
                for number, plan in enumerate(warmup_plans(config))
            }
            arrive(bootstrap, "warm-rooms", f"decode-{rank}")
            _warm_up(warm)
            for receiver in warm.values():
                receiver.release()
            _zero_for_timed(config, body.pool, None)
        before = body.manager.staging_stats()
        receivers = {
            plan.index: body.receive(transfers, plan.room, plan.decode_pages)
            for plan in request_plans(config)
        }
        timed = _time_decode(run, receivers, partial(verify_decode_pool, body.pool, config, rank))
        for receiver in receivers.values():
            receiver.release()
        stats = body.manager.staging_stats()
        return replace(
            timed,
            ring_peak=allocator.peak_bytes,
            ring_size=allocator.total_size,
            ring_live_after=allocator.live_count,
            control_messages=stats.received - before.received,
            malformed=stats.malformed,
            chunks=stats.allocated - before.allocated,
            registered_after=body.release_ring(),
        )


def _time_decode(
    run: _RankRun, requests: Mapping[int, _Request], verify: Callable[[set[int]], list[str]]
) -> RankSummary:
    """A decode rank's timed requests: barrier ``rooms``, every request waited for, the
    memory read, barrier ``done``, then ``verify`` of those that succeeded; the summary's
    clocks, outcome, failures, verdict and memory."""
    memory = TransferMemory(run.config)
    arrive(run.bootstrap, "rooms", f"decode-{run.rank}")
    start = time.monotonic()
    outcome, done_at = _wait_all(requests, run.report)
    end = time.monotonic()
    at_done = memory.at_done()
    arrive(run.bootstrap, "done", f"decode-{run.rank}")
    succeeded = {i for i, state in outcome.items() if state is KVPoll.Success}
    problems = verify(succeeded)
    return RankSummary(
        start=start,
        end=end,
        verified=not problems,
        problems=tuple(problems[:10]),
        succeeded=tuple(sorted(succeeded)),
        failed=_failures(requests, outcome),
        room_done_s=dict(sorted(done_at.items())),
        memory=at_done,
    )


def _run_prefill(run: _RankRun) -> RankSummary:
    rank, config, bootstrap, report = run.rank, run.config, run.bootstrap, run.report
    body = PrefillBody(config, rank, BodyOptions(host=config.host))
    common, writer = body.common, body.writer
    with run.pushing(body):
        clock = FirstRequestClock(body.manager.peers)
        common.start()
        decode = query_ranks(bootstrap, "decode", config.decode_tp, RENDEZVOUS_TIMEOUT_S)
        targets = body.meet(decode)
        register_rank(bootstrap, body.info())
        freeze_heap()
        report(Ready())
        if config.warmup_requests:
            wait_barrier(bootstrap, "warm-rooms", config.decode_tp, RENDEZVOUS_TIMEOUT_S)
            warm = {
                number: body.send(plan.room, plan, targets)
                for number, plan in enumerate(warmup_plans(config))
            }
            _warm_up(warm)
            for sender in warm.values():
                sender.release()
        bytes_before, requests_before = writer.bytes_written, writer.requests_sent
        before = body.manager.staging_stats()
        memory = TransferMemory(config)
        # Start once decode has registered every room, as a serving decode does before
        # prefill computes: the clock then measures the transfer, not the bootstrap.
        start: float | None = None

        def moved() -> RankSummary:
            """What the timed requests wrote until now, and over how long."""
            return RankSummary(
                start=start,
                end=None if start is None else time.monotonic(),
                bytes_written=writer.bytes_written - bytes_before,
                requests_sent=writer.requests_sent - requests_before,
            )

        with _measured_if_stopped(moved):
            wait_barrier(bootstrap, "rooms", config.decode_tp, RENDEZVOUS_TIMEOUT_S)
            start = time.monotonic()
            faulty = [replace(t, ring_base=t.ring_base + _FAULT_OFFSET) for t in targets]
            senders = {
                plan.index: body.send(
                    plan.room,
                    plan,
                    faulty if rank == 0 and plan.index in config.fail_rooms else targets,
                )
                for plan in request_plans(config)
            }
            outcome, _ = _wait_all(senders, report)
            end = time.monotonic()
            # Stay up until every decode rank is done, as a serving prefill does: tearing four
            # processes down would take the CPU from the decode ranks' last scatters.
            wait_barrier(bootstrap, "done", config.decode_tp, timeout=ROOM_TIMEOUT_S)
        at_done = memory.at_done()
        failures = _failures(senders, outcome)
        for sender in senders.values():
            sender.release()
        body.close_side()
        stats = body.manager.staging_stats()
        sent = writer.requests_sent - requests_before
        return RankSummary(
            start=start,
            end=end,
            bytes_written=writer.bytes_written - bytes_before,
            requests_sent=sent,
            succeeded=tuple(sorted(i for i, s in outcome.items() if s is KVPoll.Success)),
            failed=failures,
            room_first_request_s={
                plan.index: clock.first[plan.room]
                for plan in request_plans(config)
                if plan.room in clock.first
            },
            control_messages=stats.received - before.received + sent,
            registered_after=body.registered(),
            memory=at_done,
        )


@contextmanager
def _measured_if_stopped(measure: Callable[[], RankSummary]) -> Iterator[None]:
    """A stop in the block carries ``measure()`` (:attr:`RankStopped.so_far`), so that the
    rank's last report, and the run's partial summary, hold what was moved until then."""
    try:
        yield
    except RankStopped as stop:
        stop.so_far = measure()
        raise


def _run_plain_decode(run: _RankRun) -> RankSummary:
    """A decode rank of the per-token or raw path (``config.mode``; see
    :mod:`~staging_contracts._cluster.plain_paths`): its pool, or its raw buffer, registered
    with the engine and published; a room ends when every writer's ``PLAIN_DONE`` arrived."""
    rank, config, bootstrap, report = run.rank, run.config, run.bootstrap, run.report
    pool: KVBufferTensors | None = None
    buffer: torch.Tensor | None = None
    if config.mode == "raw":
        size = config.requests * raw_request_bytes(config, rank)
        buffer = torch.zeros(size, dtype=torch.uint8, device=config.torch_device)
        regions = [(buffer.data_ptr(), buffer.numel())]
    else:
        pool = config.empty_pool(config.decode_tp, rank)
        regions = pool_regions(pool)
    settle(config)  # the zeros, before the engine registers the memory and peers write it
    body = RankBody(config, rank, BodyOptions(host=config.host), role=Role.DECODE)
    common = body.common
    book = ArrivalBook(prefill_ranks_for_decode(config.prefill_tp, config.decode_tp, rank))
    try:
        for ptr, size in regions:
            body.manager.engine.register(ptr, size)
        common.register_control(PlainDone.KIND, book.on_message)
        common.add_authorizer(book.authorize)
        common.start()
        ring = regions[0] if buffer is not None else (0, 0)
        register_rank(bootstrap, body.info(*ring, pool_pointers(pool) if pool is not None else ()))
        prefill = query_ranks(bootstrap, "prefill", config.prefill_tp, RENDEZVOUS_TIMEOUT_S)
        body.trust(prefill)
        book.set_endpoints({info.tp_rank: info.endpoint for info in prefill})
        freeze_heap()
        report(Ready())
        if config.warmup_requests:
            warm = warmup_plans(config)
            book.expect(plan.room for plan in warm)
            arrive(bootstrap, "warm-rooms", f"decode-{rank}")
            _warm_up({number: RoomWaiter(book, plan.room) for number, plan in enumerate(warm)})
            _zero_for_timed(config, pool, buffer)
        plans = request_plans(config)
        book.expect(plan.room for plan in plans)

        def verify(succeeded: set[int]) -> list[str]:
            if buffer is not None:
                return verify_raw(buffer, config, rank, sorted(succeeded))
            return [] if pool is None else verify_decode_pool(pool, config, rank, succeeded)

        timed = _time_decode(run, {p.index: RoomWaiter(book, p.room) for p in plans}, verify)
        done_at = {p.index: book.done_at(p.room) for p in plans}
        return replace(
            timed,
            room_done_s={i: at for i, at in sorted(done_at.items()) if at is not None},
            ring_live_after=0,
            control_messages=len(plans) * len(book.writers),
            malformed=book.malformed,
            chunks=0,
            registered_after=body.deregister(regions),
        )
    finally:
        body.close()


def _run_plain_prefill(run: _RankRun) -> RankSummary:
    """A prefill rank of the per-token or raw path: every write of a request to each decode
    rank it feeds (planned before the clock starts), then ``PLAIN_DONE`` to that rank."""
    rank, config, bootstrap, report = run.rank, run.config, run.bootstrap, run.report
    raw = config.mode == "raw"
    fed = list(decode_ranks_for_prefill(config.prefill_tp, config.decode_tp, rank))
    plans = request_plans(config)
    pool = None if raw else filled_prefill_pool(config, rank)
    source, offsets = _raw_source(config, rank, fed) if raw else (None, {})
    regions = pool_regions(pool) if pool is not None else []
    if source is not None:
        settle(config)  # the source's copy to the device, before the engine reads it
        regions = [(source.data_ptr(), source.numel())]
    body = RankBody(config, rank, BodyOptions(host=config.host), role=Role.PREFILL)
    common, engine = body.common, body.manager.engine
    try:
        for ptr, size in regions:
            engine.register(ptr, size)
        common.start()
        decode = {
            info.tp_rank: info
            for info in query_ranks(bootstrap, "decode", config.decode_tp, RENDEZVOUS_TIMEOUT_S)
        }
        body.trust(list(decode.values()))
        for d in fed:
            engine.add_peer(decode[d].session_id, decode[d].metadata)
        register_rank(bootstrap, body.info())
        # Every write call of every request, planned before the clock starts (as the
        # reference's per-token path could at best): the anchor is, if anything, favoured.
        batch = per_token_batch(engine_name(engine), config.num_pages * config.page_size)
        calls: dict[tuple[int, int], list[list[Transfer]]] = {}
        for plan in plans:
            for d in fed:
                if source is not None:
                    length = offsets[(plan.index, d)][1]
                    local = source.data_ptr() + offsets[(plan.index, d)][0]
                    remote = decode[d].ring_base + raw_offset(config, plan.index, rank, d)
                    calls[(plan.index, d)] = [[Transfer(local, remote, length)]]
                elif pool is not None:
                    calls[(plan.index, d)] = per_token_writes(
                        config, plan, rank, pool_pointers(pool), d, decode[d].pool_ptrs, batch
                    )
        freeze_heap()
        report(Ready())

        def send(plan: RequestPlan) -> str | None:
            """Write one request to every decode rank fed, then tell each; the first error."""
            error = None
            for d in fed:
                ok = True
                try:
                    for transfers in calls[(plan.index, d)]:
                        engine.write(decode[d].session_id, transfers)
                except TransferError as exc:
                    ok, error = False, error or f"write to decode {d}: {exc}"
                common.send(decode[d].endpoint, PlainDone(plan.room, rank, ok).to_frames())
            return error

        if config.warmup_requests:
            wait_barrier(bootstrap, "warm-rooms", config.decode_tp, RENDEZVOUS_TIMEOUT_S)
            for plan in warmup_plans(config):
                error = send(plan)
                if error is not None:
                    raise RuntimeError(f"a warm-up request failed: {error}")
        memory = TransferMemory(config)
        wait_barrier(bootstrap, "rooms", config.decode_tp, RENDEZVOUS_TIMEOUT_S)
        start = time.monotonic()
        first: dict[int, float] = {}
        failures: dict[int, str | None] = {}
        for plan in plans:
            first[plan.index] = time.monotonic()
            error = send(plan)
            if error is not None:
                failures[plan.index] = error
            report(RequestDone(plan.index, error is None))
        end = time.monotonic()
        wait_barrier(bootstrap, "done", config.decode_tp, timeout=ROOM_TIMEOUT_S)
        at_done = memory.at_done()
        writes = [calls[(plan.index, d)] for plan in plans for d in fed]
        return RankSummary(
            start=start,
            end=end,
            bytes_written=sum(t.length for call in writes for ts in call for t in ts),
            write_calls=sum(len(call) for call in writes),
            transfers=sum(len(ts) for call in writes for ts in call),
            requests_sent=0,
            succeeded=tuple(sorted(p.index for p in plans if p.index not in failures)),
            failed=failures,
            room_first_request_s=dict(sorted(first.items())),
            control_messages=len(plans) * len(fed),
            registered_after=body.deregister(regions),
            memory=at_done,
        )
    finally:
        body.close()


_PATHS: Final[dict[tuple[bool, bool], Callable[[_RankRun], RankSummary]]] = {
    (True, True): _run_decode,
    (True, False): _run_plain_decode,
    (False, True): _run_prefill,
    (False, False): _run_plain_prefill,
}
"""A rank's path by (it is a decode rank, the run is staged)."""


def _zero_for_timed(
    config: TransferConfig, pool: KVBufferTensors | None, buffer: torch.Tensor | None
) -> None:
    """Zero what the warm-up wrote (decode's pool, or its raw buffer), settled
    (:func:`settle`) before the rank lets the writers start the timed requests: they must
    write every byte they are checked on, and no zeroing may land over their writes."""
    if pool is not None:
        zero_pool(pool)
    if buffer is not None:
        buffer.zero_()
    settle(config)


def _raw_source(
    config: TransferConfig, rank: int, fed: list[int]
) -> tuple[torch.Tensor, dict[tuple[int, int], tuple[int, int]]]:
    """A prefill rank's raw-mode source: its share of every request for every decode rank
    it feeds, back to back in one buffer on ``config.device``; ``(offset, bytes)`` of each
    ``(request, decode rank)``."""
    shares = {
        (index, d): raw_share(config, index, rank, d)
        for index in range(config.requests)
        for d in fed
    }
    offsets: dict[tuple[int, int], tuple[int, int]] = {}
    position = 0
    for key, share in shares.items():
        offsets[key] = (position, share.numel())
        position += share.numel()
    source = torch.cat(list(shares.values())).to(config.torch_device)
    return source, offsets


def _warm_up(requests: Mapping[int, _Request]) -> None:
    """Wait for the warm-up requests, reporting none of them (they are not the run's).

    Raises:
        RuntimeError: one failed (the run would measure a broken set-up).
    """
    failed = _failures(requests, _wait_all(requests, lambda event: None)[0])
    if failed:
        raise RuntimeError(f"warm-up requests failed: {failed}")


class _Waitable(Protocol):
    """A request a driver can wait for (``KVSender``, ``KVReceiver``)."""

    def wait(self, timeout_s: float) -> KVPoll: ...


class _Request(_Waitable, Protocol):
    """A request that says why it failed (``KVSender``, ``KVReceiver``, ``RoomWaiter``)."""

    def failure(self) -> str | None: ...


def _failures(
    requests: Mapping[int, _Request], outcome: Mapping[int, KVPoll]
) -> dict[int, str | None]:
    """Why each request that did not succeed failed, by index."""
    return {i: r.failure() for i, r in requests.items() if outcome[i] is not KVPoll.Success}


def _wait_all(
    requests: Mapping[int, _Waitable], report: Report, timeout_s: float = ROOM_TIMEOUT_S
) -> tuple[dict[int, KVPoll], dict[int, float]]:
    """Wait for every request at once; report each as it ends, in the order they end.

    One waiter thread per request blocks in its ``wait`` (no polling, which would take CPU
    from the copying threads) and stamps ``time.monotonic()`` as the request's end wakes it.
    The main thread (the only one that touches the report socket) reports each request as
    its waiter hands it over.

    **Blocking:** until every request ended, at most ``timeout_s``.

    Returns:
        The state of each request (Success or Failed) and when it ended.

    Raises:
        TimeoutError: a request had not ended after ``timeout_s`` (its waiter is a daemon
            thread, left to end with its own bound).
    """
    ended: queue.SimpleQueue[tuple[int, KVPoll, float]] = queue.SimpleQueue()
    deadline = time.monotonic() + timeout_s

    def wait_one(index: int, request: _Waitable) -> None:
        try:
            state = request.wait(max(0.0, deadline - time.monotonic()))
        except Exception:  # every request is handed over: one whose wait raised failed
            logger.exception("waiting for request %d raised: counted as failed", index)
            state = KVPoll.Failed
        ended.put((index, state, time.monotonic()))

    for index, request in requests.items():
        threading.Thread(
            target=wait_one, args=(index, request), name=f"wait-request-{index}", daemon=True
        ).start()
    done: dict[int, KVPoll] = {}
    at: dict[int, float] = {}
    while len(done) < len(requests):
        got = None
        with suppress(queue.Empty):
            got = ended.get(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        if got is None or got[1] not in (KVPoll.Success, KVPoll.Failed):
            raise TimeoutError(f"requests {sorted(set(requests) - set(done))} did not finish")
        index, state, when = got
        done[index] = state
        at[index] = when
        report(RequestDone(index, state is KVPoll.Success))
    return done, at


class FirstRequestClock:
    """When this prefill rank sent its first ``STAGING_REQ`` of each room.

    Wraps ``peers.send`` (the staging writer's sockets), stamping each room's first
    ``STAGING_REQ`` just before handing it on unchanged. Install it before the first room
    opens.

    **Side:** prefill. **Thread-safety:** the wrapped ``send`` may be called from any thread
    (the listener's prefetch on ``ROOM_META``, the transfer worker's re-requests, the main
    thread's ``KVSender.init``); :attr:`first` is read once the rooms ended.
    """

    def __init__(self, peers: PeerSockets) -> None:
        self._send = peers.send
        self._lock = threading.Lock()
        self.first: dict[int, float] = {}
        """Room -> ``time.monotonic()`` of its first ``STAGING_REQ``."""
        peers.send = self.send  # type: ignore[method-assign]  # stamp, then pass on

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool:
        if len(frames) > 1 and frames[0] == StagingReq.WIRE_TYPE and frames[1].isdigit():
            now = time.monotonic()
            with self._lock:
                self.first.setdefault(int(frames[1]), now)
        return self._send(endpoint, frames)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (``ru_maxrss``); on Linux since the
    last :func:`reset_peak_rss`, else since the start."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``, which ``ru_maxrss`` reads too) to its current
    RSS; ``False`` where that is not possible (not Linux >= 4.0, or ``/proc`` not writable)."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def rss_status() -> tuple[int | None, int | None]:
    """``(VmRSS, VmHWM)`` of this process now, in bytes; ``None`` for each the kernel does
    not give."""
    found = proc_bytes(_PROC_STATUS, ("VmRSS", "VmHWM"))
    return found.get("VmRSS"), found.get("VmHWM")


class TransferMemory:
    """What a rank's process holds over its timed requests: made as they begin, read at the
    ``done`` barrier, before verification.

    Creating it resets the peak RSS and, on CUDA, the allocator's peak, so that the peaks
    count the pools, rings and buffers and what the transfer allocates, not the temporaries
    of filling the pools or of the warm-up. Where the RSS peak cannot be reset it counts from
    the process start, and :meth:`at_done` says so.

    **Thread:** the rank's main thread.
    """

    def __init__(self, config: TransferConfig) -> None:
        self._cuda = config.torch_device if config.device == "cuda" else None
        if self._cuda is not None:
            torch.cuda.reset_peak_memory_stats(self._cuda)
        self._reset = reset_peak_rss()

    def at_done(self) -> RankMemory:
        rss, hwm = rss_status()
        return RankMemory(
            hwm if hwm is not None else peak_rss_bytes(),
            "timed requests" if self._reset and hwm is not None else "process start",
            rss,
            None if self._cuda is None else int(torch.cuda.max_memory_allocated(self._cuda)),
        )
