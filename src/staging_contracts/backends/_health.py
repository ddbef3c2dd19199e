"""``ManagerHealth``: what an operator asks a manager (``CommonKVManager.health()``).

A frozen snapshot, taken on the caller's thread from values each part keeps under its own
lock: the listener thread, the peers watched by liveness and those declared dead, the staging
ring's use (decode), the rooms in flight and whether the manager drains. The fields are read one
after the other, not at one instant: under load two of them may be a few messages apart.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ManagerHealth"]


@dataclass(frozen=True, slots=True)
class ManagerHealth:
    """One manager's state, as ``health()`` saw it."""

    role: str
    """``"prefill"`` or ``"decode"``."""
    endpoint: str
    """The control listener's ``tcp://host:port``."""
    listener_alive: bool
    """Whether the listener thread runs (false before ``start`` and after ``close``)."""
    closed: bool
    """Whether ``close`` was called."""
    draining: bool
    """Whether a drain began (new rooms are refused)."""
    peers: frozenset[str]
    """The peers watched by liveness now (endpoints)."""
    dead_peers: frozenset[str]
    """The watched peers declared dead and not heard from since."""
    rooms_in_flight: int
    """Rooms opened (prefill) or registered (decode) and not yet ended."""
    ring_reserved_bytes: int | None = None
    """Decode: bytes of the ring regions assigned and not freed. The allocator overcommits
    (regions of the next round over ones still in use), so this may exceed the capacity;
    ``None`` on prefill or before decode staging is enabled."""
    ring_capacity_bytes: int | None = None
    """Decode: the ring's size in bytes (``None`` on prefill)."""

    @property
    def ring_use(self) -> float | None:
        """``ring_reserved_bytes / ring_capacity_bytes`` (``None`` without a ring)."""
        if self.ring_reserved_bytes is None or not self.ring_capacity_bytes:
            return None
        return self.ring_reserved_bytes / self.ring_capacity_bytes

    @property
    def ok(self) -> bool:
        """Ready for new rooms: listening, not closed, not draining (a draining manager
        refuses every new room, so a readiness probe must take it out of rotation) and no
        watched peer dead."""
        return self.listener_alive and not self.closed and not self.draining and not self.dead_peers
