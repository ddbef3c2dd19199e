"""Counters of the staging message handling, and the frozen snapshot hosts read them as."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, fields
from typing import Final

__all__ = [
    "LATENCY_BUCKETS_S",
    "RoomTally",
    "RoomTallySnapshot",
    "StagingCounters",
    "StagingStats",
]

LATENCY_BUCKETS_S: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Upper bounds (seconds) of the room latency histogram's buckets (a last one is +Inf)."""


@dataclass(frozen=True, slots=True)
class StagingStats:
    """A snapshot of one host's staging counters (see ``StagingManagerMixin.staging_stats``)."""

    received: int = 0
    """Staging messages handed to the mixin (all types, well-formed or not)."""
    malformed: int = 0
    """Messages rejected by the codec with ``MalformedMessage``."""
    dropped: int = 0
    """Well-formed messages dropped: no handler attached yet, unknown room or chunk."""
    allocated: int = 0
    """STAGING_REQs that assigned a new ring region (decode)."""
    oversized: int = 0
    """STAGING_REQs answered with offset -2: the chunk can never fit the ring (decode)."""
    rejected: int = 0
    """STAGING_REQs or arrivals refused: consumed chunk, beyond the room, geometry mismatch."""
    arrivals: int = 0
    """Writer arrivals counted (decode), duplicates excluded."""
    responses: int = 0
    """STAGING_RSPs recorded (prefill)."""
    watermarks: int = 0
    """WATERMARKs that moved a session's watermark forward (prefill)."""
    deferred: int = 0
    """STAGING_REQs left unanswered for now: the prefill instance held its ring share (decode)."""


class StagingCounters:
    """Mutable counters behind :class:`StagingStats`.

    **Thread-safety:** increments and snapshots may come from any thread.
    """

    __slots__ = ("_lock", "_values")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys((f.name for f in fields(StagingStats)), 0)

    def add(self, name: str, amount: int = 1) -> None:
        """Increase one counter.

        Raises:
            KeyError: ``name`` is not a field of :class:`StagingStats`.
        """
        with self._lock:
            if name not in self._values:
                raise KeyError(name)
            self._values[name] += amount

    def snapshot(self) -> StagingStats:
        """The current values as a frozen record."""
        with self._lock:
            return StagingStats(**self._values)


@dataclass(frozen=True, slots=True)
class RoomTallySnapshot:
    """Rooms ended on one rank so far, and the latencies of those that succeeded."""

    ended: tuple[tuple[str, str, int], ...] = ()
    """``(outcome, reason, count)`` per pair seen; ``reason`` is ``""`` for a success."""
    latency_buckets: tuple[int, ...] = (0,) * (len(LATENCY_BUCKETS_S) + 1)
    """Successes per latency bucket (not cumulative), by :data:`LATENCY_BUCKETS_S`, then +Inf."""
    latency_sum_s: float = 0.0
    latency_count: int = 0


class RoomTally:
    """How rooms ended (outcome and reason) and how long the successful ones took.

    **Thread-safety:** none of its own: its owner calls :meth:`ended` and :meth:`snapshot`
    under the lock it already holds when a room's state changes (one call per room, never per
    message).
    """

    __slots__ = ("_buckets", "_count", "_ended", "_sum")

    def __init__(self) -> None:
        self._ended: dict[tuple[str, str], int] = {}
        self._buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self._sum = 0.0
        self._count = 0

    def ended(self, outcome: str, reason: str = "", latency_s: float | None = None) -> None:
        """Count one room's end; ``latency_s`` (a success's) goes into the histogram."""
        key = (str(outcome), str(reason))
        self._ended[key] = self._ended.get(key, 0) + 1
        if latency_s is not None:
            self._buckets[bisect.bisect_left(LATENCY_BUCKETS_S, latency_s)] += 1
            self._sum += latency_s
            self._count += 1

    def snapshot(self) -> RoomTallySnapshot:
        """The current values (call under the owner's lock)."""
        return RoomTallySnapshot(
            tuple((o, r, n) for (o, r), n in sorted(self._ended.items())),
            tuple(self._buckets),
            self._sum,
            self._count,
        )
