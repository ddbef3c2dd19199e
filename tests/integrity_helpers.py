"""Shared by the integrity tests: a region's allocation, and a late write into it."""

from __future__ import annotations

import torch

from tests.local_cluster import LocalCluster, wait_for

__all__ = ["land_first_then_late_then_second", "land_late", "region_of"]


def region_of(cluster: LocalCluster, room: int, chunk_idx: int = 0) -> tuple[int, int, int]:
    """(offset, end, round) of a chunk's live region on decode rank 0."""
    handler = cluster.handlers[0]
    with handler._lock:
        allocation = handler._rooms[room].regions[chunk_idx].allocation
    return allocation.offset, allocation.end, allocation.round


def land_late(cluster: LocalCluster, offset: int, nbytes: int) -> None:
    """What a paused writer's late write does: other bytes land in a ring region."""
    ring = cluster.handlers[0].allocator.buffer
    ring[offset : offset + nbytes] = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8) ^ 0x5A


def land_first_then_late_then_second(cluster: LocalCluster, room: int) -> None:
    """P=2 -> D=1: writer 0 lands and arrives, a late write lands over its bytes, then writer 1
    completes the region."""
    (request,) = [r for r in cluster.requests if r.room == room]
    (chunk,) = request.chunks()
    first, second = cluster.writers
    for writer in (first, second):
        writer.prefetch(room, [(chunk.chunk_idx, len(chunk.pages))], cluster.targets)
    first.send_chunk(room, chunk, cluster.targets)
    assert wait_for(lambda: cluster.decode[0].staging_stats().arrivals >= 1)
    offset, _, _ = region_of(cluster, room)
    land_late(cluster, offset, 256)
    second.send_chunk(room, chunk, cluster.targets)
