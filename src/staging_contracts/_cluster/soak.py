"""The soak's driver: rank processes kept busy with rooms while faults are injected.

:func:`run_soak` runs the soak docs/operating.md describes: P prefill and D decode rank
processes (:mod:`.soak_rank`), :attr:`~.soak_report.SoakConfig.rooms_in_flight` rooms moving
through them, each checked against the seeded workload (:mod:`.workload`), and the listed
faults in turn; at the end the rooms in flight end (bounded) and every rank is asked for its
counters until it is idle. The outcome is a :class:`~.soak_report.SoakResult`.

A room is issued to every rank at once (decode first: it registers the room before prefill
asks for regions); its workload request is reused only after every rank reported the
previous room on it (a decode rank zeroes the pages first). While a killed rank is down,
rooms keep coming to the survivors, with the peers they know (a router has not noticed
either).

**Rooms go only to ranks that know their peers.** A rank is sent rooms once it answered a
``peers`` command (its ``peers`` event), never merely because it is ``ready``: a restarted rank
is sent every rank's ``peers`` as soon as it is ready (the survivors learn of it at the same
time), and rooms reach it only after it answered. Every room is settled with a reason: a rank
that could not open a room reports it ``failed`` (``rank error: ...``), a room command that
could not be sent counts as failed on that rank, and a room a live rank never reported is
``hung`` ``room_bound_s + HUNG_SLACK_S`` after it was issued (no wait lasts longer).

**One clock:** every time the soak reports (the progress lines, each fault's ``at_s``, the
elapsed time) is in seconds since the soak started (:attr:`SoakResult.elapsed_s`'s zero: just
before the rank processes start). A progress line is stamped with the time its fault began.

**Threads:** one; :func:`run_soak` blocks and calls ``progress`` on its own thread (the flood
sends from two threads of its own). Every wait is bounded (the ``*_S`` constants and the
config's bounds); every process it started is gone when it returns.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Final

import zmq

from .._control.security import CurveKeys, check_insecure_bind, load_cluster_secret
from .._run import INTERRUPT_GRACE_S, Interrupted, Supervisor, stop_on_signals
from .._run._codec import Message, bind_pull, encode, rank_event
from . import _messages as msg
from .bootstrap import RankInfo
from .metrics_relay import MetricsRelay, serving
from .soak_flood import (
    FLOOD_DEADLINE_S,
    FLOOD_ENDPOINT,
    FloodTarget,
    flood_counts,
    flood_state,
    send_flood,
    state_bounds,
)
from .soak_forge import FORGE_WRITE_TIMEOUT_S, SCRIBBLE_S, Forger, Scribbler, forged_arrivals
from .soak_memory import judge_memory
from .soak_rank import soak_rank_main
from .soak_report import (
    FAULT_ORDER,
    FloodRecord,
    ForgeRecord,
    KillRecord,
    SoakConfig,
    SoakResult,
    StallRecord,
    reason_group,
)
from .soak_ticker import Ticker, tally_line

logger = logging.getLogger(__name__)

SHORT_STALL_S: Final = 2.0
"""How long ``stall`` stops a prefill rank."""
LONG_STALL_EXTRA_S: Final = 1.5
"""How much longer than the liveness timeout ``stall-long`` stops a prefill rank."""
STARTUP_S: Final = 120.0
"""Longest a rank process may take to report ``ready``."""
PEERS_S: Final = 10.0
"""Longest a rank may take to answer ``peers``; rooms pause meanwhile (see ``_top_up``)."""
STATUS_EVERY_S: Final = 2.0
"""How often the driver asks every rank for its counters while the soak runs."""
STATUS_S: Final = 10.0
"""Longest the driver waits for a rank's answer to one ``status`` command."""
IDLE_S: Final = 20.0
"""Longest the driver waits, at the end, for every ring and fence to drain."""
HUNG_SLACK_S: Final = 5.0
"""A room no rank reported ``room_bound_s`` plus this long after it was issued is hung."""
STOP_S: Final = 15.0
"""Longest a rank gets to exit after ``stop`` before it is killed."""
NEEDED_S: Final = 10.0
"""Longest a kill or stall waits for a room in flight that needs its victim."""
MAX_REVIVALS: Final = 3
"""Rank processes that died by themselves the soak replaces before it gives up."""
_PUMP_S: Final = 0.02
"""Longest the driver waits for an event before it looks at processes and rooms again."""
_SEND_TIMEOUT_MS: Final = 1000

RankKey = tuple[str, int]
"""``(role, rank)`` of a rank."""


ProgressCallback = Callable[[str], None]
"""Called on the driver's thread with one line about each fault as it ends, and a tally of
the rooms at least every :data:`~.soak_ticker.TICK_EVERY_S` (:mod:`.soak_ticker`); a line
starts with the time its fault began (a tally: its own), in seconds since the soak started
(the summary's clock)."""


