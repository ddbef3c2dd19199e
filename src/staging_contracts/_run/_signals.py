"""Stop a driver on ``SIGTERM`` or ``SIGINT`` and still give what it measured, marked partial.

By default either signal ends the Python driver at once: ``SIGTERM`` without unwinding (its
rank processes are left running), ``SIGINT`` wherever it lands. :func:`stop_on_signals`
replaces both handlers for the length of a run: the first signal is recorded on the
:class:`StopRequest` (and, when asked, raised as :class:`Interrupted` at that point), so the
driver tells its ranks to stop, gives them :data:`INTERRUPT_GRACE_S` to report, kills what is
left and returns a result marked partial. The command then exits with
:func:`exit_status` (``128 + N``: 130 for ``SIGINT``, 143 for ``SIGTERM``).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Final

STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a run."""
INTERRUPT_GRACE_S: Final = 2.0
"""How long ranks told to stop by an interrupted driver have to report and exit before they
are killed (the whole stop stays well under 5 s)."""


class Interrupted(BaseException):
    """Raised where a stop signal landed, when :func:`stop_on_signals` was asked to raise.

    A ``BaseException``, so the driver's ``except Exception`` handlers let it through.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class StopRequest:
    """The first stop signal a run received, if any.

    **Threads:** set by the signal handler on the main thread; read by the driver.
    """

    signum: int | None = None

    @property
    def name(self) -> str | None:
        """The signal's name (``"SIGTERM"``), or ``None`` while none came."""
        return None if self.signum is None else signal.Signals(self.signum).name


def exit_status(name: str) -> int:
    """The conventional exit status of a command a signal stopped: ``128 + N``.

    Args:
        name: the signal's name, as :attr:`StopRequest.name` gives it.
    """
    return 128 + int(signal.Signals[name])


@dataclass
class _Blocks:
    """The process's open :func:`stop_on_signals` blocks (signal handlers are process-wide).

    **Threads:** the main thread only (handlers run there, blocks open there)."""

    depth: int = 0
    signum: int | None = None
    """The first stop signal any open block took: further ones are ignored (the stop is
    already bounded), so that a second signal cannot cut short the summary being written."""
    nested: bool = False
    """A block opened inside the outermost one (a driver's run in the command's): once it
    has, the outermost block no longer raises, so that a run's output is written whole."""


_BLOCKS = _Blocks()


@contextmanager
def stop_on_signals(*, raise_on_signal: bool) -> Iterator[StopRequest]:
    """Record ``SIGTERM`` and ``SIGINT`` instead of dying for the length of the block.

    Off the main thread (where Python cannot set handlers), or where a stop signal's handler
    was not set from Python (it could not be put back), the request never fires. Blocks
    nest (the command line opens one around the whole command, a driver one around its run):
    the innermost block takes the first signal; later signals, in it or in any enclosing
    block until the outermost one ends, are ignored: the stop is already bounded. Once a
    block was opened inside the outermost one, the outermost ignores signals too: the run has
    ended, and the command writes what it measured. The handlers come back when the block
    ends, whatever lands meanwhile.

    Args:
        raise_on_signal: also raise :class:`Interrupted` where the first signal lands (for a
            driver whose waits do not all look at the request).

    **Called by:** the command line, around a whole command; the demo and soak drivers and
    the benchmarks, around one run (the cluster runner tells its ranks to stop with
    ``SIGTERM`` once the request records a signal).
    """
    request = StopRequest()
    main = threading.current_thread() is threading.main_thread()
    if not main or any(signal.getsignal(signum) is None for signum in STOP_SIGNALS):
        yield request
        return
    outermost = _BLOCKS.depth == 0
    _BLOCKS.nested = _BLOCKS.nested or not outermost
    closing = False

    def handle(signum: int, _frame: FrameType | None) -> None:
        if closing or _BLOCKS.signum is not None or (outermost and _BLOCKS.nested):
            return
        _BLOCKS.signum = request.signum = signum
        if raise_on_signal:
            raise Interrupted(signum)

    previous: dict[signal.Signals, signal._HANDLER] = {}
    _BLOCKS.depth += 1
    try:
        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, handle)
        yield request
    finally:
        closing = True  # a signal landing from here on cannot raise halfway through
        try:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        finally:
            _BLOCKS.depth -= 1
            if _BLOCKS.depth == 0:
                _BLOCKS.signum, _BLOCKS.nested = None, False
