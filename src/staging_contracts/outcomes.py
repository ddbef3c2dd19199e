"""Typed room outcomes: why a room failed (:class:`FailureReason`) and what one transfer did
(:class:`TransferRecord`).

The library's failure messages stay free text (they name ranks, rooms and timeouts), and each
site where the library fails a room itself sets its :class:`FailureReason` there (an engine
write that failed is ``ENGINE_ERROR`` whatever the engine's message says). Only a reason that
comes from the other side as text (``ROOM_FAILED``) is read back by :func:`classify`, by its
innermost cause, so ``"decode failed the room: prefill writer rank 0 ... is dead"`` counts as
that cause (``PEER_DEAD``). :class:`RoomFailure` carries both.

Metrics label a reason by :attr:`FailureReason.label` (``peer_dead``, ``no_room_meta``: the
Prometheus convention); the enum's values are the text the soak's summary shows.

**Threads:** everything here is immutable or pure; any thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

__all__ = ["FailureReason", "Outcome", "RoomEnd", "RoomFailure", "TransferRecord", "classify"]


class FailureReason(enum.StrEnum):
    """Why a room failed; the value is the text the soak summary shows, :attr:`label` the
    metrics' ``reason`` label."""

    PEER_DEAD = "peer dead"
    """A peer rank went silent past the liveness timeout, or its endpoint is gone."""
    STALLED = "stalled"
    """The room made no progress for the stall timeout (or its region was taken back)."""
    NO_ROOM_META = "no ROOM_META"
    """Decode never sent the room's ROOM_META to a prefill writer."""
    TIMEOUT = "timeout"
    """A prefill deadline passed (room never writable, or no progress before the deadline)."""
    ENGINE_ERROR = "engine error"
    """The transfer engine failed a write (whatever its message says: a write the engine
    reports as timed out is an engine error, not a prefill ``TIMEOUT``), or decode's scatter
    of a staged chunk into its KV pool failed (a device error)."""
    REFUSED = "refused"
    """The room's registration or a request for it was refused: the room does not fit the
    rank (its plan, or no endpoint for one of its prefill writers), the rank does not know
    the room (``unknown room``: never opened, or released), or decode refused a chunk."""
    UNAUTHORIZED = "unauthorized"
    """A message for the room came from a sender the listener does not accept."""
    RELEASED_EARLY = "released early"
    """The room was released before it finished."""
    RANK_ERROR = "rank error"
    """A rank reported an error of its own."""
    FENCED = "fenced"
    """The room's regions were fenced (a writer may still write there)."""
    INTEGRITY = "integrity"
    """A staged chunk's digest did not match."""
    ROOM_BOUND = "room bound"
    """No STAGING_REQ arrived for the room within its bound."""
    MALFORMED = "malformed"
    """A message about the room could not be decoded."""
    DRAINING = "draining"
    """The manager is draining: new rooms are refused, the rest failed after ``drain_s``."""
    OTHER = "other"
    """None of the above (the detail says what)."""

    @property
    def label(self) -> str:
        """The metrics' ``reason`` label: the member's name in snake case (``peer_dead``)."""
        return self.name.lower()


class Outcome(enum.StrEnum):
    """How a room ended."""

    SUCCESS = "success"
    FAILED = "failed"


# Ordered: the first group with a needle in the lowered message wins. An engine's or a
# scatter's failure first (the engine's own words, "timed out", "is dead", do not pick the
# label), "draining" before "refused" (a room refused while draining is DRAINING), "dead"
# causes before the wrappers that pass them on.
_NEEDLES: Final = (
    (FailureReason.ENGINE_ERROR, ("engine write failed", "engine error", "scatter of chunk")),
    (FailureReason.DRAINING, ("draining",)),
    (FailureReason.PEER_DEAD, ("is dead", "peer dead", "is gone", "declared dead")),
    (FailureReason.STALLED, ("no progress for", "taken back with room")),
    (FailureReason.NO_ROOM_META, ("never sent room_meta",)),
    (
        FailureReason.TIMEOUT,
        ("before the deadline", "never became writable", "without progress", "timed out"),
    ),
    (FailureReason.UNAUTHORIZED, ("unauthorized",)),
    (
        FailureReason.REFUSED,
        ("refused", "unknown room", "room unknown on decode", "no endpoint registered"),
    ),
    (FailureReason.RELEASED_EARLY, ("released before it finished",)),
    (FailureReason.RANK_ERROR, ("rank error",)),
    (FailureReason.FENCED, ("fenced the room",)),
    (FailureReason.INTEGRITY, ("integrity",)),
    (FailureReason.ROOM_BOUND, ("no staging_req for",)),
    (FailureReason.MALFORMED, ("malformed",)),
)


def classify(detail: str) -> FailureReason:
    """The :class:`FailureReason` of a free-text failure message, by its innermost cause
    (:attr:`FailureReason.OTHER` if none is recognised)."""
    lowered = detail.lower()
    for reason, needles in _NEEDLES:
        if any(needle in lowered for needle in needles):
            return reason
    return FailureReason.OTHER


@dataclass(frozen=True, slots=True)
class RoomFailure:
    """A failed room's reason and the message a rank gave for it."""

    reason: FailureReason
    detail: str

    @classmethod
    def from_detail(cls, detail: str) -> RoomFailure:
        """The failure of a free-text message (its reason by :func:`classify`)."""
        return cls(classify(detail), detail)


@dataclass(frozen=True, slots=True)
class RoomEnd:
    """How a room ended on one rank, stamped when it ended (its :class:`TransferRecord`'s
    end, whenever the record is asked for)."""

    succeeded: bool
    failure: RoomFailure | None
    """Why it failed (``None`` if it succeeded), typed where it failed."""
    end_monotonic: float
    end_wall: float
    chunks: int
    bytes: int | None


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """What one room's transfer did on one rank, once it ended (cf. SGLang's
    ``KVTransferMetric``: ``transfer_latency_s``, ``transfer_total_bytes``).

    ``bytes`` is ``None`` where the side does not count them. Times: ``start_*``/``end_*`` in
    ``time.monotonic()`` (for latency) and ``time.time()`` (for logs).
    """

    room: int
    bytes: int | None
    chunks: int
    start_monotonic: float
    end_monotonic: float
    start_wall: float
    end_wall: float
    outcome: Outcome
    failure: RoomFailure | None

    @property
    def latency_s(self) -> float:
        """Seconds from the room's start to its end."""
        return self.end_monotonic - self.start_monotonic

    @property
    def transfer_latency_s(self) -> float:
        """SGLang's name for :attr:`latency_s`."""
        return self.latency_s

    @property
    def transfer_total_bytes(self) -> int | None:
        """SGLang's name for :attr:`bytes`."""
        return self.bytes

    @property
    def reason(self) -> FailureReason | None:
        """Why the room failed (``None`` if it succeeded)."""
        return None if self.failure is None else self.failure.reason
