"""The one place rank processes start: spawned, watched, ended within a bound, respawned.

:class:`Supervisor` starts each process (``multiprocessing`` spawn, so nothing of the
parent's threads or sockets is inherited) through :func:`run_reporting`, which marks in a
file of the process's own that its entry point was reached and, should the entry point
raise, writes the traceback there (its last :data:`LIMIT_CHARS` characters: the end, where
the exception is) before the exception goes on as usual. :meth:`Supervisor.explain` then says
how a process died: the traceback; that it died before its entry point ran (spawn re-imports
the parent's main module and unpickles the entry point and its arguments first: a script that
starts ranks at its top level without ``if __name__ == "__main__":`` dies there); or that it
ended without a word (a signal, ``os._exit``).

Processes are kept under a key of the caller's (``(role, rank)``, an index); starting a key
again is a respawn. :meth:`Supervisor.ended` watches them, :meth:`Supervisor.terminate` asks
them to stop (``SIGTERM``), :meth:`Supervisor.close` ends them all within a bound (a wait,
then ``SIGKILL``). Domain-free: it knows nothing of ranks or staging.

**Threads:** one, the caller's; :func:`run_reporting` runs in the new process.
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import signal
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

logger = logging.getLogger(__name__)

LIMIT_CHARS: Final = 8000
"""The most of a traceback kept: its last characters (the exception is at the end)."""
KILL_WAIT_S: Final = 5.0
"""Longest :meth:`Supervisor.close` waits for the processes it killed to be gone."""

_CUT: Final = "... (the traceback's start is cut)\n"

K = TypeVar("K", bound=Hashable)


def run_reporting(path: str, target: Callable[..., object], args: tuple[Any, ...]) -> None:
    """The spawned process's entry point: ``target(*args)``, its traceback kept at ``path``.

    **Called by:** :meth:`Supervisor.start`, in the new process.

    Raises:
        BaseException: whatever ``target`` raised, after its traceback was written.
    """
    record = Path(path)
    record.write_text("", encoding="utf-8")  # the entry point was reached
    try:
        target(*args)
    except BaseException:
        text = traceback.format_exc()
        if len(text) > LIMIT_CHARS:
            text = _CUT + text[-LIMIT_CHARS:]
        try:
            record.write_text(text, encoding="utf-8")
        except OSError:
            logger.exception("could not keep this process's traceback for its parent")
        raise


@contextmanager
def _children_ignore_sigint() -> Iterator[None]:
    """Processes started in the block ignore ``SIGINT`` from their first instruction on.

    A terminal's Ctrl-C reaches every process of its group; a rank that took it would die
    with a ``KeyboardInterrupt`` traceback (while its modules load, as often as not) instead
    of letting its driver stop it with ``SIGTERM``. An ignored signal stays ignored across the
    spawn's ``exec`` (and Python keeps it so), so the parent ignores ``SIGINT`` for the few
    milliseconds a start takes: a Ctrl-C landing in them is lost (press it again). A signal
    mask would not keep it: another thread of the parent may take it, and drop it as ignored.
    Off the main thread, or under a handler not set from Python, nothing is changed.
    """
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Supervisor(Generic[K]):
    """The rank processes of one run, each under its key, each able to say how it died.

    **Called by:** the harness's rank group, the cluster runner and the soak.
    """

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("spawn")
        self._dir = Path(tempfile.mkdtemp(prefix="staging-contracts-children-"))
        self._records: dict[int, Path] = {}
        self._started: list[BaseProcess] = []
        self.current: dict[K, BaseProcess] = {}
        """Each key's latest process."""
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)

    def pipe(self) -> tuple[Connection, Connection]:
        """A duplex pipe: one end for this side, the other for a process to be started."""
        return self._context.Pipe(duplex=True)

    def start(
        self, key: K, target: Callable[..., object], args: tuple[Any, ...], *, name: str
    ) -> BaseProcess:
        """Start ``target(*args)`` (module-level, picklable) in a new daemon process, as
        ``key``'s; a process ``key`` had before is still ended by :meth:`close`."""
        record = self._dir / f"{len(self._records)}.txt"
        process = self._context.Process(
            target=run_reporting, args=(str(record), target, args), name=name, daemon=True
        )
        with _children_ignore_sigint():
            process.start()  # first: an unstarted process cannot be joined
        self._records[id(process)] = record
        self._started.append(process)
        self.current[key] = process
        return process

    def __getitem__(self, key: K) -> BaseProcess:
        return self.current[key]

    def ended(self) -> list[K]:
        """The keys whose latest process has ended."""
        return [key for key, process in self.current.items() if not process.is_alive()]

    def terminate(self, keys: Iterable[K]) -> list[K]:
        """Send ``SIGTERM`` to the latest process of each of ``keys`` still alive; those keys."""
        alive = [key for key in keys if self.current[key].is_alive()]
        for key in alive:
            self.current[key].terminate()
        return alive

    def kill(self) -> list[K]:
        """Send ``SIGKILL`` to every process still alive; the keys of those that were latest."""
        killed = [key for key, process in self.current.items() if process.is_alive()]
        for process in self._started:
            if process.is_alive():
                logger.warning("%s did not exit; killing it", process.name)
                process.kill()
        return killed

    def explain(self, process: BaseProcess) -> str:
        """How ``process`` (ended) died, in words, the traceback its entry point raised
        (bounded) included; before :meth:`close`."""
        how = f"exited with code {process.exitcode}"  # -N: signal N
        path = self._records.get(id(process))
        if path is not None and not path.exists():
            return (
                f"{how} before its entry point ran: the new process failed while importing the"
                " parent's main module or unpickling its entry point and arguments (a script"
                ' that starts ranks needs `if __name__ == "__main__":` around that code);'
                " its own error went to its stderr"
            )
        try:
            text = path.read_text(encoding="utf-8").rstrip() if path is not None else ""
        except OSError:
            text = ""
        return f"{how}, raising:\n{text}" if text else f"{how} without a word"

    def close(self, grace_s: float = 0.0) -> None:
        """End every process started: wait up to ``grace_s`` for them to exit, then kill the
        rest (:meth:`kill`); remove the processes' files. Safe to call twice; exit codes stay
        readable.

        **Blocking:** at most ``grace_s`` plus :data:`KILL_WAIT_S`.
        """
        self._join(grace_s)
        self.kill()
        self._join(KILL_WAIT_S)
        for process in self._started:
            if process.is_alive():
                logger.warning("process %s (pid %s) did not end", process.name, process.pid)
        self._cleanup()

    def _join(self, bound_s: float) -> None:
        """Wait for every process to exit, at most ``bound_s`` in all."""
        deadline = time.monotonic() + bound_s
        for process in self._started:
            process.join(max(0.0, deadline - time.monotonic()))
