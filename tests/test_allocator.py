"""Tests of the decode staging ring allocator."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from staging_contracts._staging.allocator import (
    ALLOC_OVERSIZED,
    StagingAllocator,
    is_watermark_ready,
)
from staging_contracts.protocols import Allocation, StagingRing, Watermark


def test_satisfies_staging_ring() -> None:
    """Satisfies the StagingRing protocol the decode handler types against."""
    ring: StagingRing = StagingAllocator(64)
    assert ring.total_size == 64
    assert ring.live_count == 0


def test_buffer_is_one_uint8_tensor() -> None:
    """Owns one uint8 tensor of total_size bytes whose address is base_ptr."""
    ring = StagingAllocator(128)
    assert ring.buffer.dtype == torch.uint8
    assert ring.buffer.shape == (128,)
    assert ring.buffer.device == torch.device("cpu")
    assert ring.base_ptr == ring.buffer.data_ptr()


def test_assigns_back_to_back_then_wraps() -> None:
    """Takes regions at the head, and wraps into a new round when the tail is too short."""
    ring = StagingAllocator(100)
    assert ring.assign(40) == Allocation(0, 0, 0, 40)
    assert ring.assign(50) == Allocation(1, 40, 0, 90)
    assert ring.assign(20) == Allocation(2, 0, 1, 20)
    assert ring.live_count == 3


def test_oversized_returns_none() -> None:
    """Answers None for a region larger than the ring, leaving the state alone."""
    ring = StagingAllocator(100)
    assert ring.assign(101) is None
    assert ring.assign(100) == Allocation(0, 0, 0, 100)
    assert ALLOC_OVERSIZED == -2


def test_rejects_non_positive_size() -> None:
    """Rejects an empty or negative region."""
    ring = StagingAllocator(100)
    with pytest.raises(ValueError, match=r"^size=0 must be >= 1$"):
        ring.assign(0)


def test_rejects_non_positive_total_size() -> None:
    """Rejects a ring of no bytes."""
    with pytest.raises(ValueError, match=r"^total_size=0 must be >= 1$"):
        StagingAllocator(0)


def test_watermark_follows_oldest_live() -> None:
    """Moves the watermark to the oldest live allocation when the oldest is freed."""
    ring = StagingAllocator(100)
    first, second, third = (ring.assign(30) for _ in range(3))
    assert first is not None
    assert second is not None
    assert third is not None
    ring.free(second.alloc_id)
    assert ring.get_watermark() == Watermark(0, 0)
    ring.free(first.alloc_id)
    assert ring.get_watermark() == Watermark(0, 60)


def test_empty_ring_starts_fresh_round() -> None:
    """Starts a fresh round at offset 0 when the last live allocation is freed."""
    ring = StagingAllocator(100)
    a = ring.assign(70)
    assert a is not None
    ring.free(a.alloc_id)
    assert ring.get_watermark() == Watermark(1, 0)
    b = ring.assign(70)
    assert b == Allocation(1, 0, 1, 70)
    assert ring.is_ready(b)


def test_free_unknown_id_is_noop() -> None:
    """Ignores an unknown or already freed id."""
    ring = StagingAllocator(100)
    a = ring.assign(10)
    assert a is not None
    ring.free(99)
    ring.free(a.alloc_id)
    ring.free(a.alloc_id)
    assert ring.get_watermark() == Watermark(1, 0)
    assert ring.live_count == 0


def test_readiness_rule() -> None:
    """Applies the SPEC readiness rule to the previous round against the watermark."""
    assert is_watermark_ready(Watermark(0, 0), 0, 100)
    assert is_watermark_ready(Watermark(1, 0), 1, 100)
    assert is_watermark_ready(Watermark(0, 50), 1, 50)
    assert not is_watermark_ready(Watermark(0, 50), 1, 51)
    assert not is_watermark_ready(Watermark(0, 50), 2, 1)


def test_round_zero_is_ready_against_any_watermark() -> None:
    """Makes a region of round 0 or earlier ready whatever the watermark holds."""
    assert is_watermark_ready(Watermark(-1, -1), 0, 100)
    assert is_watermark_ready(Watermark(-5, 0), -1, 100)


def test_concurrent_assign_and_free() -> None:
    """Keeps ids unique and the ring consistent under concurrent threads."""
    ring = StagingAllocator(1 << 16)
    ids: list[list[int]] = [[] for _ in range(4)]

    def work(slot: int) -> None:
        for _ in range(2000):
            a = ring.assign(7)
            assert a is not None
            ids[slot].append(a.alloc_id)
            ring.free(a.alloc_id)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [i for slot in ids for i in slot]
    assert len(set(every)) == len(every) == 8000
    assert ring.live_count == 0
    assert ring.get_watermark().tail == 0


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("assign"), st.integers(1, 80)),
        st.tuples(st.just("free"), st.integers(0, 40)),
        st.tuples(st.just("free-oldest"), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(total_size=st.integers(1, 64), ops=OPS)
def test_safety_and_liveness(total_size: int, ops: list[tuple[str, int]]) -> None:
    """Never reports ready a region over older-round live data; an empty ring never blocks."""
    ring = StagingAllocator(total_size)
    live: dict[int, Allocation] = {}
    for op, value in ops:
        if op == "assign":
            was_empty = not live
            a = ring.assign(value)
            if value > total_size:
                assert a is None
                continue
            assert a is not None
            live[a.alloc_id] = a
            if was_empty:
                assert ring.is_ready(a), "liveness: a region of an empty ring is ready"
        else:
            alloc_id = min(live, default=-1) if op == "free-oldest" else value
            ring.free(alloc_id)
            live.pop(alloc_id, None)
        assert ring.live_count == len(live)
        watermark = ring.get_watermark()
        for a in live.values():
            if not is_watermark_ready(watermark, a.round, a.end):
                continue
            for other in live.values():
                if other.round < a.round:
                    assert other.end <= a.offset or a.end <= other.offset, (
                        f"safety: ready {a} overlaps live {other} at {watermark}"
                    )


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 64), min_size=1, max_size=40), total_size=st.integers(1, 64))
def test_liveness_after_draining(sizes: list[int], total_size: int) -> None:
    """Makes every new region ready once all live regions have been freed."""
    ring = StagingAllocator(total_size)
    taken = [ring.assign(size) for size in sizes]
    for a in taken:
        if a is not None:
            ring.free(a.alloc_id)
    assert ring.live_count == 0
    for size in sizes:
        a = ring.assign(size)
        if a is None:
            continue
        assert ring.is_ready(a)
        ring.free(a.alloc_id)


def test_free_is_amortized_constant_in_any_order() -> None:
    """Keeps the watermark exact when allocations are freed newest first."""
    ring = StagingAllocator(1 << 20)
    taken = [ring.assign(8) for _ in range(1000)]
    for a in reversed(taken[1:]):
        assert a is not None
        ring.free(a.alloc_id)
        assert ring.get_watermark() == Watermark(0, 0)
    first = taken[0]
    assert first is not None
    ring.free(first.alloc_id)
    assert ring.get_watermark() == Watermark(1, 0)


def test_live_and_peak_bytes_follow_assign_and_free() -> None:
    """Counts the bytes of live regions, and keeps the most ever live at once."""
    ring = StagingAllocator(100)
    assert (ring.live_bytes, ring.peak_bytes) == (0, 0)
    first = ring.assign(40)
    second = ring.assign(50)
    assert first is not None
    assert second is not None
    assert (ring.live_bytes, ring.peak_bytes) == (90, 90)
    ring.free(first.alloc_id)
    assert (ring.live_bytes, ring.peak_bytes) == (50, 90)
    third = ring.assign(20)
    assert third is not None
    assert (ring.live_bytes, ring.peak_bytes) == (70, 90)
    assert ring.assign(101) is None
    ring.free(first.alloc_id)
    ring.free(12345)
    assert (ring.live_bytes, ring.peak_bytes) == (70, 90)
    ring.free(second.alloc_id)
    ring.free(third.alloc_id)
    assert (ring.live_bytes, ring.peak_bytes) == (0, 90)
    fourth = ring.assign(100)
    assert fourth is not None
    assert (ring.live_bytes, ring.peak_bytes) == (100, 100)


def take(ring: StagingAllocator, size: int) -> Allocation:
    """Assigns a region that must fit."""
    allocation = ring.assign(size)
    assert allocation is not None
    return allocation


def test_is_ready_compares_the_end_with_the_tail_in_the_same_round() -> None:
    """Makes a wrapped region ready once the watermark's tail in the previous round passes it."""
    ring = StagingAllocator(100)
    a, b, c = take(ring, 60), take(ring, 30), take(ring, 50)
    assert (a, b, c) == (Allocation(0, 0, 0, 60), Allocation(1, 60, 0, 90), Allocation(2, 0, 1, 50))
    assert not ring.is_ready(c)
    ring.free(a.alloc_id)
    assert ring.get_watermark() == Watermark(0, 60)
    assert ring.is_ready(c)
    d = take(ring, 10)
    assert d == Allocation(3, 50, 1, 60)
    assert ring.is_ready(d)
    e = take(ring, 1)
    assert e == Allocation(4, 60, 1, 61)
    assert not ring.is_ready(e)
    ring.free(b.alloc_id)
    assert ring.get_watermark() == Watermark(1, 0)
    assert ring.is_ready(e)


