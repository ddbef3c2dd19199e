"""Run a staged transfer across real processes: P prefill ranks and D decode ranks.

:func:`run_cluster` starts a bootstrap server, spawns one OS process per rank
(:mod:`staging_contracts._cluster.rank`), follows their progress over ZMQ and gathers their
reports into a :class:`ClusterResult`. The demo, the transfer benchmark and the multi-process
tests all go through it.

**Across hosts.** The ranks bind and advertise ``config.host``. A run may also be split:
``run_cluster(config, ranks="prefill", bootstrap=...)`` on one machine and ``ranks="decode"``
on another, both against the same bootstrap server; each driver starts and follows its own
side's ranks only (its inbox stays on loopback), and the ranks meet through the bootstrap.

**Faults.** When a rank dies (its process ends without its final report, or it reports a
failure), the driver records it as :attr:`ClusterResult.first_death`, tells every other
rank still running to stop (``SIGTERM``: the rank reports what it had and exits), keeps
collecting their reports for up to :data:`STOP_GRACE_S`, then kills what is left.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Final, Literal

import zmq

from .._run import INTERRUPT_GRACE_S, StopRequest, Supervisor
from .._run._codec import RankEvent, bind_pull, rank_event
from .._run.workload import TransferConfig
from ._messages import Metrics, RankMemory, RankSummary, Ready, RequestDone
from .bootstrap import BootstrapServer
from .metrics_relay import MetricsRelay
from .rank import rank_main

__all__ = [  # the reference page renders these (RankMemory: what transfer_memory returns)
    "EXIT_GRACE_S",
    "REPORT_GRACE_S",
    "STOP_GRACE_S",
    "ClusterResult",
    "RankExit",
    "RankMemory",
    "RankReport",
    "RankSet",
    "run_cluster",
]

logger = logging.getLogger(__name__)

REPORT_GRACE_S: Final = 0.5
"""How long after a rank's process ended its final report may still arrive; a rank without
one by then has died."""
STOP_GRACE_S: Final = 5.0
"""How long ranks told to stop (after a death, or at the run's timeout) have to report and
exit before they are killed."""
EXIT_GRACE_S: Final = 30.0
"""How long ranks that all reported have to exit before they are killed."""
_POLL_MS: Final = 50
"""Longest wait for a rank's message before the driver looks at the processes again."""
RankKey = tuple[str, int]
"""``(role, rank)`` of a rank."""
RankSet = Literal["all", "prefill", "decode"]
"""Which ranks a driver runs: every rank, or one side's (the other side runs elsewhere)."""


def _signal_name(exitcode: int | None) -> str | None:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


@dataclass(frozen=True, slots=True)
class RankExit:
    """How a rank that died ended, as the driver saw it."""

    role: str
    rank: int
    exitcode: int | None
    """The process's exit status: ``-N`` when signal ``N`` killed it, ``None`` if it still ran
    (it had reported a failure and had not exited yet)."""
    error: str | None
    """The failure the rank reported (``None``: it ended without a final report)."""
    last_words: str | None = None
    """Without a report: how the process ended in its own words (the traceback its entry
    point raised, bounded, or why it has none: :meth:`~staging_contracts._run.Supervisor.explain`).
    """

    @property
    def signal(self) -> str | None:
        """Name of the signal that killed the process (e.g. ``"SIGKILL"``), if one did."""
        return _signal_name(self.exitcode)

    @property
    def reason(self) -> str:
        """Why the rank died, in words: the signal, the exit code, or the reported error."""
        if self.error is not None:
            return f"reported a failure: {self.error}"
        if self.signal is not None:
            return f"killed by {self.signal} without a report"
        if self.last_words is not None:
            return f"ended without a report: it {self.last_words}"
        return f"exited with code {self.exitcode} without a report"


@dataclass(frozen=True, slots=True)
class RankReport:
    """What one rank reported at the end of the run."""

    role: str
    rank: int
    ok: bool
    """The rank ran to the end without an exception."""
    fields: RankSummary
    """The rank's summary, or its ``error`` and ``trace``."""
    exitcode: int | None
    """The process's exit status (0 when it exited by itself, ``-N`` when signal ``N``
    killed it)."""

    @property
    def signal(self) -> str | None:
        """Name of the signal that killed the process (e.g. ``"SIGKILL"``), if one did."""
        return _signal_name(self.exitcode)

    @property
    def stopped(self) -> bool:
        """The rank reported that the driver stopped it (after another rank died, or at the
        run's timeout); its ``fields`` then hold what it had done until then."""
        return self.fields.stopped


@dataclass(frozen=True, slots=True)
class ClusterResult:
    """The outcome of :func:`run_cluster`."""

    config: TransferConfig
    reports: tuple[RankReport, ...]
    """The reports of the ranks this driver ran (one side's only, in a split run)."""
    elapsed_s: float
    """From the first prefill rank starting its requests to the last decode rank finishing
    (in a split run, on this side's clock: from its first rank starting its requests to its
    last rank finishing them)."""
    failed_requests: frozenset[int] = field(default_factory=frozenset)
    """Request indexes some rank reported failed."""
    first_death: RankExit | None = None
    """The first rank that died (ended without its final report, or reported a failure),
    and how; ``None`` when none did."""
    stopped: tuple[RankKey, ...] = ()
    """Ranks the driver told to stop (``SIGTERM``) because a rank died or the run timed out,
    in the order told."""
    killed: tuple[RankKey, ...] = ()
    """Ranks the driver killed (``SIGKILL``) because they had not exited
    ``STOP_GRACE_S`` after being told to stop."""
    timed_out: bool = False
    """The run's ``timeout_s`` passed before every rank ended."""
    side: RankSet = "all"
    """Which ranks this driver ran: all, or one side's in a split run."""
    interrupted: str | None = None
    """The signal (``"SIGTERM"``, ``"SIGINT"``) that stopped the run before it ended: the
    reports are what the ranks had measured by then (a partial run)."""

    def ranks(self, role: str) -> list[RankReport]:
        """The reports of one side, by rank."""
        return sorted((r for r in self.reports if r.role == role), key=lambda r: r.rank)

    @property
    def all_ok(self) -> bool:
        """Every rank ran to the end and exited 0."""
        return all(r.ok and r.exitcode == 0 for r in self.reports)

    @property
    def verified(self) -> bool:
        """Every request succeeded and every decode page holds exactly the expected heads
        (a prefill-only run: every request succeeded as prefill saw it; its decode side
        verifies the pages)."""
        return (
            self.all_ok
            and not self.failed_requests
            and all(r.fields.verified for r in self.ranks("decode"))
        )

    @property
    def bytes_moved(self) -> int:
        """Payload bytes the prefill ranks wrote into decode rings."""
        return sum(r.fields.bytes_written for r in self.ranks("prefill"))

    @property
    def gbps(self) -> float:
        """Payload bandwidth of the transfer phase, GB/s."""
        return self.bytes_moved / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0

    @property
    def chunks(self) -> int:
        """Chunks the decode ranks staged."""
        return sum(r.fields.chunks for r in self.ranks("decode"))

    @property
    def control_messages(self) -> int:
        """Control messages every rank sent and received."""
        return sum(r.fields.control_messages for r in self.reports)

    def errors(self) -> list[str]:
        """The error of each rank that did not run to the end, named."""
        return [f"{r.role} {r.rank}: {r.fields.error}" for r in self.reports if not r.ok]

    def problems(self) -> list[str]:
        """The decode ranks' first mismatches."""
        return [line for r in self.ranks("decode") for line in r.fields.problems]

    def request_latencies_s(self) -> dict[int, float]:
        """Seconds each request took, by request index: from the earliest
        ``room_first_request_s`` of the prefill ranks to the latest ``room_done_s`` of the
        decode ranks (see :mod:`~staging_contracts._cluster.rank`). Only requests that no rank
        reported failed and that every rank of both sides stamped (a split run: none)."""
        first = _stamps([r.fields.room_first_request_s for r in self.ranks("prefill")], min)
        done = _stamps([r.fields.room_done_s for r in self.ranks("decode")], max)
        return {
            index: done[index] - first[index]
            for index in sorted(first.keys() & done.keys())
            if index not in self.failed_requests
        }

    def peak_rss_bytes(self, role: str) -> dict[int, int]:
        """Peak RSS of each rank process of one side as it ended (verification included), by
        rank, in bytes; ranks that did not report it are left out. :meth:`transfer_memory`
        gives what the transfer phase held."""
        return {
            r.rank: r.fields.peak_rss_bytes
            for r in self.ranks(role)
            if r.fields.peak_rss_bytes is not None
        }

    def transfer_memory(self, role: str) -> dict[int, RankMemory]:
        """What each rank process of one side held as the transfer phase ended (at the
        ``done`` barrier, before verification), by rank; ranks that did not report it (they
        died) are left out."""
        return {r.rank: r.fields.memory for r in self.ranks(role) if r.fields.memory is not None}

    def ring_peaks(self) -> dict[int, tuple[int, int]]:
        """``(reserved peak, ring bytes)`` of each decode rank's staging ring, by rank.

        The reserved peak (``StagingAllocator.peak_bytes``) may exceed the ring: the
        allocator hands out regions of the next round over ones still in use, and their
        writers wait for the watermark, so the bytes in use never do."""
        return {
            r.rank: (r.fields.ring_peak, r.fields.ring_size)
            for r in self.ranks("decode")
            if r.fields.ring_peak is not None and r.fields.ring_size is not None
        }


def _stamps(
    per_rank: list[dict[int, float]], pick: Callable[[list[float]], float]
) -> dict[int, float]:
    """``pick`` of the ranks' stamps of each request that every one of them stamped."""
    if not per_rank or not all(per_rank):
        return {}
    common = set.intersection(*(set(m) for m in per_rank))
    return {index: pick([m[index] for m in per_rank]) for index in common}


ProgressCallback = Callable[[RankEvent], None]
"""Called on the driver's thread with each progress event of a rank (:class:`Ready`,
:class:`RequestDone`) and who sent it."""


def run_cluster(
    config: TransferConfig,
    *,
    progress: ProgressCallback | None = None,
    timeout_s: float = 300.0,
    ranks: RankSet = "all",
    bootstrap: str | None = None,
    stop: StopRequest | None = None,
    metrics: MetricsRelay | None = None,
) -> ClusterResult:
    """Run every request of ``config`` through P + D rank processes and gather the reports.

    When a rank dies, the others are told to stop at once and their reports are still
    collected (see the module docstring); the result names the rank that died first and
    how. Each event a rank sends carries its ``pid``.

    Args:
        config: the run; its ``host`` is where the ranks bind and advertise.
        progress: called with each event of a rank.
        timeout_s: when to tell the ranks still running to stop.
        ranks: ``"all"``, or only one side's ranks (``"prefill"``, ``"decode"``) when the
            other side runs elsewhere against the same ``bootstrap``.
        bootstrap: the bootstrap server to join (``tcp://host:port``); ``None`` starts one
            for the run on ``config.host`` (only with ``ranks="all"``: the other side of a
            split run could not find it).
        stop: once it records a signal, the ranks are told to stop and have
            ``INTERRUPT_GRACE_S`` to report; the result is marked ``interrupted``.
        metrics: where the staged ranks' counters go, each second (``--metrics-port``;
            their ``metrics`` events are not passed to ``progress``).

    **Blocking:** until every rank reported and exited, at most ``timeout_s`` plus
    ``STOP_GRACE_S`` (and ``STOP_GRACE_S`` after a death).

    Raises:
        ImportError: the configured backend's engine cannot be imported.
        ValueError: a split run without a ``bootstrap``.
        SecurityError: no cluster secret, and ``config.host`` is not loopback.
    """
    from ..backends import load_backend  # noqa: PLC0415 - fail fast, before spawning

    if ranks != "all" and bootstrap is None:
        raise ValueError(f"a run of the {ranks} ranks only needs the bootstrap both sides use")
    load_backend(config.backend)
    server = None
    if bootstrap is None:
        server = BootstrapServer(config.host)
        server.start()
        bootstrap = server.endpoint
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    inbox, report_to = bind_pull(ctx)
    roles = _roles(config, ranks)
    supervisor: Supervisor[RankKey] = Supervisor()
    try:
        for key in roles:
            args = (key[0], key[1], config, bootstrap, report_to, metrics is not None)
            supervisor.start(key, rank_main, args, name=f"staging-{key[0]}-{key[1]}")
        watch = _Watch(supervisor, progress, stop, metrics)
        watch.follow(inbox, timeout_s)
    finally:
        supervisor.close()
        if server is not None:
            server.stop()
        inbox.close(linger=0)
    return _result(config, roles, watch, ranks)


def _roles(config: TransferConfig, ranks: RankSet) -> list[RankKey]:
    """The ranks a driver runs, decode first (they register the rooms prefill waits for)."""
    decode = [("decode", d) for d in range(config.decode_tp)] if ranks != "prefill" else []
    prefill = [("prefill", p) for p in range(config.prefill_tp)] if ranks != "decode" else []
    return decode + prefill


class _Watch:
    """The driver's view of a run: the ranks' messages, their deaths, and stopping them."""

    def __init__(
        self,
        processes: Supervisor[RankKey],
        progress: ProgressCallback | None,
        stop: StopRequest | None = None,
        metrics: MetricsRelay | None = None,
    ) -> None:
        self.processes = processes
        self.roles = list(processes.current)
        self.metrics = metrics
        self.progress = progress
        self.stop = stop
        self.interrupted: str | None = None
        self.reports: dict[RankKey, RankSummary] = {}
        self.rooms: dict[RankKey, dict[int, bool]] = {key: {} for key in self.roles}
        self.ended_at: dict[RankKey, float] = {}
        """When the driver first saw each process no longer alive."""
        self.dead: set[RankKey] = set()
        self.first_death: RankExit | None = None
        self.stopped: list[RankKey] = []
        self.killed: list[RankKey] = []
        self.timed_out = False
        self.stop_deadline: float | None = None

    def follow(self, inbox: zmq.Socket[bytes], timeout_s: float) -> None:
        """Collect messages until every rank ended and is accounted for (bounded)."""
        deadline = time.monotonic() + timeout_s
        while not self._settled():
            if inbox.poll(_POLL_MS):
                while inbox.poll(0):  # everything that arrived, then look at the processes
                    self._receive(inbox.recv())
            now = time.monotonic()
            self._look(now)
            self._interrupt(now)
            if self.stop_deadline is None:
                if self.first_death is not None:
                    self._stop(now, f"{self.first_death.role} {self.first_death.rank} died")
                elif now > deadline:
                    self.timed_out = True
                    logger.warning("run timed out after %.0f s; stopping the ranks", timeout_s)
                    self._stop(now, "the run timed out")
                elif len(self.reports) == len(self.roles):
                    self.stop_deadline = now + EXIT_GRACE_S  # all done: they only exit now
            if self.stop_deadline is not None and now > self.stop_deadline:
                self.killed += self.processes.kill()
                self._drain(inbox)
                return

    def _interrupt(self, now: float) -> None:
        """Stop the ranks within ``INTERRUPT_GRACE_S`` once the driver got a stop signal."""
        if self.stop is None or self.stop.name is None or self.interrupted is not None:
            return
        self.interrupted = self.stop.name
        logger.warning("interrupted by %s; stopping the ranks", self.interrupted)
        self._stop(now, f"interrupted by {self.interrupted}", INTERRUPT_GRACE_S)

    def _settled(self) -> bool:
        now = time.monotonic()
        return all(
            key in self.ended_at
            and (key in self.reports or now - self.ended_at[key] > REPORT_GRACE_S)
            for key in self.roles
        )

    def _receive(self, raw: bytes) -> None:
        got = rank_event(raw)
        if got is None:
            return
        event, key = got.message, got.key
        if key not in self.rooms:
            logger.warning("message from unknown rank %s dropped", key)
            return
        if isinstance(event, RankSummary):
            self.reports[key] = event
            if not event.ok and not (event.stopped and key in self.stopped):
                self._died(key, str(event.error))
            return
        if isinstance(event, Metrics):
            if self.metrics is not None:
                self.metrics.update(event.snapshot)
            return
        if isinstance(event, RequestDone):
            self.rooms[key][event.index] = event.ok
        if self.progress is not None and isinstance(event, Ready | RequestDone):
            try:
                self.progress(got)
            except Exception:  # the driver keeps following the ranks
                logger.exception("progress callback failed on %s", type(event).__name__)

    def _look(self, now: float) -> None:
        """Note processes that ended; one without a report by the grace has died."""
        for key in self.processes.ended():
            self.ended_at.setdefault(key, now)
        for key, ended in self.ended_at.items():
            if key not in self.reports and now - ended > REPORT_GRACE_S:
                self._died(key, None)

    def _died(self, key: RankKey, error: str | None) -> None:
        if key in self.dead:
            return
        self.dead.add(key)
        process = self.processes[key]
        words = None
        if error is None and not process.is_alive():
            words = self.processes.explain(process)
        death = RankExit(key[0], key[1], process.exitcode, error, words)
        if self.first_death is None:
            self.first_death = death
            logger.warning("%s %d died first: %s", key[0], key[1], death.reason)
        else:
            logger.info("%s %d died too: %s", key[0], key[1], death.reason)

    def _stop(self, now: float, why: str, grace_s: float = STOP_GRACE_S) -> None:
        """Tell every rank still running without a final report to stop (SIGTERM); they
        have ``grace_s``, or less where an earlier stop's deadline comes sooner."""
        self.stop_deadline = min(now + grace_s, self.stop_deadline or math.inf)
        running = [k for k in self.roles if k not in self.reports and k not in self.ended_at]
        for key in self.processes.terminate(running):
            logger.info("stopping %s %d: %s", key[0], key[1], why)
            self.stopped.append(key)

    def _drain(self, inbox: zmq.Socket[bytes]) -> None:
        """Collect the reports already sent (the killed ranks cannot send more)."""
        until = time.monotonic() + REPORT_GRACE_S
        while time.monotonic() < until and inbox.poll(_POLL_MS):
            self._receive(inbox.recv())


def _result(
    config: TransferConfig, roles: list[RankKey], watch: _Watch, ranks: RankSet
) -> ClusterResult:
    out: list[RankReport] = []
    failed: set[int] = set()
    for key in roles:
        fields = watch.reports.get(key)
        if fields is None:
            error = "no report (the process died or timed out)"
            fields = RankSummary(error=error, rooms=dict(watch.rooms[key]))
        exitcode = watch.processes[key].exitcode
        out.append(RankReport(key[0], key[1], fields.ok, fields, exitcode))
        failed.update(fields.failed)
    # The transfer starts with prefill's requests and ends with decode's last room; a split
    # run's driver sees one side only, and measures that side on its own clock.
    first = "prefill" if ranks != "decode" else "decode"
    last = "decode" if ranks != "prefill" else "prefill"
    starts = [r.fields.start for r in out if r.role == first and r.fields.start is not None]
    ends = [r.fields.end for r in out if r.role == last and r.fields.end is not None] or [
        r.fields.end for r in out if r.role == first and r.fields.end is not None
    ]  # none: the run was stopped, and its first side's ranks said when they stopped
    elapsed = max(ends) - min(starts) if starts and ends else 0.0
    death = watch.first_death
    if death is not None and death.exitcode is None:  # it reported a failure, then exited
        death = replace(death, exitcode=watch.processes[(death.role, death.rank)].exitcode)
    return ClusterResult(
        config,
        tuple(out),
        elapsed,
        frozenset(failed),
        first_death=death,
        stopped=tuple(watch.stopped),
        killed=tuple(watch.killed),
        timed_out=watch.timed_out,
        interrupted=watch.interrupted,
        side=ranks,
    )
