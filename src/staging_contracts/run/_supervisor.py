"""A spawned process's own error, for the message its parent gives when the process died.

A rank process reports its failures itself (over its pipe or socket), but one that dies
before it can, or from an exception its entry point let through, used to leave the parent
with "exited with code 1 without a word". :class:`ChildErrors` starts each process through
:func:`run_reporting`, which marks in a file of its own that the entry point was reached and,
should the entry point raise, writes the traceback there (its last :data:`LIMIT_CHARS`
characters: the end, where the exception is) before the exception goes on as usual. The
parent then says what happened with :meth:`ChildErrors.explain`: the traceback; that the
process died before its entry point ran (spawn re-imports the parent's main module and
unpickles the entry point and its arguments first: a script that starts ranks at its top
level without ``if __name__ == "__main__":`` dies there); or that it ended without a word
(a signal, ``os._exit``).

Domain-free: it knows nothing of ranks or staging.

**Threads:** any; each method touches only its own process's file.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Final

__all__ = ["LIMIT_CHARS", "ChildErrors", "run_reporting"]

logger = logging.getLogger(__name__)

LIMIT_CHARS: Final = 8000
"""The most of a traceback kept: its last characters (the exception is at the end)."""

_CUT: Final = "... (the traceback's start is cut)\n"


def run_reporting(path: str, target: Callable[..., object], args: tuple[Any, ...]) -> None:
    """The spawned process's entry point: ``target(*args)``, its traceback kept at ``path``.

    **Called by:** :meth:`ChildErrors.process`, in the new process.

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


class ChildErrors:
    """Processes started so that their own error reaches the parent's message.

    **Called by:** the code that spawns rank processes (the harness's rank group, the cluster
    runner, the soak).
    """

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="staging-contracts-children-"))
        self._paths: dict[int, Path] = {}
        self._count = 0
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)

    def process(
        self,
        context: SpawnContext,
        target: Callable[..., object],
        args: tuple[Any, ...],
        *,
        name: str,
        daemon: bool = True,
    ) -> BaseProcess:
        """A process (not started) of ``context`` that runs ``target(*args)`` through
        :func:`run_reporting`."""
        self._count += 1
        path = self._dir / f"{self._count}.txt"
        process = context.Process(
            target=run_reporting, args=(str(path), target, args), name=name, daemon=daemon
        )
        self._paths[id(process)] = path
        return process

    def traceback(self, process: BaseProcess) -> str | None:
        """The traceback ``process``'s entry point raised, bounded; ``None`` if none."""
        path = self._paths.get(id(process))
        try:
            text = path.read_text(encoding="utf-8") if path is not None else ""
        except OSError:
            return None
        return text.rstrip() or None

    def explain(self, process: BaseProcess, exitcode: int | None) -> str:
        """How ``process`` (ended, with ``exitcode``) died, in words, its traceback included."""
        how = f"exited with code {exitcode}"  # -N: signal N
        path = self._paths.get(id(process))
        if path is not None and not path.exists():
            return (
                f"{how} before its entry point ran: the new process failed while importing the"
                " parent's main module or unpickling its entry point and arguments (a script"
                ' that starts ranks needs `if __name__ == "__main__":` around that code);'
                " its own error went to its stderr"
            )
        text = self.traceback(process)
        if text is None:
            return f"{how} without a word"
        return f"{how}, raising:\n{text}"

    def close(self) -> None:
        """Remove the processes' files; safe to call twice."""
        self._cleanup()
