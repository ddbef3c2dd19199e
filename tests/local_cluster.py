"""Test support: prefill and decode ranks as LocalKVManagers in one process, real ZMQ sockets.

The expected decode pools are computed here from first principles (which global head each
rank holds), independently of ``layout.py``, so that the tests check the layout math too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from staging_contracts import KVArgsRecord, KVBufferTensors
from staging_contracts._decode.handler import DecodeStagingHandler, RoomPlan, RoomStatus, peers_for
from staging_contracts._prefill.writer import (
    ChunkSpec,
    DecodeTarget,
    PrefillTimeouts,
    StagingWriter,
)
from staging_contracts.backends._common import Role
from staging_contracts.backends._kv_requests import (
    DecodeTransfers,
    KVPoll,
    KVReceiver,
    KVSender,
    PrefillTransfers,
)
from staging_contracts.backends._staging_setup import enable_decode_staging, enable_prefill_staging
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.protocols import ArrivalMode


def rank_heads(total_heads: int, tp: int, rank: int) -> list[int]:
    """Global heads held by a rank (GQA replication when there are fewer heads than ranks)."""
    if total_heads >= tp:
        per = total_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // total_heads)]


@dataclass
class Geometry:
    """Model and transfer sizes of a test."""

    prefill_tp: int
    decode_tp: int
    total_heads: int
    layers: int = 2
    head_dim: int = 8
    page_size: int = 4
    pool_pages: int = 64
    dtype: torch.dtype = torch.bfloat16

    def kv_args(self, tp: int, rank: int) -> KVArgsRecord:
        heads = len(rank_heads(self.total_heads, tp, rank))
        item = (
            self.page_size
            * heads
            * self.head_dim
            * torch.empty((), dtype=self.dtype).element_size()
        )
        return KVArgsRecord(
            page_size=self.page_size,
            kv_item_lens=(item,) * (2 * self.layers),
            engine_rank=rank,
            device="cpu",
            total_kv_head_num=self.total_heads,
            kv_head_num=heads,
            kv_layer_ids=tuple(range(self.layers)),
        )

    def empty_pool(self, tp: int, rank: int) -> KVBufferTensors:
        heads = len(rank_heads(self.total_heads, tp, rank))
        shape = (self.pool_pages * self.page_size, heads, self.head_dim)
        return KVBufferTensors(
            tuple(torch.zeros(shape, dtype=self.dtype) for _ in range(self.layers)),
            tuple(torch.zeros(shape, dtype=self.dtype) for _ in range(self.layers)),
            self.page_size,
        )


@dataclass
class Request:
    """One request: its global KV data and the pages it occupies on each side."""

    room: int
    num_pages: int
    chunk_pages: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    prefill_pages: tuple[int, ...]
    decode_pages: tuple[int, ...]

    def chunks(self) -> list[ChunkSpec]:
        out = []
        for index, start in enumerate(range(0, self.num_pages, self.chunk_pages)):
            pages = self.prefill_pages[start : start + self.chunk_pages]
            out.append(ChunkSpec(index, start, pages))
        return out


def make_request(
    geometry: Geometry, room: int, num_pages: int, chunk_pages: int, seed: int, used: set[int]
) -> Request:
    """A request with random global KV data and random free pages on both sides."""
    gen = torch.Generator().manual_seed(seed)
    tokens = num_pages * geometry.page_size
    shape = (tokens, geometry.total_heads, geometry.head_dim)
    element = torch.empty((), dtype=geometry.dtype).element_size()
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[element]
    low, high = (0, 255) if element == 1 else (-(2**14), 2**14)

    def data() -> torch.Tensor:
        return torch.randint(low, high, shape, generator=gen).to(int_dtype).view(geometry.dtype)

    free = [p for p in torch.randperm(geometry.pool_pages, generator=gen).tolist() if p not in used]
    prefill_pages = tuple(free[:num_pages])
    decode_pages = tuple(free[num_pages : 2 * num_pages])
    used.update(prefill_pages)
    used.update(decode_pages)
    return Request(
        room,
        num_pages,
        chunk_pages,
        [data() for _ in range(geometry.layers)],
        [data() for _ in range(geometry.layers)],
        prefill_pages,
        decode_pages,
    )


def _place(pool: KVBufferTensors, request: Request, pages: Sequence[int], heads: list[int]) -> None:
    ps = pool.page_size
    index = torch.tensor([p * ps + t for p in pages for t in range(ps)])
    for layer in range(len(pool.k_buffers)):
        pool.k_buffers[layer][index] = request.k[layer][:, heads]
        pool.v_buffers[layer][index] = request.v[layer][:, heads]


@dataclass
class LocalCluster:
    """P prefill and D decode LocalKVManagers wired together (listeners started)."""

    geometry: Geometry
    prefill: list[LocalKVManager]
    decode: list[LocalKVManager]
    writers: list[StagingWriter]
    handlers: list[DecodeStagingHandler]
    prefill_pools: list[KVBufferTensors]
    decode_pools: list[KVBufferTensors]
    targets: list[DecodeTarget]
    requests: list[Request] = field(default_factory=list)

    def add_request(self, room: int, num_pages: int, chunk_pages: int, seed: int = 0) -> Request:
        used: set[int] = set()
        for known in self.requests:
            used.update(known.prefill_pages)
            used.update(known.decode_pages)
        request = make_request(self.geometry, room, num_pages, chunk_pages, seed, used)
        g = self.geometry
        for p, pool in enumerate(self.prefill_pools):
            _place(pool, request, request.prefill_pages, rank_heads(g.total_heads, g.prefill_tp, p))
        endpoints = [m.endpoint for m in self.prefill]
        for d, handler in enumerate(self.handlers):
            handler.register_room(
                RoomPlan(
                    room,
                    request.decode_pages,
                    chunk_pages,
                    g.prefill_tp,
                    peers_for(endpoints, g.prefill_tp, g.decode_tp, d),
                )
            )
        self.requests.append(request)
        return request

    def expected_decode_pool(self, rank: int) -> KVBufferTensors:
        g = self.geometry
        pool = g.empty_pool(g.decode_tp, rank)
        for request in self.requests:
            _place(
                pool, request, request.decode_pages, rank_heads(g.total_heads, g.decode_tp, rank)
            )
        return pool

    def send_all(
        self, requests: Sequence[Request], *, order: str = "forward"
    ) -> list[BaseException]:
        """Run every prefill rank's chunks of the requests in its own thread; return errors."""
        errors: list[BaseException] = []

        def work(writer: StagingWriter) -> None:
            for request in requests:
                chunks = request.chunks()
                writer.prefetch(
                    request.room, [(c.chunk_idx, len(c.pages)) for c in chunks], self.targets
                )
                if order == "reverse":
                    chunks.reverse()
                for chunk in chunks:
                    try:
                        writer.send_chunk(request.room, chunk, self.targets)
                    except Exception as exc:  # noqa: BLE001 - collected for the test to assert on
                        errors.append(exc)
                        break

        threads = [threading.Thread(target=work, args=(w,)) for w in self.writers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        return errors

    def wait_rooms(
        self, rooms: Sequence[int], timeout: float = 20.0
    ) -> dict[int, list[RoomStatus | None]]:
        """Poll every decode handler until the rooms finish (success or failure)."""
        deadline = time.monotonic() + timeout
        while True:
            status = {room: [h.poll_room(room) for h in self.handlers] for room in rooms}
            done = all(
                s in (RoomStatus.SUCCESS, RoomStatus.FAILED) for v in status.values() for s in v
            )
            if done or time.monotonic() > deadline:
                return status
            time.sleep(0.005)

    def release(self, rooms: Sequence[int]) -> None:
        for room in rooms:
            for handler in self.handlers:
                handler.release_room(room)
            for writer in self.writers:
                writer.forget_room(room)


def wait_for(predicate: object, timeout: float = 5.0) -> bool:
    """Poll a zero-argument predicate until it holds or ``timeout`` passes."""
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return bool(predicate())


def trust_each_other(*managers: LocalKVManager) -> None:
    """Every manager trusts every other's CURVE key (as the bootstrap would tell them; a
    no-op without a cluster secret)."""
    for manager in managers:
        for peer in managers:
            if peer is not manager:
                manager.trust_peer(peer.endpoint, peer.curve_key)


def pools_equal(a: KVBufferTensors, b: KVBufferTensors) -> bool:
    """Bit-exact equality of two pools."""

    def bits(t: torch.Tensor) -> torch.Tensor:
        element = t.element_size()
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[element])

    pairs = zip((*a.k_buffers, *a.v_buffers), (*b.k_buffers, *b.v_buffers), strict=True)
    return all(torch.equal(bits(x), bits(y)) for x, y in pairs)


