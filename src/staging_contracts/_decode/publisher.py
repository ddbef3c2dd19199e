"""Decode → prefill messages: who is subscribed to watermarks, and sends that never block.

**Side:** decode. Every prefill rank of a room that asked for a region is subscribed to the
ring's watermark broadcasts until the room is released; a peer whose queue stays full (dead or
stalled) is pruned after a few dropped messages, so a dead prefill never slows decode.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Final

from .._control.transport import PeerSockets, SocketsClosed

__all__ = ["PrefillPublisher"]

logger = logging.getLogger(__name__)

PEER_FAILURES_BEFORE_PRUNE: Final = 8
"""Consecutive dropped messages after which a prefill peer is pruned."""


class PrefillPublisher:
    """Sends to prefill listeners and keeps the watermark subscriptions.

    **Thread-safety:** any thread may call any method; sends never block.

    Args:
        sender: non-blocking PUSH sockets (owned by the caller).
    """

    def __init__(self, sender: PeerSockets) -> None:
        self._sender = sender
        self._lock = threading.Lock()
        self._rooms_of: dict[str, set[int]] = {}
        self._failures: dict[str, int] = {}
        self._last_watermark: dict[str, bytes] = {}
        self.pruned = 0
        """Peers pruned so far for not taking messages."""

    def subscribe(self, endpoint: str, room: int) -> None:
        """Subscribe a prefill listener to watermark broadcasts on behalf of ``room``."""
        with self._lock:
            self._rooms_of.setdefault(endpoint, set()).add(room)

    def send_watermark(self, endpoint: str, frames: Sequence[bytes], *, force: bool) -> None:
        """Send a ``WATERMARK`` unless this peer was already sent the same one (or ``force``).

        ``force`` is for re-requests: the peer may have lost the last one.
        """
        key = b"\x00".join(frames)
        with self._lock:
            if not force and self._last_watermark.get(endpoint) == key:
                return
            self._last_watermark[endpoint] = key
        self.send(endpoint, frames)

    def unsubscribe_room(self, room: int) -> None:
        """Drop ``room`` from every subscription; listeners left without rooms are pruned."""
        with self._lock:
            for endpoint in [e for e, rooms in self._rooms_of.items() if room in rooms]:
                rooms = self._rooms_of[endpoint]
                rooms.discard(room)
                if not rooms:
                    del self._rooms_of[endpoint]
                    self._last_watermark.pop(endpoint, None)

    @property
    def subscribers(self) -> tuple[str, ...]:
        """Endpoints currently subscribed."""
        with self._lock:
            return tuple(self._rooms_of)

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool:
        """Send one message; ``False`` if the peer's queue was full (counted toward pruning),
        or if the sockets were closed (the manager is shutting down: a room failing then, on
        whichever thread polls it, must not raise there)."""
        try:
            sent = self._sender.send(endpoint, frames)
        except SocketsClosed as exc:
            logger.info("message to %s not sent: %s", endpoint, exc)
            return False
        if sent:
            with self._lock:
                self._failures.pop(endpoint, None)
            return True
        with self._lock:
            failures = self._failures.get(endpoint, 0) + 1
            self._failures[endpoint] = failures
            prune = failures >= PEER_FAILURES_BEFORE_PRUNE
            if prune:
                self._rooms_of.pop(endpoint, None)
                self._failures.pop(endpoint, None)
                self._last_watermark.pop(endpoint, None)
                self.pruned += 1
        if prune:
            logger.warning("prefill peer %s stopped taking messages: pruned", endpoint)
            self._sender.forget(endpoint)
        return False

    def broadcast_watermark(self, frames: Sequence[bytes]) -> None:
        """Send a ``WATERMARK`` to every subscriber."""
        for endpoint in self.subscribers:
            self.send_watermark(endpoint, frames, force=True)
