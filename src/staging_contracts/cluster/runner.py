"""Run a staged transfer across real processes: P prefill ranks and D decode ranks.

:func:`run_cluster` starts a bootstrap server, spawns one OS process per rank
(:mod:`staging_contracts.cluster.rank`), follows their progress over ZMQ and gathers their
reports into a :class:`ClusterResult`. The demo, the transfer benchmark and the multi-process
tests all go through it.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from .bootstrap import BootstrapServer
from .rank import rank_main
from .workload import TransferConfig

__all__ = ["ClusterResult", "RankReport", "run_cluster"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankReport:
    """What one rank reported at the end of the run."""

    role: str
    rank: int
    ok: bool
    """The rank ran to the end without an exception."""
    fields: dict[str, Any]
    """The rank's summary (see ``cluster_rank``), or ``error`` and ``trace``."""
    exitcode: int | None
    """The process's exit status (0 when it exited by itself)."""


@dataclass(frozen=True, slots=True)
class ClusterResult:
    """The outcome of :func:`run_cluster`."""

    config: TransferConfig
    reports: tuple[RankReport, ...]
    elapsed_s: float
    """From the first prefill rank starting its requests to the last decode rank finishing."""
    failed_requests: frozenset[int] = field(default_factory=frozenset)
    """Request indexes some rank reported failed."""

    def ranks(self, role: str) -> list[RankReport]:
        """The reports of one side, by rank."""
        return sorted((r for r in self.reports if r.role == role), key=lambda r: r.rank)

    @property
    def all_ok(self) -> bool:
        """Every rank ran to the end and exited 0."""
        return all(r.ok and r.exitcode == 0 for r in self.reports)

    @property
    def verified(self) -> bool:
        """Every request succeeded and every decode page holds exactly the expected heads."""
        return (
            self.all_ok
            and not self.failed_requests
            and all(bool(r.fields.get("verified")) for r in self.ranks("decode"))
        )

    @property
    def bytes_moved(self) -> int:
        """Payload bytes the prefill ranks wrote into decode rings."""
        return sum(int(r.fields.get("bytes_written", 0)) for r in self.ranks("prefill"))

    @property
    def gbps(self) -> float:
        """Payload bandwidth of the transfer phase, GB/s."""
        return self.bytes_moved / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0

    def total(self, role: str, key: str) -> int:
        """Sum of an integer field over one side's reports."""
        return sum(int(r.fields.get(key, 0)) for r in self.ranks(role))


ProgressCallback = Callable[[str, dict[str, Any]], None]
"""Called on the driver's thread with each event kind (``ready``, ``room``) and its fields."""


def run_cluster(
    config: TransferConfig,
    *,
    progress: ProgressCallback | None = None,
    timeout_s: float = 300.0,
) -> ClusterResult:
    """Run every request of ``config`` through P + D rank processes and gather the reports.

    **Blocking:** until every rank reported and exited, or ``timeout_s`` passed (stragglers
    are killed and reported as failed).

    Raises:
        ImportError: the configured backend's engine cannot be imported.
    """
    from ..backends import load_backend  # noqa: PLC0415 - fail fast, before spawning

    load_backend(config.backend)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.bind("tcp://127.0.0.1:*")
    raw_endpoint = inbox.getsockopt(zmq.LAST_ENDPOINT)
    report_to = raw_endpoint.decode() if isinstance(raw_endpoint, bytes) else str(raw_endpoint)
    server = BootstrapServer()
    server.start()
    spawn = multiprocessing.get_context("spawn")
    roles = [("decode", d) for d in range(config.decode_tp)] + [
        ("prefill", p) for p in range(config.prefill_tp)
    ]
    processes = {
        key: spawn.Process(
            target=rank_main,
            args=(key[0], key[1], config, server.endpoint, report_to),
            name=f"staging-{key[0]}-{key[1]}",
            daemon=True,
        )
        for key in roles
    }
    reports: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        for process in processes.values():
            process.start()
        deadline = time.monotonic() + timeout_s
        while len(reports) < len(processes) and time.monotonic() < deadline:
            if not inbox.poll(100):
                if any(not p.is_alive() and key not in reports for key, p in processes.items()):
                    time.sleep(0.2)  # a final report may still be in flight
                    if not inbox.poll(0):
                        break
                continue
            event = json.loads(inbox.recv())
            key = (str(event.get("role")), int(event.get("rank", -1)))
            kind = str(event.get("kind"))
            if kind == "report":
                reports[key] = event
            elif progress is not None:
                progress(kind, event)
    finally:
        exitcodes = _join(processes)
        server.stop()
        inbox.close(linger=0)
    return _result(config, roles, reports, exitcodes)


def _join(processes: dict[tuple[str, int], Any]) -> dict[tuple[str, int], int | None]:
    codes: dict[tuple[str, int], int | None] = {}
    for key, process in processes.items():
        if process.pid is None:  # never started
            codes[key] = None
            continue
        process.join(30)
        if process.is_alive():
            logger.warning("%s did not exit; killing it", process.name)
            process.kill()
            process.join(5)
        codes[key] = process.exitcode
    return codes


def _result(
    config: TransferConfig,
    roles: list[tuple[str, int]],
    reports: dict[tuple[str, int], dict[str, Any]],
    exitcodes: dict[tuple[str, int], int | None],
) -> ClusterResult:
    out: list[RankReport] = []
    failed: set[int] = set()
    for key in roles:
        fields = reports.get(key, {"error": "no report (the process died or timed out)"})
        out.append(RankReport(key[0], key[1], bool(fields.get("ok")), fields, exitcodes.get(key)))
        failed.update(int(i) for i in fields.get("failed", {}))
    starts = [float(r.fields["start"]) for r in out if r.role == "prefill" and "start" in r.fields]
    ends = [float(r.fields["end"]) for r in out if r.role == "decode" and "end" in r.fields]
    elapsed = max(ends) - min(starts) if starts and ends else 0.0
    return ClusterResult(config, tuple(out), elapsed, frozenset(failed))
