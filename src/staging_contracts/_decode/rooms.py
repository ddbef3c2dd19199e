"""Decode-side records of a room (one request) and of its chunks' ring regions.

Plain state, no I/O: :mod:`staging_contracts._decode.handler` owns the lock that guards it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..outcomes import FailureReason
from ..protocols import Allocation

if TYPE_CHECKING:
    import torch

__all__ = ["ChunkRegion", "PrefillPeer", "RoomPlan", "RoomState", "RoomStatus"]


@dataclass(frozen=True, slots=True)
class PrefillPeer:
    """One prefill rank that writes into this decode rank for a room."""

    tp_rank: int
    """Its attention-TP rank (the ``writer_rank`` its arrivals carry)."""
    endpoint: str
    """Its control listener, where ``STAGING_RSP`` and ``WATERMARK`` go."""
    pp_rank: int = 0
    """Its pipeline stage."""


@dataclass(frozen=True, slots=True)
class RoomPlan:
    """What decode registers for a room before telling prefill about it.

    **Side:** decode. **Called by:** the scheduler, when the request is admitted.
    """

    room: int
    """The request's bootstrap room."""
    page_indices: tuple[int, ...]
    """Decode KV-pool pages receiving the transferred tokens, in order (after any prefix)."""
    chunk_pages: int
    """Pages per chunk on the chunked-prefill grid; the last chunk holds the remainder."""
    prefill_tp: int
    """Attention TP size of the prefill side."""
    peers: tuple[PrefillPeer, ...]
    """The prefill ranks that write into this decode rank for the room."""
    prefix_tokens: int = 0
    """Tokens already in decode's cache before the transferred part (must be page-aligned)."""

    @property
    def num_chunks(self) -> int:
        """Chunks of the transfer."""
        return -(-len(self.page_indices) // self.chunk_pages)

    def chunk_page_count(self, chunk_idx: int) -> int:
        """Pages in chunk ``chunk_idx`` (the last one may be shorter)."""
        start = chunk_idx * self.chunk_pages
        return min(self.chunk_pages, len(self.page_indices) - start)


class RoomStatus(enum.Enum):
    """Where a room stands on decode."""

    REGISTERED = "registered"
    """Known; no region assigned yet."""
    TRANSFERRING = "transferring"
    """At least one chunk has a region or has been scattered."""
    SUCCESS = "success"
    """Every chunk has been scattered and its region freed."""
    FAILED = "failed"
    """Refused or broken; the reason is recorded. Its regions have been freed."""


@dataclass(slots=True)
class ChunkRegion:
    """The ring region of one chunk and the writers that have arrived in it."""

    allocation: Allocation
    num_pages: int
    page_start: int
    expected_writers: int
    arrived: set[int] = field(default_factory=set)
    """Writer ranks that signalled arrival."""
    anonymous: int = 0
    """Arrivals without a writer rank (reference-style single writers)."""
    digests: dict[int, str] = field(default_factory=dict)
    """Writer rank -> the digest its arrival's tag gave for its bytes (checked after scatter)."""

    @property
    def complete(self) -> bool:
        """All writers have arrived."""
        return len(self.arrived) + self.anonymous >= self.expected_writers


@dataclass(slots=True)
class RoomState:
    """Decode's bookkeeping for one room."""

    plan: RoomPlan
    pages: torch.Tensor
    """``plan.page_indices`` as an int64 tensor on the pool's device (sliced per chunk)."""
    writer_ranks: frozenset[int]
    """TP ranks of the prefill writers of this decode rank."""
    last_progress: float
    status: RoomStatus = RoomStatus.REGISTERED
    failure: str | None = None
    kind: FailureReason | None = None
    """Why it failed, typed where it failed (set with ``failure``)."""
    ended_at: tuple[float, float] | None = None
    """When it succeeded or failed (``time.monotonic()``, ``time.time()``)."""
    regions: dict[int, ChunkRegion] = field(default_factory=dict)
    """Chunks with a live region, waiting for their writers."""
    consumed: set[int] = field(default_factory=set)
    """Chunks scattered (their regions freed or being freed)."""
    scattering: int = 0
    """Scatters running outside the lock right now."""
    pending_events: list[tuple[object, int]] = field(default_factory=list)
    """CUDA scatters submitted and not yet complete: (event, alloc_id)."""
    closing: bool = False
    """Teardown started: arrivals are refused."""
    first_request: float | None = None
    """When its first ``STAGING_REQ`` came (the handler's clock), for the room's latency."""
    ended: bool = False
    """Its end (success or failure) was counted in the handler's room tally."""
    opening: int = 0
    """This registration of the room id (random, non-zero; carried by ``ROOM_META`` and
    ``ROOM_FAILED``, so a message of an earlier registration is told apart)."""
    failure_told: bool = False
    """Its ``ROOM_FAILED`` went to its prefill peers (``report_failure``: once)."""
    chunks_scattered: int = 0
    """Staged chunks scattered into the room's pages and checked."""
    bytes_scattered: int = 0
    """Their bytes (the regions' sizes)."""

    def held_allocations(self) -> list[int]:
        """Allocation ids this room still holds in the ring."""
        held = [region.allocation.alloc_id for region in self.regions.values()]
        held.extend(alloc_id for _, alloc_id in self.pending_events)
        return held
