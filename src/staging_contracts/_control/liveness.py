"""Peer liveness: which watched peers have gone silent, by ``PING``/``PONG`` over ZMQ.

A rank watches the peers its rooms depend on (decode: the prefill writers of its rooms;
prefill: the decode ranks it writes to). Every ``interval_s`` it sends each watched peer a
``PING`` carrying its own endpoint; the peer answers ``PONG`` at once, whether or not it
watches back. A ``PING`` or ``PONG`` from a peer is its sign of life (no other message
counts). A watched peer not heard from for ``timeout_s`` is declared dead once, and every
subscriber is told (the rooms that depend on it then fail together, within seconds rather
than at a per-chunk deadline).

A peer that never answers ``PING`` (the reference's ranks) must not be watched, or it dies
``timeout_s`` after the first watch: the prefill writer leaves out every decode rank given
as ``DecodeTarget(..., liveness=False)``, so it is never pinged and its rooms never fail for
its silence (their chunk deadlines still bound every wait).

A peer heard from again after being declared dead is alive again (a new process on the same
endpoint); the rooms already failed stay failed.

**Liveness by identity.** With the cluster secret, every message carries its sender's
authenticated identity (the endpoint its CURVE key was published with, see
:attr:`~.transport.Listener.sender`), given as ``identity``: a ``PING`` or ``PONG`` then counts
for that sender only, and a ``PING`` is answered at that sender's endpoint. The endpoint a
``PING`` (``reply_to``) or ``PONG`` names is not trusted: one that names another peer is counted
in :attr:`PeerLiveness.forged` and credits nobody but its real sender, so no authenticated peer
can keep a dead one "alive". Without a secret (loopback only, unauthenticated) the named
endpoint is all there is; the sockets such names open are bounded by
:class:`~.transport.PeerSockets`.

**Threads:** ``tick`` runs on the listener thread (its idle hook); ``watch``, ``unwatch``,
``heard`` and ``is_dead`` from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final

from .. import config
from .room_messages import Ping, Pong
from .transport import PeerSockets

__all__ = ["DEFAULT_PEER_INTERVAL_S", "DEFAULT_PEER_TIMEOUT_S", "PeerLiveness"]

logger = logging.getLogger(__name__)

DEFAULT_PEER_INTERVAL_S: Final = config.LIVENESS_INTERVAL_S.default
"""Seconds between two ``PING`` to a watched peer."""
DEFAULT_PEER_TIMEOUT_S: Final = config.LIVENESS_TIMEOUT_S.default
"""Seconds of silence after which a watched peer is declared dead."""


class PeerLiveness:
    """Watches peers by endpoint and tells subscribers when one goes silent.

    Args:
        sender: non-blocking sockets to the peers.
        endpoint: this rank's own control listener (carried by ``PING`` and ``PONG``).
        interval_s: seconds between two ``PING`` to a watched peer (``None``:
            ``STAGING_CONTRACTS_LIVENESS_INTERVAL_S``, else 0.5; see
            :mod:`~staging_contracts.config`).
        timeout_s: seconds of silence after which a watched peer is dead; must exceed
            ``interval_s`` (``None``: ``STAGING_CONTRACTS_LIVENESS_TIMEOUT_S``, else 5).
        clock: monotonic clock (tests pass a fake one).
        identity: the authenticated sender of the message being dispatched (called on the
            listener thread, during ``on_ping``/``on_pong``; ``None`` from it: unknown, the
            message is dropped and counted in :attr:`forged`). ``None`` (no secret): the
            endpoint the message names is taken as its sender.

    Raises:
        ConfigError: a liveness variable of the environment is unusable.
        ValueError: ``interval_s`` is not positive or ``timeout_s`` does not exceed it.
    """

    def __init__(
        self,
        sender: PeerSockets,
        endpoint: str,
        *,
        interval_s: float | None = None,
        timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        identity: Callable[[], str | None] | None = None,
    ) -> None:
        given = (interval_s, timeout_s)
        interval_s = config.LIVENESS_INTERVAL_S.value(interval_s)
        timeout_s = config.LIVENESS_TIMEOUT_S.value(timeout_s)
        if not interval_s > 0 or not timeout_s > interval_s:
            # name where each came from: an argument, a variable of the environment, a default
            raise ValueError(
                f"the liveness interval ({config.LIVENESS_INTERVAL_S.source(given[0])}) must "
                f"be > 0 and below the timeout ({config.LIVENESS_TIMEOUT_S.source(given[1])})"
            )
        self._sender = sender
        self.endpoint = endpoint
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._watchers: dict[str, int] = {}
        """Watched endpoint -> how many holders watch it."""
        self._last_heard: dict[str, float] = {}
        """Watched endpoint -> when it was last heard from (or first watched)."""
        self._dead: set[str] = set()
        self._last_ping = float("-inf")
        self._subscribers: list[Callable[[str], None]] = []
        self._identity = identity
        self.declared_dead = 0
        """Peers declared dead so far (each time one is; a peer heard again can die again)."""
        self.forged = 0
        """``PING``/``PONG`` (with ``identity``) whose named endpoint is not their sender's,
        or whose sender is unknown: they count for no one but their real sender."""

    def subscribe(self, on_dead: Callable[[str], None]) -> None:
        """Call ``on_dead(endpoint)`` (on the listener thread) when a watched peer dies."""
        with self._lock:
            self._subscribers.append(on_dead)

    def watch(self, endpoint: str) -> None:
        """Start (or add one more holder to) watching a peer; its silence clock starts now."""
        with self._lock:
            count = self._watchers.get(endpoint, 0)
            self._watchers[endpoint] = count + 1
            if count == 0:
                self._last_heard[endpoint] = self._clock()

    def unwatch(self, endpoint: str) -> None:
        """Drop one holder's watch of a peer (stop watching when none is left)."""
        with self._lock:
            count = self._watchers.get(endpoint, 0)
            if count <= 1:
                self._watchers.pop(endpoint, None)
                self._last_heard.pop(endpoint, None)
            else:
                self._watchers[endpoint] = count - 1

    def heard(self, endpoint: str) -> None:
        """A message came from ``endpoint``: it is alive (again)."""
        with self._lock:
            if endpoint in self._watchers:
                self._last_heard[endpoint] = self._clock()
            self._dead.discard(endpoint)

    def is_dead(self, endpoint: str) -> bool:
        """Whether ``endpoint`` was declared dead and has not been heard from since."""
        with self._lock:
            return endpoint in self._dead

    @property
    def watched(self) -> frozenset[str]:
        """The peers watched now."""
        with self._lock:
            return frozenset(self._watchers)

    @property
    def dead(self) -> frozenset[str]:
        """The peers declared dead and not heard from since (watched or not any more)."""
        with self._lock:
            return frozenset(self._dead)

    def on_ping(self, frames: list[bytes]) -> None:
        """Answer a ``PING`` (listener thread). Raises ``MalformedMessage`` on bad frames.

        With ``identity``, the answer goes to the authenticated sender, whatever
        ``reply_to`` says."""
        ping = Ping.from_frames(frames)
        sender = self._speaker(ping.reply_to)
        if sender is not None:
            self.heard(sender)
            self._sender.send(sender, Pong(self.endpoint).to_frames())

    def on_pong(self, frames: list[bytes]) -> None:
        """Note a ``PONG`` (listener thread). Raises ``MalformedMessage`` on bad frames.

        With ``identity``, it counts for the authenticated sender only."""
        sender = self._speaker(Pong.from_frames(frames).endpoint)
        if sender is not None:
            self.heard(sender)

    def _speaker(self, named: str) -> str | None:
        """Who a ``PING``/``PONG`` naming ``named`` speaks for: its authenticated sender
        (with ``identity``), else ``named``; ``None`` when the sender is unknown."""
        if self._identity is None:
            return named
        sender = self._identity()
        if sender != named:
            with self._lock:
                self.forged += 1
            logger.debug("liveness message naming %s came from %s", named, sender)
        return sender

    def tick(self) -> list[str]:
        """Ping the watched peers when due; declare the silent ones dead and tell subscribers.

        **Called by:** the listener's idle hook. **Blocking:** no.

        Returns:
            The peers declared dead by this call.
        """
        now = self._clock()
        with self._lock:
            due = now - self._last_ping >= self.interval_s
            if due:
                self._last_ping = now
            targets = [e for e in self._watchers if e not in self._dead] if due else []
            newly_dead = [
                e
                for e, heard in self._last_heard.items()
                if e not in self._dead and now - heard > self.timeout_s
            ]
            self._dead.update(newly_dead)
            self.declared_dead += len(newly_dead)
            subscribers = list(self._subscribers)
        ping = Ping(self.endpoint).to_frames()
        for endpoint in targets:
            self._sender.send(endpoint, ping)
        for endpoint in newly_dead:
            logger.warning("peer %s silent for over %gs: declared dead", endpoint, self.timeout_s)
            for on_dead in subscribers:
                try:
                    on_dead(endpoint)
                except Exception:  # a subscriber's bug must not stop the others or the listener
                    logger.exception("liveness subscriber failed on dead peer %s", endpoint)
        return newly_dead