@contextmanager
def local_cluster(
    geometry: Geometry,
    *,
    ring_bytes: int = 1 << 20,
    max_chunk_pages: int = 8,
    timeouts: PrefillTimeouts | None = None,
    arrival: ArrivalMode | None = None,
) -> Iterator[LocalCluster]:
    """Build, start and finally close a cluster."""
    g = geometry
    prefill = [
        LocalKVManager(g.kv_args(g.prefill_tp, p), role=Role.PREFILL, attn_tp_size=g.prefill_tp)
        for p in range(g.prefill_tp)
    ]
    decode = [
        LocalKVManager(g.kv_args(g.decode_tp, d), role=Role.DECODE, attn_tp_size=g.decode_tp)
        for d in range(g.decode_tp)
    ]
    try:
        prefill_pools = [g.empty_pool(g.prefill_tp, p) for p in range(g.prefill_tp)]
        decode_pools = [g.empty_pool(g.decode_tp, d) for d in range(g.decode_tp)]
        handlers = [
            enable_decode_staging(m, kv_buffers=pool, ring_bytes=ring_bytes)
            for m, pool in zip(decode, decode_pools, strict=True)
        ]
        writers = [
            enable_prefill_staging(
                m,
                kv_buffers=pool,
                max_chunk_pages=max_chunk_pages,
                timeouts=timeouts,
                arrival=arrival,
            )
            for m, pool in zip(prefill, prefill_pools, strict=True)
        ]
        trust_each_other(*prefill, *decode)
        for m in (*prefill, *decode):
            m.start()
        targets = []
        for d, m in enumerate(decode):
            ctx = m._staging_ctx
            allocator = handlers[d]._allocator
            targets.append(
                DecodeTarget(d, m.engine.session_id, m.endpoint, allocator.base_ptr, ring_bytes)
            )
            for p in prefill:
                p.engine.add_peer(m.engine.session_id, m.engine.metadata())
            del ctx
        yield LocalCluster(
            g, prefill, decode, writers, handlers, prefill_pools, decode_pools, targets
        )
    finally:
        for manager in (*prefill, *decode):
            manager.close()


