"""The decode staging ring: a round-based ring allocator over one torch buffer (SPEC §2).

Decode assigns one region per (room, chunk); prefill ranks write into it once the ring's
**watermark** says the region's previous-round data has been freed
(:func:`is_watermark_ready`). ``assign`` never waits and never checks overlap (overcommit):
safety is the writer's readiness check.

**Overcommit, in figures.** A region of the next round is handed out over one still in use;
its writer waits until the watermark says the bytes under it were freed. So the bytes
*reserved* (assigned and not yet freed: :attr:`StagingAllocator.live_bytes`,
:attr:`StagingAllocator.peak_bytes`) may exceed the ring, by as many rounds as regions are
reserved ahead (twice the ring when four chunks are requested at once of a two-chunk ring),
while the bytes written and not yet scattered never do. A reserved peak above the ring is
that look-ahead, not an overflow.

**Better** than the reference: ``assign`` is O(1) and ``free`` amortized O(1) at any number of
live allocations (the reference pops from the front of a list), every operation is
thread-safe, and an emptied ring starts a fresh round so that the next wrapped writer is never
blocked by a stale watermark.
"""

from __future__ import annotations

import threading
from typing import Final

import torch

from ..protocols import Allocation, Watermark

__all__ = ["ALLOC_OVERSIZED", "StagingAllocator", "is_watermark_ready"]

# ``tuple.__new__(Record, fields)`` builds a NamedTuple without its Python-level ``__new__``:
# half the cost, which is a fifth of an assign + free.
_new_record = tuple.__new__

ALLOC_OVERSIZED: Final = -2
"""``STAGING_RSP`` offset meaning the chunk can never fit the ring (with ``round = 0``,
``end = -1``)."""


def is_watermark_ready(watermark: Watermark, alloc_round: int, alloc_end: int) -> bool:
    """May a region of ring round ``alloc_round`` ending at ``alloc_end`` be written now?

    Ready if ``alloc_round <= 0``; otherwise, with ``prev = alloc_round - 1``, ready iff
    ``prev < watermark.round``, or ``prev == watermark.round`` and
    ``alloc_end <= watermark.tail``.

    **Side:** prefill, before gathering into and writing a region. Pure; thread-safe.

    Args:
        watermark: the latest watermark seen from the decode session.
        alloc_round: the region's round (from ``STAGING_RSP``).
        alloc_end: the region's end offset (exclusive).

    Returns:
        ``True`` when the previous round's data under the region has been freed.
    """
    if alloc_round <= 0:
        return True
    prev = alloc_round - 1
    return prev < watermark.round or (prev == watermark.round and alloc_end <= watermark.tail)


