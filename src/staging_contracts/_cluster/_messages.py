"""Rank⇄driver traffic of the cluster commands, typed: the events a rank process sends its
driver (a demo rank's progress and final :class:`RankSummary`, a soak rank's rooms, counters
and exit) and the commands a soak driver sends its ranks, each a frozen
:class:`~staging_contracts._run._codec.Message` on the run layer's one codec.

**Threads:** messages are immutable values (any thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._run._codec import Message
from .._run._rank_info import RankInfo
from ..metrics._snapshot import MetricsSnapshot

# ---------------------------------------------------------------- a demo rank's events


@dataclass(frozen=True, slots=True)
class Ready(Message):
    """A demo rank met its peers and starts its requests."""


@dataclass(frozen=True, slots=True)
class RequestDone(Message):
    """A demo rank saw request ``index`` end."""

    index: int
    ok: bool


@dataclass(frozen=True, slots=True)
class RankMemory:
    """What one rank's process held at the ``done`` barrier, before verification (see
    :class:`~staging_contracts._cluster.rank.TransferMemory`): its peak RSS, counted from
    ``peak_rss_from`` (``"timed requests"``, or ``"process start"`` where the peak could not
    be reset), its RSS then (``None``: the kernel did not say) and, on CUDA, the allocator's
    peak since the timed requests began."""

    peak_rss_before_verify_bytes: int
    peak_rss_from: str
    rss_at_done_bytes: int | None = None
    cuda_max_allocated_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class RankSummary(Message):
    """A demo rank's final report: what it did (see :mod:`~staging_contracts._cluster.rank`
    for the clocks and the memory), or the error it stopped on and how far it got."""

    ok: bool = False
    stopped: bool = False
    """The driver stopped it (``SIGTERM``); :attr:`phase` and :attr:`rooms` say how far."""
    error: str | None = None
    trace: str | None = None
    phase: str = ""
    rooms: dict[int, bool] = field(default_factory=dict)
    """Requests it saw end before it stopped, and whether each succeeded."""
    mode: str = "staged"
    start: float | None = None
    end: float | None = None
    verified: bool = False
    problems: tuple[str, ...] = ()
    succeeded: tuple[int, ...] = ()
    failed: dict[int, str | None] = field(default_factory=dict)
    room_first_request_s: dict[int, float] = field(default_factory=dict)
    room_done_s: dict[int, float] = field(default_factory=dict)
    ring_peak: int | None = None
    ring_size: int | None = None
    ring_live_after: int = 0
    control_messages: int = 0
    malformed: int = 0
    chunks: int = 0
    registered_after: int = 0
    bytes_written: int = 0
    requests_sent: int = 0
    write_calls: int = 0
    transfers: int = 0
    peak_rss_bytes: int | None = None
    memory: RankMemory | None = None


# ---------------------------------------------------------------- a soak rank's events


@dataclass(frozen=True, slots=True)
class Serving(Message):
    """A soak rank is up: what it publishes and where it takes commands."""

    info: RankInfo
    commands: str


@dataclass(frozen=True, slots=True)
class PeersTaken(Message):
    """A soak rank took a :class:`Peers` command (``count`` ranks): it can open rooms."""

    count: int


@dataclass(frozen=True, slots=True)
class RoomEnded(Message):
    """One room on one soak rank: ``state`` ``ok``, ``failed`` or ``hung``, at ``t``
    (``time.monotonic()``, the same clock in every process of the host)."""

    room: int
    index: int
    state: str
    t: float
    reason: str = ""
    verified: bool = False
    problems: tuple[str, ...] = ()
    release_error: str | None = None


@dataclass(frozen=True, slots=True)
class RankStatus(Message):
    """A soak rank's counters, the answer to :class:`AskStatus` ``id`` (side counters:
    ``None`` on the other side)."""

    id: int
    listener_alive: bool
    listener_received: int = 0
    listener_malformed: int = 0
    listener_errors: int = 0
    staging_malformed: int = 0
    staging_dropped: int = 0
    unauthorized: int = 0
    control_sent: int = 0
    control_dropped: int = 0
    room_threads: int = 0
    waiting_rooms: int = 0
    rss: tuple[tuple[float, int], ...] = ()
    open_rooms: int = 0
    ring_live_count: int | None = None
    ring_live_bytes: int | None = None
    ring_size: int | None = None
    fenced_rooms: int | None = None
    bytes_written: int | None = None
    answers_held: int | None = None
    answers_dropped: int | None = None
    early_meta: int | None = None
    early_meta_held: int | None = None
    early_meta_dropped: int | None = None

    def holds(self) -> bool:
        """Whether anything is held: ring, fences, open rooms, rooms waiting for peers, or
        a dead listener."""
        held = (self.ring_live_count, self.ring_live_bytes, self.fenced_rooms)
        return any(held) or bool(self.open_rooms or self.waiting_rooms) or not self.listener_alive


@dataclass(frozen=True, slots=True)
class RankError(Message):
    """A command that raised (the rank lives on)."""

    error: str
    command: str = ""


@dataclass(frozen=True, slots=True)
class ListenerDown(Message):
    """The rank's control listener thread ended."""


@dataclass(frozen=True, slots=True)
class Exit(Message):
    """A soak rank is on its way out."""

    ok: bool
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Metrics(Message):
    """A rank's counters for the driver's Prometheus relay (``--metrics-port``)."""

    snapshot: MetricsSnapshot


# ---------------------------------------------------------------- a soak driver's commands


@dataclass(frozen=True, slots=True)
class Peers(Message):
    """The current ranks of the other side (every prefill instance's, in order)."""

    ranks: tuple[RankInfo, ...]


@dataclass(frozen=True, slots=True)
class OpenRoom(Message):
    """Open ``room`` for workload request ``index``, from prefill ``instance``."""

    room: int
    index: int
    instance: int = 0


@dataclass(frozen=True, slots=True)
class AskStatus(Message):
    """Answer with a :class:`RankStatus` of this ``id``."""

    id: int


@dataclass(frozen=True, slots=True)
class Trust(Message):
    """Trust the participant at ``endpoint`` by its CURVE public ``key`` (Z85)."""

    endpoint: str
    key: str


@dataclass(frozen=True, slots=True)
class Stop(Message):
    """Close the backend, the transfer worker given at most ``close_s``, and exit."""

    close_s: float = 10.0