@dataclass
class Sides:
    """A local cluster with the per-request layer on top."""

    cluster: LocalCluster
    prefill: list[PrefillTransfers]
    decode: list[DecodeTransfers]


@contextmanager
def sides(
    geometry: Geometry,
    *,
    ring_bytes: int = 1 << 20,
    timeouts: PrefillTimeouts | None = None,
    meta_timeout_s: float = 2.0,
    arrival: ArrivalMode | None = None,
) -> Iterator[Sides]:
    """Per-request transfers for every rank of a local cluster (``arrival``: the writers'
    arrival mode, ``None``: the manager's)."""
    with local_cluster(
        geometry, ring_bytes=ring_bytes, timeouts=timeouts, arrival=arrival
    ) as cluster:
        endpoints = [m.endpoint for m in cluster.prefill]
        prefill = [
            PrefillTransfers(m, w, meta_timeout_s=meta_timeout_s)
            for m, w in zip(cluster.prefill, cluster.writers, strict=True)
        ]
        decode = [
            DecodeTransfers(m, h, endpoints)
            for m, h in zip(cluster.decode, cluster.handlers, strict=True)
        ]
        try:
            yield Sides(cluster, prefill, decode)
        finally:
            for transfers in prefill:
                transfers.close()


def wait_states(requests: list[KVSender] | list[KVReceiver], timeout: float = 10.0) -> list[KVPoll]:
    """Poll until every request finished; return their states."""
    deadline = time.monotonic() + timeout
    while True:
        states = [r.poll() for r in requests]
        if all(s in (KVPoll.Success, KVPoll.Failed) for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.005)