def run_soak(
    config: SoakConfig,
    *,
    progress: ProgressCallback | None = None,
    metrics_port: int | None = None,
    relay: MetricsRelay | None = None,
) -> SoakResult:
    """Run the soak described by ``config`` and gather its outcome.

    With ``metrics_port``, every rank's Prometheus series are served at
    ``http://127.0.0.1:metrics_port/metrics`` while it runs (:mod:`.metrics_relay`); with
    ``relay`` instead, the ranks' snapshots go to that relay of the caller's (which serves
    them or not, and keeps them after the run).

    **Blocking:** about ``duration_s``, plus start-up, the fault due at the end, the drain
    of the rooms in flight and the stop; each of those is bounded. Every rank process is
    gone when it returns, whatever happened. ``SIGTERM`` or ``SIGINT`` ends the run where
    it is: the ranks are stopped within ``INTERRUPT_GRACE_S`` and the result, marked
    ``interrupted``, holds what was seen so far.

    Raises:
        ImportError: the configured backend's engine cannot be imported, or (with
            ``metrics_port``) ``prometheus_client``.
        OSError: ``metrics_port`` cannot be bound.
        ValueError: the backend spec does not resolve, or its engine works within one
            process only (:func:`~staging_contracts._cluster.preflight.check_backend`).
        SecurityError: ``host`` is not loopback and no cluster secret is set, or the secret
            in the environment is unusable (checked before any process starts).
        RuntimeError: a rank process did not start (not ready in ``STARTUP_S``, or it
            exited first), or ranks died by themselves more than ``MAX_REVIVALS`` times.
    """
    from .preflight import check_backend  # noqa: PLC0415 - fail fast, before spawning

    check_backend(config.backend)
    if load_cluster_secret() is None:
        check_insecure_bind(config.host, allow_insecure=False)
    if relay is not None:
        return _run(config, progress, relay)
    with serving(metrics_port) as served:
        if served is not None and progress is not None:
            progress(f"serving metrics at {served.url}")
        return _run(config, progress, served)


def _run(
    config: SoakConfig, progress: ProgressCallback | None, relay: MetricsRelay | None
) -> SoakResult:
    driver = _Driver(config, progress, relay)
    with stop_on_signals(raise_on_signal=True) as stop:
        try:
            try:
                driver.run()
            finally:
                driver.shutdown(INTERRUPT_GRACE_S if stop.signum is not None else STOP_S)
        except Interrupted:  # raised in the run, or in a shutdown already under way
            logger.warning("interrupted by %s; the ranks are stopped", stop.name)
            driver.shutdown(INTERRUPT_GRACE_S)
    return dataclasses.replace(driver.result(), interrupted=stop.name)


# --------------------------------------------------------------------------- the driver


@dataclass
class _Rank:
    """One rank process as the driver knows it."""

    key: RankKey
    process: BaseProcess
    pid: int | None = None
    info: RankInfo | None = None
    commands: zmq.Socket[bytes] | None = None
    peers_sent: float | None = None
    """When it was last sent ``peers`` (``time.monotonic()``)."""
    peered: bool = False
    """It answered a ``peers`` command: it can open rooms, and only now is it sent any."""
    gone: bool = False
    """The driver has seen it dead (killed or by itself) and stopped talking to it."""

    @property
    def name(self) -> str:
        """``"decode 0"``, ``"prefill 1"``, ..."""
        return f"{self.key[0]} {self.key[1]}"

    def close_commands(self) -> None:
        if self.commands is not None:
            self.commands.close(linger=0)
            self.commands = None


@dataclass
class _Room:
    room: int
    index: int
    issued: float
    expected: dict[RankKey, int]
    """The ranks (and their process ids) that must report the room."""
    reports: dict[RankKey, msg.RoomEnded] = field(default_factory=dict)
    lost: set[RankKey] = field(default_factory=set)
    """Ranks that died before reporting it."""
    outcome: str | None = None
    """``succeeded``, ``failed``, ``corrupt`` or ``hung`` once settled."""
    reason: str = ""
    settled_at: float = 0.0
    prefill_failed: bool = False
    """Succeeded on every decode rank, but a prefill rank failed it or died."""

    def waiting(self) -> set[RankKey]:
        return set(self.expected) - set(self.reports) - self.lost