def test_repr_shows_the_ring_state() -> None:
    """Shows size, device, live count, round, head and watermark."""
    ring = StagingAllocator(100)
    assert repr(ring) == (
        "StagingAllocator(total_size=100, device=cpu, live=0, round=0, head=0, watermark=(0, 0))"
    )
    a = take(ring, 60)
    take(ring, 30)
    take(ring, 50)
    ring.free(a.alloc_id)
    assert repr(ring) == (
        "StagingAllocator(total_size=100, device=cpu, live=2, round=1, head=50, watermark=(0, 60))"
    )


def test_one_byte_ring_is_accepted() -> None:
    """Accepts the smallest ring, one byte, and wraps a new round per region."""
    ring = StagingAllocator(1)
    assert ring.total_size == 1
    assert ring.assign(1) == Allocation(0, 0, 0, 1)
    assert ring.assign(1) == Allocation(1, 0, 1, 1)
    assert ring.assign(2) is None


def test_buffer_lives_on_the_given_device() -> None:
    """Allocates the ring on the device it is given (here torch's meta device)."""
    ring = StagingAllocator(16, device="meta")
    assert ring.device == torch.device("meta")
    assert ring.buffer.device == torch.device("meta")
    assert ring.buffer.shape == (16,)
    assert repr(ring).startswith("StagingAllocator(total_size=16, device=meta, live=0,")


