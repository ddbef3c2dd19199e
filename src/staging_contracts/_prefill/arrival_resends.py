"""Re-sends of ``CHUNK_READY`` until decode's watermark shows the region was consumed.

A ``CHUNK_READY`` has no answer of its own. The cheapest acknowledgement that already flows
is decode's ``WATERMARK``: the ring's watermark is the (round, offset) of its oldest live
region, so once it is past a region's (round, offset) decode has freed that region: every
writer of it arrived and it was scattered, or its room failed and was fenced (either way a
copy can do no more). Until then the same frames go again every ``interval_s``, at most
``copies`` times, so that one lost ``CHUNK_READY`` costs ``interval_s``, not the room's
timeout.

A copy is safe at decode: an arrival is counted once per (region, writer), and a copy for a
region already consumed is a duplicate. A copy must also never count for a *later opening*
of the room id on decode; decode drops one naming an older epoch (the ring round), but a
later opening can get a region of the same round, so the copies are bounded by ordering:

* **This writer is its decode rank's only writer** (prefill TP <= decode TP): only its own
  ``STAGING_REQ`` gives a chunk of the room a region there. Copies of an opening are
  cancelled (:meth:`ArrivalResends.cancel_room`) when the room id is opened again on prefill,
  under the lock that sending takes, so every copy is queued on the one socket to that decode
  rank ahead of the new opening's first ``STAGING_REQ``, and reaches decode while the chunk
  has no region in the new opening (dropped there). Such copies keep going after the room
  closed on prefill (a scheduler releases a request at Success, before decode has seen its
  last arrival).
* **Several writers share a region** (prefill TP > decode TP): another writer's request of
  the new opening could give the chunk a region before a copy of this one arrives. Copies
  stop when the room closes on prefill (:meth:`ArrivalResends.close_room`): a copy can then
  reach a later opening only if decode ended the room and registered its id again while this
  writer still had it open and unacknowledged, with another writer already in the new
  opening (the window a single late ``CHUNK_READY`` has anyway, widened to the room's open
  time); the integrity tags, when on, fail such a room instead of passing it.

Copies to a decode session also stop when it fences the room (``ROOM_FENCE``: it gave the
room up), and every copy stops at the acknowledgement or the bound.

**Side:** prefill. **Thread-safety:** any thread may add or cancel; :meth:`flush` runs on the
listener thread (the staging idle hook).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from .._control.resend import DEFAULT_RESEND_S, ResendBox
from .._control.wire import ChunkReady
from ..protocols import Watermark
from .books import WatermarkTracker

__all__ = ["CHUNK_READY_COPIES", "ArrivalResends", "Sender"]

CHUNK_READY_COPIES: Final = 60
"""Most copies of one ``CHUNK_READY`` (60 at 0.5 s: the 30 s room bound)."""

_KIND: Final = ChunkReady.WIRE_TYPE


class Sender(Protocol):
    """What copies go through (``PeerSockets``): a send that never blocks."""

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool:
        """Queue one message for ``endpoint``; ``False`` if it was dropped."""
        ...


@dataclass(frozen=True, slots=True)
class _Awaited:
    session_id: str
    region: Watermark
    """The region's (round, offset): consumed once the watermark is past it."""
    outlives_room: bool
    """Sent on after the room closed on prefill (this writer is the region's only one)."""


class ArrivalResends:
    """``CHUNK_READY`` copies still to send, each until decode consumed its region.

    Args:
        watermarks: the writer's watermark book (the acknowledgement).
        sender: the writer's sockets (non-blocking sends).
        clock: monotonic clock (tests pass a fake one).
        interval_s: time between two copies.
        copies: most copies of one message.
    """

    def __init__(
        self,
        watermarks: WatermarkTracker,
        sender: Sender,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = DEFAULT_RESEND_S,
        copies: int = CHUNK_READY_COPIES,
    ) -> None:
        self._watermarks = watermarks
        self._sender = sender
        self._box = ResendBox(clock, interval_s)
        self._copies = copies
        self._lock = threading.Lock()
        self._awaited: dict[tuple[int, str, int], _Awaited] = {}
        self.sent = 0
        """Copies sent (the first sends not counted)."""

    def add(self, arrival: ChunkReady, endpoint: str, offset: int, *, sole_writer: bool) -> None:
        """Send ``arrival`` (already sent once) to ``endpoint`` again until the watermark
        of its session passes its region (epoch ``arrival.epoch``, starting at ``offset``);
        ``sole_writer``: this writer is the only one of the region (then copies outlive the
        room's close on prefill, see the module).

        **Called by:** the writer, after the first ``CHUNK_READY`` went out. **Blocking:** no.
        """
        if arrival.epoch is None or self._copies <= 0:
            return  # no region to acknowledge by: never re-sent
        key = (arrival.room, endpoint, arrival.chunk_idx)
        with self._lock:
            region = Watermark(arrival.epoch, offset)
            self._awaited[key] = _Awaited(arrival.session_id, region, sole_writer)
            frames = arrival.to_frames()
            self._box.add(arrival.room, endpoint, frames, self._copies, arrival.chunk_idx)
            if len(self._awaited) > len(self._box):  # the box dropped its oldest
                self._prune()

    def cancel_room(self, room: int) -> None:
        """Send no more copies of a room's arrivals (its id is opened again).

        **Called by:** the writer's ``track_room``. **Blocking:** no (waits for a flush).
        """
        with self._lock:
            self._box.cancel_room(room, _KIND)
            for key in [k for k in self._awaited if k[0] == room]:
                del self._awaited[key]

    def close_room(self, room: int) -> None:
        """The room closed on prefill: stop the copies that must not outlive it (those of
        regions shared with other writers).

        **Called by:** the writer's ``forget_room``. **Blocking:** no (waits for a flush).
        """
        with self._lock:
            for key, awaited in list(self._awaited.items()):
                if key[0] == room and not awaited.outlives_room:
                    self._drop(key)

    def cancel_session(self, room: int, session_id: str) -> None:
        """Decode session ``session_id`` fenced the room: no copy of it goes there again.

        **Called by:** the writer's ``handle_room_fence`` (listener thread). **Blocking:** no.
        """
        with self._lock:
            for key, awaited in list(self._awaited.items()):
                if key[0] == room and awaited.session_id == session_id:
                    self._drop(key)

    def _drop(self, key: tuple[int, str, int]) -> None:
        """Stop one message's copies (lock held)."""
        self._box.ack(key[0], key[1], _KIND, key[2])
        del self._awaited[key]

    def flush(self) -> int:
        """Drop the acknowledged copies and send those due; the number sent.

        **Called by:** the staging idle hook, on the listener thread. **Blocking:** no.
        """
        with self._lock:  # held while sending: a cancel never races a copy out
            for key, awaited in list(self._awaited.items()):
                if self._watermarks.latest(awaited.session_id) > awaited.region:
                    self._drop(key)
            due = self._box.take_due()
            for endpoint, frames in due:
                self._sender.send(endpoint, frames)
            self.sent += len(due)
            if len(self._awaited) > len(self._box):  # spent entries left the box
                self._prune()
            return len(due)

    def _prune(self) -> None:
        """Forget awaited regions whose copies are spent (lock held)."""
        live = self._box.keys()
        for key in [k for k in self._awaited if (k[0], k[1], _KIND, k[2]) not in live]:
            del self._awaited[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._awaited)
