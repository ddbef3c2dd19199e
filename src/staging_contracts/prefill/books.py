"""Prefill-side books of what decode announced: watermarks and ring regions.

Both are written by the prefill listener thread (``WATERMARK`` and ``STAGING_RSP``
messages, through the mixin) and read by transfer workers, which may wait on them with a
bound. They implement :class:`~staging_contracts.protocols.WatermarkBook` and
:class:`~staging_contracts.protocols.RegionBook`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..protocols import RegionAnswer, Watermark
from ..staging.allocator import is_watermark_ready

__all__ = ["RegionAnswerTable", "WatermarkTracker"]

_ZERO: Watermark = Watermark(0, 0)


class WatermarkTracker:
    """The newest watermark of each decode session, moving forward only.

    **Side:** prefill. **Thread-safety:** any thread may observe, read or wait.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._latest: dict[str, Watermark] = {}
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on the observing thread, without the lock) when a watermark
        moves forward."""
        self._listeners.append(listener)

    def observe(self, session_id: str, watermark: Watermark) -> bool:
        """Record a watermark if it is newer (lexicographically) than the session's latest.

        Returns:
            ``True`` if the session's watermark moved forward (waiters are woken).
        """
        with self._cond:
            if watermark <= self._latest.get(session_id, _ZERO):
                return False
            self._latest[session_id] = Watermark(*watermark)
            self._cond.notify_all()
        for listener in self._listeners:
            listener()
        return True

    def latest(self, session_id: str) -> Watermark:
        """The newest watermark of a session (``Watermark(0, 0)`` before any)."""
        with self._cond:
            return self._latest.get(session_id, _ZERO)

    def is_ready(self, session_id: str, alloc_round: int, alloc_end: int) -> bool:
        """May a region of ``alloc_round`` ending at ``alloc_end`` be written now?"""
        return is_watermark_ready(self.latest(session_id), alloc_round, alloc_end)

    def wait_ready(self, session_id: str, alloc_round: int, alloc_end: int, timeout: float) -> bool:
        """Block until the region is writable or ``timeout`` seconds pass.

        **Blocking:** up to ``timeout``. Returns whether the region is writable.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                current = self._latest.get(session_id, _ZERO)
                if is_watermark_ready(current, alloc_round, alloc_end):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)

    def forget(self, session_id: str) -> None:
        """Drop a session (its decode went away)."""
        with self._cond:
            self._latest.pop(session_id, None)


class RegionAnswerTable:
    """Regions decode announced, per (room, chunk, decode session); the latest answer wins.

    **Side:** prefill. **Thread-safety:** any thread may record, read or wait.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._answers: dict[tuple[int, int, str], RegionAnswer] = {}
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on the recording thread, without the lock) after each answer."""
        self._listeners.append(listener)

    def record(self, room: int, chunk_idx: int, session_id: str, answer: RegionAnswer) -> None:
        """Store an answer and wake waiters."""
        with self._cond:
            self._answers[(room, chunk_idx, session_id)] = answer
            self._cond.notify_all()
        for listener in self._listeners:
            listener()

    def get(self, room: int, chunk_idx: int, session_id: str) -> RegionAnswer | None:
        """The answer for a chunk, or ``None`` before one arrived."""
        with self._cond:
            return self._answers.get((room, chunk_idx, session_id))

    def wait(
        self, room: int, chunk_idx: int, session_id: str, timeout: float
    ) -> RegionAnswer | None:
        """Block until an answer for the chunk exists or ``timeout`` seconds pass."""
        key = (room, chunk_idx, session_id)
        deadline = time.monotonic() + timeout
        with self._cond:
            while (answer := self._answers.get(key)) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return answer

    def discard(self, room: int, chunk_idx: int, session_id: str) -> None:
        """Forget one chunk's answer (before re-requesting it)."""
        with self._cond:
            self._answers.pop((room, chunk_idx, session_id), None)

    def forget_room(self, room: int) -> None:
        """Drop every answer of a room (done or failed)."""
        with self._cond:
            for key in [k for k in self._answers if k[0] == room]:
                del self._answers[key]

    def __len__(self) -> int:
        with self._cond:
            return len(self._answers)
