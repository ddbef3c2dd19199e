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

from .._staging.allocator import is_watermark_ready
from ..protocols import RegionAnswer, Watermark

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

    **Gated** (``gated=True``, what :func:`~staging_contracts.backends._staging_setup.
    enable_prefill_staging` builds): an answer is kept only for a chunk that the writer asked
    for in the room's current opening (:meth:`expect`, called before each ``STAGING_REQ``
    goes out) and that was not forgotten since (:meth:`forget_room`, at the room's close).
    Every other answer (one arriving after its room closed, for a room never asked, or a
    flood) is dropped, so the table holds at most one answer per chunk asked for by an open
    room, and a room id opened again never sees an answer of its earlier opening: that
    opening's answers were all sent before decode registered the room again, so they arrive
    (in order, on the one socket from that decode rank) before any ``STAGING_REQ`` of the new
    opening was sent, that is before the new opening expects anything. Ungated (the
    default, for tests and tools that record answers by hand): every answer is kept.

    **Side:** prefill. **Thread-safety:** any thread may record, expect, read or wait.
    """

    def __init__(self, *, gated: bool = False) -> None:
        self._cond = threading.Condition()
        self._answers: dict[tuple[int, int, str], RegionAnswer] = {}
        self._expected: set[tuple[int, int, str]] = set()
        self._gated = gated
        self._listeners: list[Callable[[], None]] = []
        self.dropped = 0
        """Answers not kept (gated: no open request of their room asked for them)."""

    @property
    def gated(self) -> bool:
        """Whether answers are kept only for chunks expected (fixed at construction)."""
        return self._gated

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on the recording thread, without the lock) after each answer."""
        self._listeners.append(listener)

    def expect(self, room: int, chunk_idx: int, session_id: str) -> None:
        """The writer is asking decode ``session_id`` for the chunk's region: an answer for it
        is kept from now on until :meth:`forget_room` (idempotent).

        **Called by:** the writer, before it sends ``STAGING_REQ``. **Blocking:** no.
        """
        with self._cond:
            self._expected.add((room, chunk_idx, session_id))

    def record(self, room: int, chunk_idx: int, session_id: str, answer: RegionAnswer) -> None:
        """Store an answer and wake waiters; gated, only an expected one (any other is
        dropped and counted in :attr:`dropped`).

        **Called by:** the listener thread (``STAGING_RSP``), or a test. **Blocking:** no.
        """
        key = (room, chunk_idx, session_id)
        with self._cond:
            if self._gated and key not in self._expected:
                self.dropped += 1
                return
            self._answers[key] = answer
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
        """Drop every answer and expectation of a room (closed, or opened again): gated, no
        answer of it is kept again until the writer expects one anew."""
        with self._cond:
            for key in [k for k in self._answers if k[0] == room]:
                del self._answers[key]
            self._expected = {key for key in self._expected if key[0] != room}

    @property
    def expected_count(self) -> int:
        """Chunks expected now (asked for by rooms not forgotten)."""
        with self._cond:
            return len(self._expected)

    def __len__(self) -> int:
        with self._cond:
            return len(self._answers)
