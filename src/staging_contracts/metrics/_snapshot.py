"""One rank's counters at one moment, typed, and read without adding work to the hot path.

:func:`snapshot_of` copies what the library already counts (the listener's
:class:`~staging_contracts._control.transport.ListenerStats`, the mixin's
:class:`~staging_contracts.stats.StagingStats`, the manager's per-type control counts and
``unauthorized``, the liveness's ``declared_dead``, the decode handler's scatter counts, ring
and fences, the prefill writer's bytes and chunks, and each side's
:class:`~staging_contracts.stats.RoomTally`) into a frozen :class:`MetricsSnapshot`.
A rank sends it to its driver (``--metrics-port``) as a ``Metrics`` message on the
rank<->driver codec (``_run/_codec.py``), which checks every field's type.

**Threads:** :func:`snapshot_of` may run on any thread (it takes the handler's or the
transfers' lock for a copy only); the records are immutable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from .._decode.handler import DecodeStagingHandler
from ..engines import ENGINES
from ..stats import LATENCY_BUCKETS_S

if TYPE_CHECKING:
    from ..backends._common import CommonKVManager
    from ..backends._kv_requests import PrefillTransfers

__all__ = ["ControlCount", "MetricsSnapshot", "RoomCount", "engine_name", "snapshot_of"]

_BUCKETS: Final = len(LATENCY_BUCKETS_S) + 1


@dataclass(frozen=True, slots=True)
class RoomCount:
    """Rooms that ended one way on one rank."""

    outcome: str
    """An :class:`~staging_contracts.outcomes.Outcome` value."""
    reason: str
    """A :class:`~staging_contracts.outcomes.FailureReason` value; ``""`` for a success."""
    count: int


@dataclass(frozen=True, slots=True)
class ControlCount:
    """Control messages of one frame-0 type the listener handed on."""

    kind: str
    count: int


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """One rank's counters (the label values, then the series' values)."""

    role: str
    rank: int
    engine: str
    side: str = ""
    """The manager's own role (``"prefill"`` or ``"decode"``, whatever the ``role`` label
    says): which series apply (decode has no staged bytes, prefill no ring)."""
    staged_bytes: int = 0
    """Prefill: bytes written into decode rings (every decode rank fed counts)."""
    scattered_bytes: int = 0
    """Decode: ring bytes scattered into the KV pool."""
    chunks: int = 0
    """Prefill: chunks staged; decode: chunks scattered."""
    rooms: tuple[RoomCount, ...] = ()
    latency_buckets: tuple[int, ...] = (0,) * _BUCKETS
    """Successful rooms per latency bucket (not cumulative; ``LATENCY_BUCKETS_S``, +Inf)."""
    latency_sum_s: float = 0.0
    latency_count: int = 0
    ring_in_use_bytes: int = 0
    """Decode: ring bytes in use now, at most the ring's size (the regions their writers may
    write; see :attr:`~staging_contracts._staging.allocator.StagingAllocator.in_use_bytes`)."""
    ring_reserved_bytes: int = 0
    """Decode: bytes of the regions assigned and not yet freed. The ring overcommits (regions
    of the next round are handed out over ones still in use), so this may exceed the ring."""
    ring_capacity_bytes: int = 0
    """Decode: the ring's size."""
    control: tuple[ControlCount, ...] = ()
    malformed: int = 0
    """Messages the listener dropped as malformed."""
    unauthorized: int = 0
    """Messages an authoriser refused (with the cluster secret)."""
    dropped: int = 0
    """Well-formed staging messages dropped (no handler, unknown room or chunk)."""
    peers_declared_dead: int = 0
    fences_outstanding: int = 0
    """Decode: rooms whose regions wait for a fence's answers."""


def snapshot_of(
    manager: CommonKVManager,
    *,
    transfers: PrefillTransfers | None = None,
    role: str | None = None,
    rank: int | None = None,
    engine: str | None = None,
) -> MetricsSnapshot:
    """Read ``manager``'s counters now (``transfers``: the prefill side's rooms and bytes).

    The decode handler is the one attached to ``manager`` (none before the staging set-up:
    its series read 0). The labels default to the manager's role, engine rank and engine
    name (``"local"``, ``"mooncake"``, ``"nixl"``: the name the CLI's ``--backend`` takes; an
    engine not among :data:`~staging_contracts.engines.ENGINES` by its class name).

    **Called by:** a metrics collector or a rank's reporting loop, any thread. **Blocking:**
    no (short lock holds for copies).
    """
    listener = manager.listener.stats()
    staging = manager.staging_stats()  # type: ignore[attr-defined]
    handler = getattr(manager, "_staging_handler", None)
    tally = None
    staged = scattered = chunks = in_use = reserved = capacity = fences = 0
    if isinstance(handler, DecodeStagingHandler):
        tally = handler.room_tally()
        scattered, chunks = handler.scattered_bytes, handler.chunks_scattered
        allocator = handler.allocator
        in_use, reserved = allocator.in_use_bytes, allocator.live_bytes
        capacity = allocator.total_size
        fences = len(handler.fenced_rooms)
    if transfers is not None:
        tally = transfers.room_tally()
        staged, chunks = transfers.writer.bytes_written, transfers.writer.chunks_written
    control = tuple(ControlCount(k, n) for k, n in sorted(manager.control_counts().items()))
    return MetricsSnapshot(
        role=role if role is not None else manager.role.value,
        rank=rank if rank is not None else manager.kv_args.engine_rank,
        engine=engine if engine is not None else engine_name(manager.engine),
        side=manager.role.value,
        staged_bytes=staged,
        scattered_bytes=scattered,
        chunks=chunks,
        rooms=() if tally is None else tuple(RoomCount(*item) for item in tally.ended),
        latency_buckets=(0,) * _BUCKETS if tally is None else tally.latency_buckets,
        latency_sum_s=0.0 if tally is None else tally.latency_sum_s,
        latency_count=0 if tally is None else tally.latency_count,
        ring_in_use_bytes=in_use,
        ring_reserved_bytes=reserved,
        ring_capacity_bytes=capacity,
        control=control,
        malformed=listener.malformed,
        unauthorized=manager.unauthorized,
        dropped=staging.dropped,
        peers_declared_dead=manager.liveness.declared_dead,
        fences_outstanding=fences,
    )


def engine_name(engine: object) -> str:
    """The name of ``engine`` as :data:`~staging_contracts.engines.ENGINES` (and the CLI's
    ``--backend``) spell it (``"nixl"``), else its class name."""
    cls = type(engine)
    for name, spec in ENGINES.items():
        if spec.class_name == cls.__name__ and spec.module == cls.__module__:
            return name
    return cls.__name__
