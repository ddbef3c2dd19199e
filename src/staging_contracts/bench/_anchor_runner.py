"""The parent side of an engine-anchor measurement: start, watch and reap the two children.

:func:`run_pair` starts :func:`~._anchor_peers.receiver_main` and
:func:`~._anchor_peers.writer_main` in ``spawn`` processes joined by a pipe (which carries
the receiver's session, metadata and address to the writer, then the writer's ``"stop"``),
waits for both reports, then joins both; a child that fails, dies or overruns is reported
as a :class:`RuntimeError` with its reason, and every child left alive is killed.
:func:`run_local` runs both sides in this process over two ``LocalEngine`` objects.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Final

from . import _anchor_peers as peers
from ._anchor_peers import AnchorJob

__all__ = ["run_local", "run_pair"]

logger = logging.getLogger(__name__)

_START_GRACE_S: Final = 60.0
"""Added to a job's timeout for the children to start (spawn, torch import) and close."""


def run_local(job: AnchorJob) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both sides in this process over two ``LocalEngine`` objects."""
    deadline = time.monotonic() + job.timeout_s
    source_engine, target_engine = peers.make_engine(job), peers.make_engine(job)
    try:
        target = peers.prepare_receiver(job, target_engine)
        source = peers.make_source(job)
        source_engine.register(source.data_ptr(), source.numel())
        source_engine.add_peer(target_engine.session_id, target_engine.metadata())
        writes = peers.plan_writes(job, source.data_ptr(), target.data_ptr())
        samples = peers.time_writes(job, source_engine, target_engine.session_id, writes, deadline)
        verified = peers.check_target(job, target) if job.verify else None
    finally:
        source_engine.close()
        target_engine.close()
    return peers.writer_report(samples, writes), {"verified": verified}


def run_pair(job: AnchorJob) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start the receiver and the writer, collect both reports, join both processes.

    Raises:
        RuntimeError: a child reported an error, died without a report, did not report in
            time, or did not exit with code 0 (every child left alive is killed first).
    """
    context = multiprocessing.get_context("spawn")
    receiver_end, writer_end = context.Pipe()
    started: dict[str, tuple[BaseProcess, Connection]] = {}
    try:
        for role, target, end in (
            ("receiver", peers.receiver_main, receiver_end),
            ("writer", peers.writer_main, writer_end),
        ):
            report, sink = context.Pipe(duplex=False)
            process = context.Process(
                target=target, args=(job, end, sink), name=f"anchor-{job.engine}-{role}"
            )
            process.start()
            sink.close()  # the child holds the only write end: EOF if it dies
            started[role] = (process, report)
        receiver_end.close()  # only the children hold the peer pipe: EOF if one dies
        writer_end.close()
        reports = _collect(job, started)
        for role, (child, _) in started.items():
            child.join(_START_GRACE_S)
            if child.exitcode != 0:
                raise RuntimeError(
                    f"{job.kind} anchor over {job.engine}: the {role} exited with code"
                    f" {child.exitcode}"
                )
        return reports["writer"], reports["receiver"]
    finally:
        receiver_end.close()
        writer_end.close()
        for child, report in started.values():
            report.close()
            if child.is_alive():
                logger.warning("killing anchor child %s", child.name)
                child.kill()
                child.join(10.0)


def _collect(
    job: AnchorJob, started: Mapping[str, tuple[BaseProcess, Connection]]
) -> dict[str, dict[str, Any]]:
    """Wait for each child's report; the first failure raises (the caller kills the rest)."""
    deadline = time.monotonic() + job.timeout_s + _START_GRACE_S
    what = f"{job.kind} anchor over {job.engine}"
    reports: dict[str, dict[str, Any]] = {}
    while len(reports) < len(started):
        pending = {role: report for role, (_, report) in started.items() if role not in reports}
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not wait(list(pending.values()), remaining):
            raise RuntimeError(f"{what}: no report from the {', '.join(pending)} in time")
        for role, report in pending.items():
            if not report.poll():
                continue
            try:
                status, value = report.recv()
            except EOFError:
                dead = started[role][0]
                dead.join(5.0)
                code = dead.exitcode
                raise RuntimeError(
                    f"{what}: the {role} died without a report (exit code {code})"
                ) from None
            if status != "ok":
                raise RuntimeError(f"{what}: the {role} failed:\n{value}")
            reports[role] = value
    return reports
