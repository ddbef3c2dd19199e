"""Draining a manager: refuse new rooms, let the rooms in flight finish, fail the rest.

Each manager (``CommonKVManager``) has one :class:`DrainGate`. The books that hold its rooms
join it: on decode the staging handler (``enable_decode_staging``), on prefill the per-request
layer (``PrefillTransfers``). ``manager.close(drain_s=...)`` calls :meth:`DrainGate.drain`
before it stops the listener: from then on every book refuses a new room at once (it fails
with a reason :func:`~staging_contracts.outcomes.classify` reads as
:attr:`~staging_contracts.outcomes.FailureReason.DRAINING`), the rooms in flight when the
drain began get up to ``drain_s`` to end on their own, and those still running then are failed
(again with reason *draining*). What happened is returned as a :class:`DrainResult`.

**Threads:** ``drain`` runs on the caller's thread (the scheduler's, which closes the manager)
while the listener and the transfer workers finish the rooms; the books are called without the
gate's lock held, so a book may call back into the gate (``refused``) from any thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

__all__ = [
    "DRAINING_REFUSAL",
    "DrainGate",
    "DrainResult",
    "RoomBook",
    "check_drain_s",
    "drain_expired",
    "join_drain",
]

logger = logging.getLogger(__name__)

DRAINING_REFUSAL: Final = "refused: the manager is draining"
"""The failure reason of a room opened or registered while its manager drains."""

DRAIN_SLICE_S: Final = 0.01
"""``drain`` looks at the rooms in flight at least this often."""

DRAIN_TELL_S: Final = 1.0
"""Longest ``drain`` waits, after failing the rooms left, for the peers to acknowledge their
``ROOM_FAILED`` (re-sent meanwhile by the listener), before the manager closes its sockets."""


def check_drain_s(drain_s: float) -> None:
    """Raise ``ValueError`` unless ``drain_s`` is a finite number of seconds >= 0."""
    if not (math.isfinite(drain_s) and drain_s >= 0):
        raise ValueError(f"drain_s={drain_s!r} must be a finite number of seconds >= 0")


def drain_expired(drain_s: float) -> str:
    """The failure reason of a room still in flight when the drain's time ran out."""
    return f"draining: the room did not finish within drain_s={drain_s:g}s"


class RoomBook(Protocol):
    """What holds a manager's rooms, as the drain sees it (the decode handler, the prefill
    per-request layer)."""

    def rooms_in_flight(self) -> frozenset[int]:
        """The rooms opened and not yet ended (succeeded or failed). Any thread."""
        ...

    def abandon_room(self, room: int, reason: str) -> None:
        """Fail a room still in flight and tell its peers. Any thread."""
        ...

    def refuse_new_rooms(self, reason: str, refused: Callable[[int], None]) -> None:
        """From now on fail every new room at once with ``reason`` and call ``refused(room)``
        for each (any thread, possibly with the book's lock held)."""
        ...

    @property
    def room_failed_unacked(self) -> int:
        """``ROOM_FAILED`` messages to peers not acknowledged yet (still re-sent)."""
        ...


@dataclass(frozen=True, slots=True)
class DrainResult:
    """What a drain did.

    ``finished``: the rooms in flight when the drain began that ended on their own within
    ``drain_s`` (succeeded, or failed for a cause of their own); ``failed``: those still in
    flight then, failed by the drain; ``refused``: rooms opened or registered during the
    drain, refused at once. Room ids, sorted.
    """

    drain_s: float
    elapsed_s: float
    finished: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    refused: tuple[int, ...] = ()

    @property
    def clean(self) -> bool:
        """Whether every room in flight finished within ``drain_s``."""
        return not self.failed


class DrainGate:
    """A manager's drain: the books of its rooms and whether it is draining.

    **Thread-safety:** every method may be called from any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._books: list[RoomBook] = []
        self._draining = False
        self._refused: list[int] = []

    @property
    def draining(self) -> bool:
        """Whether a drain began (new rooms are refused)."""
        with self._lock:
            return self._draining

    def join(self, book: RoomBook) -> None:
        """Add a book of the manager's rooms (one joining during a drain refuses at once).

        **Called by:** the staging set-up and the per-request layer, at construction.
        """
        with self._lock:
            self._books.append(book)
            draining = self._draining
        if draining:
            book.refuse_new_rooms(DRAINING_REFUSAL, self._note_refused)

    @property
    def books(self) -> tuple[RoomBook, ...]:
        """The books joined so far (e.g. for metrics to find a prefill's transfers)."""
        with self._lock:
            return tuple(self._books)

    def rooms_in_flight(self) -> int:
        """Rooms opened and not yet ended, over every book. **Blocking:** no."""
        with self._lock:
            books = list(self._books)
        return sum(len(book.rooms_in_flight()) for book in books)

    def _note_refused(self, room: int) -> None:
        with self._lock:
            self._refused.append(room)

    def drain(self, drain_s: float) -> DrainResult:
        """Refuse new rooms, wait up to ``drain_s`` for the rooms in flight, fail the rest.

        Calling it again drains again (the rooms refused so far are reported again).

        **Called by:** ``CommonKVManager.close(drain_s=...)``, on the thread that closes the
        manager (never the listener's: it finishes the rooms). **Blocking:** up to
        ``drain_s`` (looking at the books every :data:`DRAIN_SLICE_S`), then, when it failed
        rooms, up to :data:`DRAIN_TELL_S` until their peers acknowledged it.

        Raises:
            ValueError: ``drain_s`` is negative or not finite.
        """
        check_drain_s(drain_s)
        with self._lock:
            self._draining = True
            books = list(self._books)
        for book in books:
            book.refuse_new_rooms(DRAINING_REFUSAL, self._note_refused)
        started = time.monotonic()
        deadline = started + drain_s
        began = [book.rooms_in_flight() for book in books]
        while True:
            left = [book.rooms_in_flight() & ago for book, ago in zip(books, began, strict=True)]
            remaining = deadline - time.monotonic()
            if not any(left) or remaining <= 0:
                break
            time.sleep(min(DRAIN_SLICE_S, remaining))
        reason = drain_expired(drain_s)
        for book, rooms in zip(books, left, strict=True):
            for room in sorted(rooms):
                book.abandon_room(room, reason)
        if any(left):  # let the peers hear it before the sockets close (bounded)
            told_by = time.monotonic() + DRAIN_TELL_S
            while any(b.room_failed_unacked for b in books) and time.monotonic() < told_by:
                time.sleep(DRAIN_SLICE_S)
        failed = frozenset().union(*left) if left else frozenset()
        finished = (frozenset().union(*began) if began else frozenset()) - failed
        with self._lock:
            refused = tuple(sorted(set(self._refused)))
        result = DrainResult(
            drain_s=drain_s,
            elapsed_s=time.monotonic() - started,
            finished=tuple(sorted(finished)),
            failed=tuple(sorted(failed)),
            refused=refused,
        )
        logger.info(
            "drained in %.3fs: %d finished, %d failed, %d refused",
            result.elapsed_s,
            len(result.finished),
            len(result.failed),
            len(result.refused),
        )
        return result


def join_drain(host: object, book: RoomBook) -> None:
    """Join ``book`` to the drain gate of ``host`` (its ``drain_gate``), if it has one (a
    manager not built on ``CommonKVManager`` may not: its rooms are then not drained)."""
    gate = getattr(host, "drain_gate", None)
    if isinstance(gate, DrainGate):
        gate.join(book)
