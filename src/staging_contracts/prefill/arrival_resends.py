"""Re-sends of ``CHUNK_READY`` until decode's watermark shows the region was consumed.

A ``CHUNK_READY`` has no answer of its own. The cheapest acknowledgement that already flows
is decode's ``WATERMARK``: the ring's watermark is the (round, offset) of its oldest live
region, so once it is past a region's (round, offset) decode has freed that region: every
writer of it arrived and it was scattered, or its room failed and was fenced (either way a
copy can do no more). Until then the same frames go again every ``interval_s``, at most
``copies`` times, so that one lost ``CHUNK_READY`` costs ``interval_s``, not the room's
timeout.

A copy is safe at decode: an arrival is counted once per (region, writer), a copy for a
region already consumed is a duplicate, one for a region of the room's next opening names an
older epoch (the ring round) or comes before that opening asked for a region at all (copies
of an opening are cancelled by :meth:`ArrivalResends.cancel_room` when the room id is opened
again on prefill, under the lock that sending takes, and travel on the one socket to that
decode rank ahead of the new opening's ``STAGING_REQ``). Copies keep going after the room
closed on prefill (a scheduler releases the request at Success, before decode has seen the
last arrival): they stop at the acknowledgement, the bound, or the room's next opening.

**Side:** prefill. **Thread-safety:** any thread may add or cancel; :meth:`flush` runs on the
listener thread (the staging idle hook).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from ..control.resend import DEFAULT_RESEND_S, ResendBox
from ..control.wire import ChunkReady
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

    def add(self, arrival: ChunkReady, endpoint: str, offset: int) -> None:
        """Send ``arrival`` (already sent once) to ``endpoint`` again until the watermark
        of its session passes its region (epoch ``arrival.epoch``, starting at ``offset``).

        **Called by:** the writer, after the first ``CHUNK_READY`` went out. **Blocking:** no.
        """
        if arrival.epoch is None or self._copies <= 0:
            return  # no region to acknowledge by: never re-sent
        key = (arrival.room, endpoint, arrival.chunk_idx)
        with self._lock:
            self._awaited[key] = _Awaited(arrival.session_id, Watermark(arrival.epoch, offset))
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

    def flush(self) -> int:
        """Drop the acknowledged copies and send those due; the number sent.

        **Called by:** the staging idle hook, on the listener thread. **Blocking:** no.
        """
        with self._lock:  # held while sending: a cancel never races a copy out
            for key, awaited in list(self._awaited.items()):
                if self._watermarks.latest(awaited.session_id) > awaited.region:
                    self._box.ack(key[0], key[1], _KIND, key[2])
                    del self._awaited[key]
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
