"""Counters of the staging message handling, and the frozen snapshot hosts read them as."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

__all__ = ["StagingCounters", "StagingStats"]


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
