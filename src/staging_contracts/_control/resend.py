"""Re-sends of control messages, so that one lost frame does not end a room late:
``ROOM_META`` (until the writer is heard from), ``ROOM_FAILED`` (with a bounded backoff, until
``ROOM_FAILED_ACK``; see :mod:`~staging_contracts._control.room_messages`), and ``CHUNK_READY``
through :mod:`~staging_contracts._prefill.arrival_resends`.

A :class:`ResendBox` holds copies still to send, per (room, endpoint, kind): each goes again
every ``interval_s`` until its copies are spent, it is acknowledged (:meth:`ResendBox.ack`)
its receiver is gone (:meth:`ResendBox.cancel_endpoint`) or its room is cancelled
(:meth:`ResendBox.cancel_room`, when the room id is opened again,
so that no copy of an earlier opening is sent after the new opening's first message: copies
and the new opening's messages travel on the same socket, in order). Every message re-sent
this way is idempotent at its receiver. The box is bounded: past ``capacity`` entries the
oldest goes. With ``backoff`` above 1 the time between two copies of one message grows by
that factor each copy, up to ``max_interval_s``.

**Thread-safety:** any thread may add, acknowledge, cancel or take what is due.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["DEFAULT_RESEND_S", "RESEND_CAPACITY", "ResendBox"]

DEFAULT_RESEND_S: Final = 0.5
"""How often a copy goes again by default."""

RESEND_CAPACITY: Final = 4096
"""Most entries a box holds (the oldest goes first past it)."""


@dataclass(slots=True)
class _Entry:
    endpoint: str
    frames: list[bytes]
    copies: int
    """Copies still to send (``-1``: until acknowledged or cancelled)."""
    due: float
    interval: float
    """Time until the copy after the next one."""


class ResendBox:
    """Copies of messages to send again, bounded.

    Args:
        interval_s: time between two copies of one message.
        clock: monotonic clock (tests pass a fake one).
        capacity: most entries held.
        backoff: each copy waits this many times longer than the one before (>= 1).
        max_interval_s: the longest wait between two copies (``None``: ``interval_s``).
    """

    def __init__(
        self,
        clock: Callable[[], float],
        interval_s: float = DEFAULT_RESEND_S,
        capacity: int = RESEND_CAPACITY,
        *,
        backoff: float = 1.0,
        max_interval_s: float | None = None,
    ) -> None:
        if backoff < 1:
            raise ValueError(f"backoff={backoff!r} must be >= 1")
        self._clock = clock
        self._interval = interval_s
        self._backoff = backoff
        self._max_interval = max(interval_s, max_interval_s or interval_s)
        self._capacity = capacity
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, str, bytes, int], _Entry] = {}

    def add(
        self, room: int, endpoint: str, frames: Sequence[bytes], copies: int, tag: int = 0
    ) -> None:
        """Send ``frames`` to ``endpoint`` again ``copies`` more times (``-1``: until
        :meth:`ack` or :meth:`cancel_room`), the first ``interval_s`` from now. ``tag`` tells
        apart messages of one kind and room to one endpoint (a chunk index)."""
        key = (room, endpoint, bytes(frames[0]) if frames else b"", tag)
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = _Entry(
                endpoint,
                list(frames),
                copies,
                self._clock() + self._interval,
                self._next(self._interval),
            )
            while len(self._entries) > self._capacity:
                del self._entries[next(iter(self._entries))]

    def ack(self, room: int, endpoint: str, kind: bytes, tag: int = 0) -> None:
        """Stop re-sending one message (its receiver answered)."""
        with self._lock:
            self._entries.pop((room, endpoint, kind, tag), None)

    def ack_tag(self, room: int, kind: bytes, tag: int) -> None:
        """Stop re-sending one message of ``kind`` and ``tag`` to every endpoint."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == room and k[2:] == (kind, tag)]:
                del self._entries[key]

    def cancel_endpoint(self, endpoint: str) -> None:
        """Stop re-sending anything to ``endpoint`` (its peer was declared dead)."""
        with self._lock:
            for key in [k for k in self._entries if k[1] == endpoint]:
                del self._entries[key]

    def _next(self, interval: float) -> float:
        return min(self._max_interval, interval * self._backoff)

    def cancel_room(self, room: int, kind: bytes | None = None) -> None:
        """Stop re-sending a room's messages (of ``kind`` only, when given)."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == room and kind in (None, k[2])]:
                del self._entries[key]

    def take_due(self) -> list[tuple[str, list[bytes]]]:
        """The copies due now, as (endpoint, frames); spent entries are dropped."""
        now = self._clock()
        out: list[tuple[str, list[bytes]]] = []
        with self._lock:
            for key, entry in list(self._entries.items()):
                if entry.due > now:
                    continue
                out.append((entry.endpoint, entry.frames))
                if entry.copies > 0:
                    entry.copies -= 1
                if entry.copies == 0:
                    del self._entries[key]
                else:
                    entry.due = now + entry.interval
                    entry.interval = self._next(entry.interval)
        return out

    def keys(self) -> frozenset[tuple[int, str, bytes, int]]:
        """The (room, endpoint, kind, tag) of every entry held now."""
        with self._lock:
            return frozenset(self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
