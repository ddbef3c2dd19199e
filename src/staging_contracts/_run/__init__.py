"""The run layer: what the harness, the cluster commands and the benchmarks run ranks on.

:class:`Supervisor` is the one place rank processes start (spawned, watched, stopped within a
bound, respawned, each process's own traceback kept for the parent's message);
:func:`stop_on_signals` turns ``SIGTERM`` and ``SIGINT`` into a :class:`StopRequest` the
driver passes on to its ranks, so that a stopped run still gives what it measured, marked
partial, and exits with :func:`exit_status`. What a rank process and its driver say to each
other are typed messages on one codec (:mod:`~staging_contracts._run._codec`).

May import: ``backends`` and everything below it; never ``testing``, ``_cluster``, ``_bench`` or
``cli``.
Imported by: ``testing``, ``_cluster``, ``_bench`` and ``cli``.
"""

from __future__ import annotations

from ._signals import INTERRUPT_GRACE_S, Interrupted, StopRequest, exit_status, stop_on_signals
from ._supervisor import LIMIT_CHARS, Supervisor

__all__ = [
    "INTERRUPT_GRACE_S",
    "LIMIT_CHARS",
    "Interrupted",
    "StopRequest",
    "Supervisor",
    "exit_status",
    "stop_on_signals",
]