def test_in_use_bytes_leave_out_regions_waiting_for_the_bytes_under_them() -> None:
    """Overcommit: a region of the next round over a live one is reserved, not in use, until
    the bytes under it are freed; the bytes in use never exceed the ring."""
    ring = StagingAllocator(100)
    first, second = take(ring, 60), take(ring, 40)
    ahead = take(ring, 50)  # round 1, over `first`: waits for it
    assert (ring.live_bytes, ring.in_use_bytes) == (150, 100)
    ring.free(first.alloc_id)  # the watermark passes `ahead`'s end: writable now
    assert (ring.live_bytes, ring.in_use_bytes) == (90, 90)
    ring.free(second.alloc_id)
    ring.free(ahead.alloc_id)
    assert (ring.live_bytes, ring.in_use_bytes) == (0, 0)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(min_value=1, max_value=64),
    st.lists(st.tuples(st.sampled_from(["assign", "free"]), st.integers(1, 64)), max_size=60),
)
def test_in_use_bytes_never_exceed_the_ring(total_size: int, ops: list[tuple[str, int]]) -> None:
    """Whatever the order of assigns and frees, the bytes in use fit the ring and are part of
    the bytes reserved."""
    ring = StagingAllocator(total_size)
    live: list[Allocation] = []
    for op, n in ops:
        if op == "assign":
            allocation = ring.assign(n)
            if allocation is not None:
                live.append(allocation)
        elif live:
            ring.free(live.pop(n % len(live)).alloc_id)
        assert 0 <= ring.in_use_bytes <= min(total_size, ring.live_bytes)