class StagingAllocator:
    """The decode-side staging ring over one ``uint8`` tensor of ``total_size`` bytes.

    **Side:** decode. **Called by:** the listener thread (``assign`` on ``STAGING_REQ``) and
    the scatter-completion path (``free``). **Blocking:** never (a short internal lock).
    **Thread-safety:** every method and property is safe to call from any thread.

    Args:
        total_size: ring size in bytes (>= 1).
        device: device of the ring buffer (``"cpu"``, ``"cuda:0"``, ...).

    Raises:
        ValueError: ``total_size < 1``.
    """

    __slots__ = (
        "_buffer",
        "_head",
        "_live",
        "_live_bytes",
        "_lock",
        "_next_id",
        "_oldest",
        "_peak_bytes",
        "_round",
        "_sizes",
        "_total_size",
        "_watermark",
    )

    def __init__(self, total_size: int, device: str | torch.device = "cpu") -> None:
        if total_size < 1:
            raise ValueError(f"total_size={total_size!r} must be >= 1")
        self._total_size = total_size
        # Zeroed rather than empty: on CPU every page is touched now, at start-up, instead of
        # faulting in on the first write into each region (inside a transfer).
        self._buffer = torch.zeros(total_size, dtype=torch.uint8, device=device)
        self._lock = threading.Lock()
        self._head = 0
        self._round = 0
        self._next_id = 0
        # Live allocations: alloc_id -> the watermark it holds back, (round, offset). Ids grow
        # by one per assign, so allocation order is id order and the oldest live id is found
        # by walking forward from the previous oldest (amortized O(1)).
        self._live: dict[int, Watermark] = {}
        self._sizes: dict[int, int] = {}
        self._live_bytes = 0
        self._peak_bytes = 0
        self._oldest = 0
        self._watermark = Watermark(0, 0)

    @property
    def total_size(self) -> int:
        """Ring size in bytes."""
        return self._total_size

    @property
    def buffer(self) -> torch.Tensor:
        """The ring: a 1-D ``uint8`` tensor of ``total_size`` bytes, owned by the allocator."""
        return self._buffer

    @property
    def base_ptr(self) -> int:
        """Address of the ring buffer (``buffer.data_ptr()``), registered with the engine."""
        return int(self._buffer.data_ptr())

    @property
    def device(self) -> torch.device:
        """Device of the ring buffer."""
        return self._buffer.device

    @property
    def live_count(self) -> int:
        """Allocations assigned and not yet freed."""
        with self._lock:
            return len(self._live)

    @property
    def live_bytes(self) -> int:
        """Bytes of the allocations assigned and not yet freed (reserved; with overcommit,
        possibly more than :attr:`total_size`)."""
        with self._lock:
            return self._live_bytes

    @property
    def in_use_bytes(self) -> int:
        """Bytes of the ring in use now: the live allocations the watermark lets their
        writers write (those of a later round that still wait for the bytes under them are
        not counted). They never overlap, so this is at most :attr:`total_size`, unlike
        :attr:`live_bytes`. O(live allocations): for monitoring, not the hot path."""
        with self._lock:
            watermark = self._watermark
            return sum(
                self._sizes[alloc_id]
                for alloc_id, (alloc_round, offset) in self._live.items()
                if is_watermark_ready(watermark, alloc_round, offset + self._sizes[alloc_id])
            )

    @property
    def peak_bytes(self) -> int:
        """The most bytes ever reserved at once: the **reserved peak**, the most of
        :attr:`live_bytes`. Regions of later rounds count from their ``assign``, before
        their writers may write (they wait for the watermark), so this may exceed
        :attr:`total_size` (see the module docstring); it is not the bytes in use."""
        with self._lock:
            return self._peak_bytes

    def assign(self, size: int) -> Allocation | None:
        """Take a region of ``size`` bytes at the ring's head, wrapping to a new round if needed.

        Never waits and never checks overlap with live regions (overcommit): writers check
        readiness against the watermark.

        Args:
            size: bytes of the region (>= 1).

        Returns:
            The region, or ``None`` when ``size > total_size`` (it can never fit; the caller
            answers ``ALLOC_OVERSIZED``).

        Raises:
            ValueError: ``size < 1``.
        """
        if size < 1:
            raise ValueError(f"size={size!r} must be >= 1")
        if size > self._total_size:
            return None
        with self._lock:
            offset = self._head
            if size <= self._total_size - offset:
                self._head = offset + size
            else:
                self._round += 1
                offset = 0
                self._head = size
            alloc_id = self._next_id
            self._next_id = alloc_id + 1
            alloc_round = self._round
            self._live[alloc_id] = _new_record(Watermark, (alloc_round, offset))
            self._sizes[alloc_id] = size
            self._live_bytes += size
            self._peak_bytes = max(self._peak_bytes, self._live_bytes)
        return _new_record(Allocation, (alloc_id, offset, alloc_round, offset + size))

    def free(self, alloc_id: int) -> None:
        """Release a region and move the watermark (unknown ids are ignored).

        If nothing is live afterwards, a fresh round starts: ``round += 1``, head 0, watermark
        ``(round, 0)``. Otherwise the watermark is the (round, offset) of the oldest live
        allocation.

        Args:
            alloc_id: the id from :meth:`assign`.
        """
        with self._lock:
            live = self._live
            if live.pop(alloc_id, None) is None:
                return
            self._live_bytes -= self._sizes.pop(alloc_id)
            if not live:
                self._round += 1
                self._head = 0
                self._oldest = self._next_id
                self._watermark = Watermark(self._round, 0)
                return
            oldest = self._oldest
            if alloc_id != oldest:
                return
            oldest += 1
            while oldest not in live:
                oldest += 1
            self._oldest = oldest
            self._watermark = live[oldest]

    def get_watermark(self) -> Watermark:
        """The current watermark (changes on ``free`` only).

        Returns:
            ``(round, tail)``: everything of earlier rounds, and of ``round`` before ``tail``,
            has been freed.
        """
        with self._lock:
            return self._watermark

    def is_ready(self, allocation: Allocation) -> bool:
        """Whether ``allocation`` may be written against the current watermark.

        Args:
            allocation: a region from :meth:`assign`.

        Returns:
            :func:`is_watermark_ready` of the current watermark.
        """
        return is_watermark_ready(self.get_watermark(), allocation.round, allocation.end)

    def __repr__(self) -> str:
        with self._lock:
            return (
                f"StagingAllocator(total_size={self._total_size}, device={self.device!s}, "
                f"live={len(self._live)}, round={self._round}, head={self._head}, "
                f"watermark={tuple(self._watermark)})"
            )