class _Driver:
    def __init__(
        self,
        config: SoakConfig,
        progress: ProgressCallback | None,
        relay: MetricsRelay | None = None,
    ) -> None:
        self.config = config
        self.settings = dataclasses.replace(config.rank_settings(), metrics=relay is not None)
        self.relay = relay
        self.progress = progress
        self.rng = random.Random(config.seed)
        self.hung_after_s = config.room_bound_s + HUNG_SLACK_S
        """A room no rank reported this long after it was issued is hung."""
        self.long_stall_s = config.liveness_timeout_s + LONG_STALL_EXTRA_S
        """How long ``stall-long`` and ``pause`` stop a rank."""
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.inbox, self.inbox_endpoint = bind_pull(self.ctx)  # the ranks run on this host
        self.processes: Supervisor[RankKey] = Supervisor()
        """Every rank process of the soak, each able to say how it died."""
        self.keys: list[RankKey] = [("decode", d) for d in range(config.decode_tp)] + [
            ("prefill", p) for p in range(config.prefill_tp * config.prefill_instances)
        ]
        self.next_instance = 0
        """The prefill instance the next room goes to (in turn)."""
        self.ranks: dict[RankKey, _Rank] = {}
        self.rooms: dict[int, _Room] = {}
        self.next_room = 1_000_000
        self.free = list(range(config.transfer().requests))
        self.issuing = False
        self.peering = False
        """The first ``peers`` went out: a rank that is ready from now on (a restarted one) is
        sent every rank's peers at once."""
        self.start = time.monotonic()
        self.ended = self.start
        self.ticker = Ticker(self.start)
        self.status_ticker = Ticker(float("-inf"), STATUS_EVERY_S)
        self.status_id = 0
        self.answers: dict[int, dict[RankKey, msg.RankStatus]] = {}
        self.last_status: dict[int, tuple[RankKey, msg.RankStatus]] = {}
        """Process id -> its rank and latest status (so killed processes' counts are kept)."""
        self.kills: list[tuple[KillRecord, _Rank | None]] = []
        """Each kill, with the new process (``None``: it did not take its peers in time)."""
        self.stalls: list[StallRecord] = []
        self.floods: list[FloodRecord] = []
        self.forges: list[ForgeRecord] = []
        self.forger = Forger(config.host)  # each starts its engine at its first use
        self.scribbler = Scribbler(config.host)
        self.injected: Counter[str] = Counter()
        self.listener_deaths: set[int] = set()
        self.unexpected: list[str] = []
        self.exit_errors: dict[int, str] = {}
        """Process id -> the error it reported on its way out."""
        self.errors: list[str] = []
        self.final: dict[RankKey, msg.RankStatus] = {}
        self.idle = False
        self.startup_s = 10.0

    # ------------------------------------------------------------------ the run

    def run(self) -> None:
        config = self.config
        for key in self.keys:
            self._spawn(key)
        if unready := self._lacking(lambda rank: rank.info is not None, STARTUP_S):
            raise RuntimeError(f"rank processes not ready in {STARTUP_S:.0f} s: {unready}")
        self._send_peers()
        self.peering = True
        if unpeered := self._lacking(lambda rank: rank.peered, PEERS_S):
            raise RuntimeError(f"rank processes did not take their peers: {unpeered}")
        self.startup_s = time.monotonic() - self.start
        self.issuing = True
        run_from = time.monotonic()
        cycle = [name for name in FAULT_ORDER if name in config.faults and name != "drop"]
        # forge: NIXL notifications authenticated with the secret, or Mooncake (hostile
        # one-sided writes, with or without the secret)
        if "forge" in cycle and not (
            config.backend == "mooncake"
            or (config.backend == "nixl" and load_cluster_secret() is not None)
        ):
            logger.warning("forge skipped: it needs nixl and the cluster secret, or mooncake")
            cycle.remove("forge")
        turn = 0
        while True:
            remaining = config.duration_s - (time.monotonic() - run_from)
            if all(self.injected[name] for name in cycle):
                upcoming = cycle[turn % len(cycle)] if cycle else None
                if upcoming is None or remaining < config.settle_s + self._estimate(upcoming):
                    # Fault-free time after the last fault too: the ranks it hit (a restarted
                    # one) serve rooms again before the end.
                    settle = config.settle_s if turn else 0.0
                    self._wait(_never, max(settle, remaining))
                    break
            self._wait(_never, config.settle_s)
            self._inject(cycle[turn % len(cycle)])
            turn += 1
        self.issuing = False
        self._wait(lambda: not self._unsettled(), self._until_hung(self._unsettled()))
        for room in self._unsettled():
            self._settle(room, hung=f"no report in {self.hung_after_s:.0f} s")
        self.idle = self._wait_idle()
        if "drop" in config.faults and self._drops()[1]:
            self.injected["drop"] = 1

    def _until_hung(self, rooms: list[_Room]) -> float:
        """Seconds until the last of ``rooms`` counts as hung (the longest a wait for them
        needs: ``_step`` settles each one then)."""
        if not rooms:
            return 0.0
        last = max(room.issued for room in rooms)
        return max(0.0, last + self.hung_after_s - time.monotonic()) + 2 * _PUMP_S

    def _estimate(self, fault: str) -> float:
        """About how long injecting ``fault`` takes (to not start one past the duration)."""
        return {
            "flood": 6.0,
            "forge": 3.0 + SCRIBBLE_S + self.config.settle_s,
            "stall": SHORT_STALL_S,
            "stall-long": self.long_stall_s,
            "pause": 2 * (self.long_stall_s + self.config.settle_s),
        }.get(fault, self.config.liveness_timeout_s + self.startup_s + 2.0)

    def shutdown(self, grace_s: float = STOP_S) -> None:
        """Stop every rank process (``stop``, then ``SIGKILL`` after ``grace_s``; a grace
        shorter than :data:`STOP_S`, an interrupt's, gives the transfer worker a quarter of
        it); idempotent."""
        self.issuing = False
        stop = msg.Stop(close_s=grace_s / 4) if grace_s < STOP_S else msg.Stop()
        for rank in self.ranks.values():
            if not rank.gone:
                self._send(rank, stop)
        self.processes.close(grace_s)
        for rank in self.ranks.values():
            rank.close_commands()
        self.ended = time.monotonic()
        self.inbox.close(linger=0)
        self.forger.close()
        self.scribbler.close()

    # ------------------------------------------------------------------ faults

    def _inject(self, fault: str) -> None:
        if fault == "flood":
            self._flood()
        elif fault == "forge":
            self._forge()
        elif fault == "stall":
            self._stall(SHORT_STALL_S, "prefill", fault)
        elif fault == "stall-long":
            self._stall(self.long_stall_s, "prefill", fault)
        elif fault == "pause":  # both roles, each past the liveness timeout
            self._stall(self.long_stall_s, "prefill", fault)
            self._wait(_never, self.config.settle_s)
            self._stall(self.long_stall_s, "decode", fault)
        elif fault in ("kill-prefill", "kill-decode"):
            self._kill(fault.removeprefix("kill-"))
        self.injected[fault] += 1

    def _victim(self, role: str) -> _Rank:
        """A ``role`` rank, drawn, once a room in flight needs it (the soak goes on meanwhile,
        bounded by ``NEEDED_S``), so that the fault hits rooms that depend on it."""
        rank = self.ranks[self.rng.choice(self._role_keys(role))]
        self._wait(lambda: self._needed(rank), NEEDED_S)
        return rank

    def _needed(self, rank: _Rank) -> bool:
        """Whether a room in flight still waits for ``rank`` and for another rank too."""
        return any(
            rank.key in waiting and len(waiting) > 1
            for waiting in (room.waiting() for room in self._unsettled())
        )

    def _kill(self, role: str) -> None:
        rank = self._victim(role)
        at = time.monotonic()
        rank.process.kill()
        self._died(rank, at, unexpected=False)

    def _died(self, rank: _Rank, at: float, *, unexpected: bool) -> None:
        """A rank died: time how the others take it, then start a new process for it; once
        it is ready every rank is sent the peers (``_ready``), and once it took them rooms
        reach it again (rooms keep coming to the survivors meanwhile, see ``_top_up``)."""
        rank.gone = True
        if self.relay is not None:  # its last values are no longer current
            self.relay.mark_dead(*rank.key)
        if unexpected:
            self.unexpected.append(
                f"{rank.name} (pid {rank.pid}) exited with {rank.process.exitcode}"
            )
        waiting = [r for r in self._unsettled() if rank.key in r.waiting()]
        # The rooms a survivor still had in flight: those the death must be detected for
        # (a room every survivor had ended already only lacked the dead rank's word).
        dependent = [r for r in waiting if r.waiting() - {rank.key}]
        for room in waiting:
            room.lost.add(rank.key)
            self._maybe_settle(room)
        self._wait(
            lambda: all(r.outcome is not None for r in dependent), self._until_hung(dependent)
        )
        failed_at = [
            report.t
            for room in dependent
            if room.outcome == "failed"
            for report in room.reports.values()
            if report.state == "failed" and report.t >= at
        ]
        failed = sum(room.outcome == "failed" for room in dependent)
        detect = max(failed_at) - at if failed_at else None
        rank.process.join(5)
        rank.close_commands()
        new = self._spawn(rank.key)
        back = self._wait(lambda: new.info is not None, STARTUP_S) and self._wait(
            lambda: new.peered, PEERS_S
        )
        restart = time.monotonic() - at if back else None
        in_flight = len(dependent)
        record = KillRecord(
            *rank.key, at - self.start, in_flight, failed, detect, restart, unexpected
        )
        self.kills.append((record, new if back else None))
        detected = "no room failed" if detect is None else f"detected in {detect:.2f} s"
        self._say(
            at,
            f"{'died' if unexpected else 'killed'} {rank.name} with "
            f"{in_flight} rooms in flight ({failed} failed): {detected}; "
            + ("back" if back else "NOT back")
            + (f" in {restart:.1f} s" if restart is not None else ""),
        )

    def _stall(self, seconds: float, role: str, fault: str) -> None:
        """Stop a ``role`` rank (``SIGSTOP``) with rooms in flight that need it, for
        ``seconds``, then continue it (``SIGCONT``) and count the rooms that failed."""
        rank = self._victim(role)
        in_flight = self._unsettled()
        at = time.monotonic()
        pid = rank.process.pid
        if pid is None:
            return
        os.kill(pid, signal.SIGSTOP)
        try:
            self._wait(_never, seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        self._wait(lambda: all(r.outcome is not None for r in in_flight), self.config.settle_s)
        # Rooms issued during the stop need the stopped rank too: count every room that
        # failed from the stop until now.
        failed = sum(r.outcome == "failed" and r.settled_at >= at for r in self.rooms.values())
        self.stalls.append(
            StallRecord(rank.key[1], at - self.start, seconds, len(in_flight), failed, role, fault)
        )
        self._say(
            at,
            f"{fault}: stopped {role} {rank.key[1]} for {seconds:.1f} s with "
            f"{len(in_flight)} rooms in flight; {failed} failed meanwhile",
        )

    def _flood(self) -> None:
        """Flood a decode rank, then a prefill rank (each role's ranks in turn)."""
        turn = self.injected["flood"]
        for role in ("decode", "prefill"):
            keys = self._role_keys(role)
            self._flood_one(self.ranks[keys[turn % len(keys)]])

    def _flood_one(self, rank: _Rank) -> None:
        """Flood ``rank`` from two threads (``soak_flood``): with the secret through CURVE
        sockets whose key it was told to trust; then wait (bounded) until its counters
        account for every message, and record what it holds after."""
        if rank.info is None:
            return
        keys = CurveKeys.generate() if load_cluster_secret() is not None else None
        if keys is not None:
            self._send(rank, msg.Trust(FLOOD_ENDPOINT, keys.public.decode()))
        before = self._status_of(rank) or _NO_STATUS  # answered after the trust
        session = rank.info
        if rank.key[0] == "prefill":  # its messages name a decode rank's session
            decode = (r.info for k, r in self.ranks.items() if k[0] == "decode" and r.info)
            session = next(decode, session)
        late = [room.room for room in self.rooms.values() if room.outcome is not None][-64:]
        target = FloodTarget(
            rank.info.endpoint,
            rank.key[0],
            session.session_id,
            late,
            keys,
            rank.info.curve_key.encode("ascii"),
        )
        at = time.monotonic()
        sent: list[Counter[str]] = [Counter(), Counter()]
        half, seed = self.config.flood_frames // 2, self.config.seed
        threads = [
            threading.Thread(
                target=send_flood,
                args=(self.ctx, target, half, seed + i, sent[i]),
                name=f"soak-flood-{i}",
                daemon=True,
            )
            for i in range(2)
        ]
        for thread in threads:
            thread.start()
        self._wait(lambda: not any(t.is_alive() for t in threads), FLOOD_DEADLINE_S + 15.0)
        seconds = time.monotonic() - at
        by_kind = sent[0] + sent[1]
        total = sum(by_kind.values())
        after = _NO_STATUS

        def counted_all() -> bool:
            nonlocal after
            after = self._status_of(rank) or after
            return sum(flood_counts(before, after).values()) >= total

        self._poll(counted_all, STATUS_S)
        counts = flood_counts(before, after)
        chunks = len(list(self.config.transfer().chunks()))
        bounds = state_bounds(self.config.rooms_in_flight, chunks, self.config.decode_tp)
        record = FloodRecord(
            rank.name,
            at - self.start,
            total,
            sum(counts.values()),
            seconds,
            keys is not None,
            dict(by_kind),
            counts,
            flood_state(after),
            bounds,
        )
        self.floods.append(record)
        self._say(
            at,
            f"flooded {record.target} with {total} messages "
            f"({'authenticated' if keys else 'plain'}); it counted {record.counted}"
            + (f"; grew: {', '.join(record.grown)}" if record.grown else ""),
        )

    def _forge(self) -> None:
        """Send a decode rank forged arrivals for the rooms in flight from a hostile agent
        that holds its engine metadata, and wait (bounded) until it counted them
        ``unauthorized``; over Mooncake, overwrite its ring instead (``_scribble``)."""
        rank = self._victim("decode")
        info = rank.info
        if info is None:
            return
        if self.config.backend == "mooncake":
            self._scribble(rank, info)
            return
        before = (self._status_of(rank) or _NO_STATUS).unauthorized
        rooms = [room.room for room in self._unsettled()]
        chunks = list(self.config.transfer().chunks())
        payloads = forged_arrivals(rooms, chunks, info.session_id, self.config.prefill_tp, self.rng)
        at = time.monotonic()
        sent = self.forger.send(info.session_id, info.metadata, payloads)
        counted = 0

        def counted_all() -> bool:
            nonlocal counted
            self.forger.progress()
            answer = self._status_of(rank)
            if answer is not None:
                counted = answer.unauthorized - before
            return counted >= sent

        self._poll(counted_all, STATUS_S)
        self.forges.append(ForgeRecord(rank.name, at - self.start, len(rooms), sent, counted))
        self._say(
            at,
            f"forged {sent} arrivals to {rank.name} for {len(rooms)} rooms in flight; "
            f"{counted} counted unauthorized",
        )

    def _scribble(self, rank: _Rank, info: RankInfo) -> None:
        """Overwrite ``rank``'s ring with garbage from a hostile Mooncake engine for
        ``SCRIBBLE_S`` while rooms go on (``soak_forge.Scribbler``, on a thread), and count
        the rooms that failed ``integrity`` meanwhile."""
        rooms = len(self._unsettled())
        stop = threading.Event()
        seed = self.rng.randrange(1 << 30)
        done: list[tuple[int, int]] = []
        errors: list[str] = []

        def run() -> None:
            try:
                done.append(
                    self.scribbler.scribble(
                        info.session_id,
                        info.metadata,
                        (info.ring_base, info.ring_size),
                        stop,
                        seed,
                    )
                )
            except (ImportError, RuntimeError, ValueError) as exc:  # said in the errors
                errors.append(f"{type(exc).__name__}: {exc}")

        at = time.monotonic()
        thread = threading.Thread(target=run, name="soak-scribble", daemon=True)
        thread.start()
        try:
            self._wait(_never, SCRIBBLE_S)
        finally:
            stop.set()
            self._wait(lambda: not thread.is_alive(), FORGE_WRITE_TIMEOUT_S + 5.0)
        seconds = time.monotonic() - at
        self._wait(_never, self.config.settle_s)  # the rooms it hit end meanwhile
        if errors:
            self.errors.append(f"forge: the hostile engine failed: {errors[0]}")
        writes, written = done[0] if done else (0, 0)
        failed = sum(
            r.outcome == "failed" and r.settled_at >= at and reason_group(r.reason) == "integrity"
            for r in self.rooms.values()
        )
        self.forges.append(
            ForgeRecord(
                rank.name, at - self.start, rooms, writes, 0, "write", written, seconds, failed
            )
        )
        self._say(
            at,
            f"overwrote the ring of {rank.name} {writes} times in {seconds:.1f} s; "
            f"{failed} rooms failed integrity",
        )

    # ------------------------------------------------------------------ the pump

    def _wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Keep the soak going (events, rooms, deaths) until ``done()`` or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if done():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._step(min(_PUMP_S, remaining))

    def _step(self, timeout_s: float) -> None:
        if self.inbox.poll(max(1, round(timeout_s * 1000))):
            while self.inbox.poll(0):
                self._event(self.inbox.recv())
        now = time.monotonic()
        self._look_at_processes(now)
        self._top_up()
        for room in self._unsettled():
            if now - room.issued > self.hung_after_s:
                self._settle(room, hung="no report")
        if self.ticker.due(now):
            self._say(now, tally_line(room.outcome for room in self.rooms.values()))
        if self.status_ticker.due(now):
            self._ask_status(self.keys)

    def _look_at_processes(self, now: float) -> None:
        """Start a new process for a rank that died by itself (up to ``MAX_REVIVALS`` times).

        Raises:
            RuntimeError: a rank died before it was ready (it would again), or ranks died by
                themselves more than ``MAX_REVIVALS`` times.
        """
        for rank in list(self.ranks.values()):  # _died replaces its rank, and pumps events
            if rank.gone or rank.process.is_alive():  # a rank the soak kills is gone at once
                continue
            rank.gone = True
            why = self.exit_errors.get(rank.pid or 0) or self.processes.explain(rank.process)
            name = f"{rank.name} (pid {rank.pid})"
            if rank.info is None:
                raise RuntimeError(f"{name} exited while starting: {why}")
            if len(self.unexpected) >= MAX_REVIVALS:
                raise RuntimeError(f"{name} died by itself, and {MAX_REVIVALS} did before: {why}")
            logger.error("%s died by itself: %s", name, why)
            self._died(rank, now, unexpected=True)

    def _event(self, raw: bytes) -> None:
        got = rank_event(raw)
        if got is None:
            return
        key, pid, event = got.key, got.pid, got.message
        rank = self.ranks.get(key)
        current = rank is not None and rank.pid == pid
        if isinstance(event, msg.RoomEnded):
            room = self.rooms.get(event.room)
            if room is not None and room.expected.get(key) == pid and room.outcome is None:
                room.reports[key] = event
                self._maybe_settle(room)
        elif isinstance(event, msg.RankStatus):
            self.last_status[pid] = (key, event)
            answers = self.answers.get(event.id)
            if answers is not None and current:
                answers[key] = event
            if not event.listener_alive:
                self.listener_deaths.add(pid)
        elif isinstance(event, msg.Serving) and rank is not None and current:
            self._ready(rank, event)
        elif isinstance(event, msg.PeersTaken) and rank is not None and current and rank.info:
            rank.peered = True
        elif isinstance(event, msg.Metrics) and self.relay is not None and current:
            self.relay.update(event.snapshot)
        elif isinstance(event, msg.ListenerDown):
            self.listener_deaths.add(pid)
        elif isinstance(event, msg.RankError):
            self.errors.append(f"{key[0]} {key[1]}: {event.error}")
        elif isinstance(event, msg.Exit) and not event.ok:
            self.exit_errors[pid] = str(event.error)
            self.errors.append(f"{key[0]} {key[1]} exited: {event.error}")

    # ------------------------------------------------------------------ ranks

    def _spawn(self, key: RankKey) -> _Rank:
        args = (key[0], key[1], self.settings, self.inbox_endpoint)
        process = self.processes.start(key, soak_rank_main, args, name=f"soak-{key[0]}-{key[1]}")
        rank = _Rank(key, process, pid=process.pid)
        self.ranks[key] = rank
        return rank

    def _ready(self, rank: _Rank, event: msg.Serving) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        sock.connect(event.commands)
        rank.commands, rank.info = sock, event.info
        if self.peering:  # a restarted rank: it and the others learn its peers now, and it
            self._send_peers()  # gets rooms once it answers (``peered``), never before

    def _answering_peers(self) -> bool:
        """Whether a rank was sent ``peers`` less than ``PEERS_S`` ago and has not answered."""
        now = time.monotonic()
        return any(
            not rank.peered
            and not rank.gone
            and rank.peers_sent is not None
            and now - rank.peers_sent < PEERS_S
            for rank in self.ranks.values()
        )

    def _lacking(self, has: Callable[[_Rank], bool], timeout_s: float) -> str:
        """Wait (bounded) until every rank ``has``; the ranks that still lack it, named."""

        def lacking() -> str:
            return ", ".join(rank.name for rank in self.ranks.values() if not has(rank))

        self._wait(lambda: not lacking(), timeout_s)
        return lacking()

    def _role_keys(self, role: str) -> list[RankKey]:
        return [key for key in self.keys if key[0] == role]

    def _send(self, rank: _Rank, command: Message) -> bool:
        if rank.commands is None or rank.gone:
            return False
        try:
            rank.commands.send(encode(command))
        except zmq.Again:
            logger.warning("%s %d takes no commands; %s dropped", *rank.key, type(command).__name__)
            return False
        return True

    def _send_peers(self) -> None:
        infos = {key: rank.info for key, rank in self.ranks.items() if rank.info is not None}
        for key, rank in self.ranks.items():
            other = "prefill" if key[0] == "decode" else "decode"
            peers = tuple(info for k, info in sorted(infos.items()) if k[0] == other)
            if self._send(rank, msg.Peers(peers)):
                rank.peers_sent = time.monotonic()

    def _ask_status(self, keys: Iterable[RankKey]) -> int:
        self.status_id += 1
        self.answers[self.status_id] = {}
        for key in keys:
            self._send(self.ranks[key], msg.AskStatus(self.status_id))
        self.answers = {i: a for i, a in self.answers.items() if i > self.status_id - 50}
        return self.status_id

    def _status(self, keys: list[RankKey]) -> dict[RankKey, msg.RankStatus]:
        """Ask ``keys`` for their counters and wait (bounded) for every answer."""
        asked = self._ask_status(keys)
        answers = self.answers[asked]
        self._wait(lambda: all(key in answers for key in keys), STATUS_S)
        return dict(answers)

    def _status_of(self, rank: _Rank) -> msg.RankStatus | None:
        """``rank``'s counters (``None``: it did not answer within ``STATUS_S``)."""
        return self._status([rank.key]).get(rank.key)

    def _poll(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Check ``done()`` (which asks ranks for their counters) every 0.25 s until it
        holds or ``timeout_s`` passed; whether it held."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() >= deadline:
                return False
            self._wait(_never, 0.25)
        return True

    def _wait_idle(self) -> bool:
        """Ask every rank for its counters until nothing is held (bounded); keep the last."""

        def idle() -> bool:
            self.final = self._status(self.keys)
            complete = len(self.final) == len(self.keys)
            return complete and not any(answer.holds() for answer in self.final.values())

        return self._poll(idle, IDLE_S)

    def _drops(self) -> tuple[int, int]:
        sent = sum(s.control_sent for _, s in self.last_status.values())
        dropped = sum(s.control_dropped for _, s in self.last_status.values())
        return sent, dropped

    # ------------------------------------------------------------------ rooms

    def _unsettled(self) -> list[_Room]:
        return [room for room in self.rooms.values() if room.outcome is None]

    def _top_up(self) -> None:
        """Issue rooms until ``rooms_in_flight`` are unsettled, to every rank that answered
        ``peers`` and is alive (a rank that is down counts as lost; see the module).

        No room is issued while a rank that is ready has not answered its ``peers`` yet
        (up to ``PEERS_S``): the others know it already, and a room it does not get would
        stall on them.
        """
        if not self.issuing or self._answering_peers():
            return
        up = {key: r for key, r in self.ranks.items() if r.peered and not r.gone}
        if not up:
            return
        for _ in range(self.config.rooms_in_flight):  # bounded, even if each fails at once
            if len(self._unsettled()) >= self.config.rooms_in_flight or not self.free:
                break
            instance = self.next_instance
            self.next_instance = (instance + 1) % self.config.prefill_instances
            # every decode rank and the prefill ranks of the instance
            tp = self.config.prefill_tp
            keys = self._role_keys("decode") + [("prefill", instance * tp + r) for r in range(tp)]
            live = {key: rank for key, rank in up.items() if key in keys}
            index = self.free.pop(0)
            room = _Room(
                self.next_room,
                index,
                time.monotonic(),
                {key: rank.pid or 0 for key, rank in live.items()},
                lost=set(keys) - set(live),
            )
            self.next_room += 1
            self.rooms[room.room] = room
            for key in keys:  # decode first: it registers the room before prefill asks
                command = msg.OpenRoom(room.room, index, instance)
                if key in live and not self._send(live[key], command):
                    reason = "the room command could not be sent"
                    room.reports[key] = msg.RoomEnded(
                        room.room, index, "failed", time.monotonic(), reason
                    )
            self._maybe_settle(room)

    def _maybe_settle(self, room: _Room) -> None:
        if room.outcome is None and not room.waiting():
            self._settle(room)

    def _settle(self, room: _Room, *, hung: str | None = None) -> None:
        reports = room.reports
        corrupt = [
            f"room {room.room} (request {room.index}) on {key[0]} {key[1]}: "
            + "; ".join(report.problems or ["pages differ"])
            for key, report in sorted(reports.items())
            if report.state == "ok" and key[0] == "decode" and not report.verified
        ]
        stuck = [key for key, report in reports.items() if report.state == "hung"]
        if hung is not None:
            stuck += sorted(room.waiting())
        failures = [
            report.reason
            for key, report in sorted(reports.items(), key=lambda item: item[0][0] != "decode")
            if report.state == "failed"
        ]
        decode_done = all(
            key in reports and reports[key].state == "ok" for key in self._role_keys("decode")
        )
        room.settled_at = time.monotonic()
        if corrupt:
            room.outcome, room.reason = "corrupt", "\n".join(corrupt)
        elif stuck:
            room.outcome, room.reason = "hung", self._describe(room, hung or "no report")
        elif decode_done:  # the KV cache arrived and verified: the request goes on on decode
            room.outcome = "succeeded"
            room.prefill_failed = bool(failures or room.lost)
        elif failures:
            room.outcome, room.reason = "failed", failures[0]
        else:
            room.outcome, room.reason = "failed", "rank killed"
        if not room.waiting():  # every rank released it; else its pages may still change
            self.free.append(room.index)

    @staticmethod
    def _describe(room: _Room, missing: str) -> str:
        """Every rank's word on a room: ``room 7 (request 3): decode 0 ok; prefill 1 hung:
        still Transferring; ...`` (``missing`` for ranks that said nothing)."""
        parts = []
        for key in sorted(room.expected):
            report = room.reports.get(key)
            if report is None:
                state = "killed" if key in room.lost else missing
            else:
                state = report.state + (f": {report.reason}" if report.reason else "")
            parts.append(f"{key[0]} {key[1]} {state}")
        return f"room {room.room} (request {room.index}): " + "; ".join(parts)

    # ------------------------------------------------------------------ the result

    def _say(self, at: float, line: str) -> None:
        """Report ``line`` about a fault that began at ``at`` (``time.monotonic()``), stamped
        in seconds since the soak started, as its record's ``at_s``."""
        if self.progress is not None:
            self.progress(f"{at - self.start:6.1f} s  {line}")

    def _served(self, rank: _Rank | None) -> int:
        """Rooms ``rank``'s process took part in that succeeded."""
        if rank is None:
            return 0
        return sum(
            room.outcome == "succeeded" and room.expected.get(rank.key) == rank.pid
            for room in self.rooms.values()
        )

    def result(self) -> SoakResult:
        rooms = list(self.rooms.values())
        failed: Counter[str] = Counter()
        examples: dict[str, str] = {}
        for room in rooms:
            if room.outcome == "failed":
                group = "rank killed" if room.reason == "rank killed" else reason_group(room.reason)
                failed[group] += 1
                examples.setdefault(group, room.reason)
        final = self.final.values()
        sent, dropped = self._drops()
        return SoakResult(
            config=self.config,
            elapsed_s=self.ended - self.start,
            rooms_started=len(rooms),
            rooms_succeeded=sum(r.outcome == "succeeded" for r in rooms),
            rooms_prefill_failed=sum(r.prefill_failed for r in rooms),
            failed_by_reason=dict(failed.most_common()),
            failure_examples=examples,
            corrupt=sum(r.outcome == "corrupt" for r in rooms),
            corrupt_details=tuple(r.reason for r in rooms if r.outcome == "corrupt"),
            hung=sum(r.outcome == "hung" for r in rooms),
            hung_details=tuple(r.reason for r in rooms if r.outcome == "hung"),
            kills=tuple(
                dataclasses.replace(kill, served_after=self._served(new))
                for kill, new in self.kills
            ),
            stalls=tuple(self.stalls),
            floods=tuple(self.floods),
            forges=tuple(self.forges),
            unauthorized=sum(s.unauthorized for _, s in self.last_status.values()),
            faults_injected={name: self.injected[name] for name in self.config.faults},
            control_sent=sent,
            control_dropped=dropped,
            ring_live_bytes_end=sum(a.ring_live_bytes or 0 for a in final),
            ring_live_regions_end=sum(a.ring_live_count or 0 for a in final),
            fenced_rooms_end=sum(a.fenced_rooms or 0 for a in final),
            open_rooms_end=sum(a.open_rooms for a in final),
            idle_reached=self.idle,
            listener_restarts=len(self.listener_deaths),
            listener_errors=sum(a.listener_errors for a in final),
            unexpected_exits=tuple(self.unexpected),
            rank_errors=tuple(self.errors),
            memory=judge_memory(
                {pid: (*key, s.rss) for pid, (key, s) in self.last_status.items()},
                self.start,
                self.ended - self.start,
            ),
        )


_NO_STATUS: Final = msg.RankStatus(0, listener_alive=False)
"""What a rank that did not answer ``status`` counts as (every counter 0)."""


def _never() -> bool:
    return False
