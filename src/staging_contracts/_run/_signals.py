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


_UNDER_WAY = StopRequest()
"""The first stop signal of the outermost block still open: while it is set, every block's
handler ignores further signals (the stop is already bounded), so that a second signal cannot
cut short the summary an enclosing block is writing."""
_depth = 0


@contextmanager
def stop_on_signals(*, raise_on_signal: bool) -> Iterator[StopRequest]:
    """Record ``SIGTERM`` and ``SIGINT`` instead of dying for the length of the block.

    Off the main thread (where Python cannot set handlers) the request never fires. Blocks
    nest (the command line opens one around the whole command, a driver one around its run):
    the innermost block takes the first signal; later signals, in it or in any enclosing
    block until the outermost one ends, are ignored: the stop is already bounded.

    Args:
        raise_on_signal: also raise :class:`Interrupted` where the first signal lands (for a
            driver whose waits do not all look at the request).

    **Called by:** the command line, around a whole command; the demo and soak drivers and
    the benchmarks, around one run (the cluster runner tells its ranks to stop with
    ``SIGTERM`` once the request records a signal).
    """
    global _depth  # noqa: PLW0603 - signal handlers are process-wide
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handle(signum: int, _frame: FrameType | None) -> None:
        if _UNDER_WAY.signum is not None:
            return
        _UNDER_WAY.signum = request.signum = signum
        if raise_on_signal:
            raise Interrupted(signum)

    previous = {signum: signal.signal(signum, handle) for signum in STOP_SIGNALS}
    _depth += 1
    try:
        yield request
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _depth -= 1
        if _depth == 0:
            _UNDER_WAY.signum = None
