"""The soak's heartbeat: a progress line at least every :data:`TICK_EVERY_S` seconds.

Between faults a soak may run a long while without a word; an operator watching it (or a
supervisor reading its stderr) needs to see that it lives and how it goes. The driver asks
:class:`Ticker` on each turn of its loop whether a line is due, and :func:`tally_line` writes
it from the rooms' outcomes so far: ``"progress: 40 rooms started, 35 ok, 3 failed, 0 corrupt,
0 hung, 2 in flight"``, stamped like every progress line with the seconds since the soak
started.

**Threads:** a :class:`Ticker` belongs to one thread: the driver's loop, or a soak rank's
main loop (its status reports).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Final

TICK_EVERY_S: Final = 10.0
"""The longest the soak goes without a progress line while it runs."""


class Ticker:
    """Says when the next progress line is due (or, in a soak rank, its next ``metrics``
    event).

    Args:
        start: the soak's start (``time.monotonic()``; ``-inf``: the first is due at once).
        every_s: the longest gap between two lines (:data:`TICK_EVERY_S`).

    Raises:
        ValueError: ``every_s`` is not positive.
    """

    def __init__(self, start: float, every_s: float = TICK_EVERY_S) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s={every_s!r} must be > 0")
        self._every_s = every_s
        self._last = start

    def due(self, now: float) -> bool:
        """Whether a line is due at ``now``; when it is, the next one is due ``every_s``
        later (a line is never skipped, nor two given for one gap)."""
        if now - self._last < self._every_s:
            return False
        self._last = now
        return True


def tally_line(outcomes: Iterable[str | None]) -> str:
    """The progress line for rooms whose outcomes are ``outcomes`` (``None``: not settled
    yet; else ``succeeded``, ``failed``, ``corrupt`` or ``hung``)."""
    counts = Counter(outcomes)
    started = sum(counts.values())
    return (
        f"progress: {started} rooms started, {counts['succeeded']} ok, {counts['failed']} "
        f"failed, {counts['corrupt']} corrupt, {counts['hung']} hung, {counts[None]} in flight"
    )
