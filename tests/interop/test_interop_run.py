"""Real staged transfers between our staging path and the reference's, over real ZMQ sockets.

Forward: our prefill (``NixlKVManager(arrival="zmq")`` with its ``StagingWriter``, in its own
threads) stages rooms into the reference's decode ranks (:class:`ReferenceDecodeRank`: its
``handle_staging_req``, allocator, ``DecodeStagingHandler`` and torch scatter, on a thread
of their own); the bytes travel over NIXL into its ring. Reverse: the reference's prefill
ranks (:class:`ReferencePrefillRank`: its prefetch, readiness, gather and ``CHUNK_READY``)
stage rooms into our decode managers. Both for P=2 -> D=1 and P=1 -> D=2, with a ring small
enough that regions wrap and wait for ``WATERMARK``; every decode pool must be bit-exact.
And one room to its decode that outlasts our liveness timeout, with and without the per-target
liveness switch (its decode never answers ``PING``).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import pytest
import torch
import zmq

from staging_contracts import KVBufferTensors
from staging_contracts._decode.handler import RoomPlan, RoomStatus, peers_for
from staging_contracts._prefill.writer import ChunkSpec, DecodeTarget, StagingFailed, StagingWriter
from staging_contracts._staging.layout import compute_staging_layout, prefill_ranks_for_decode
from staging_contracts.backends._common import Role
from staging_contracts.backends._staging_setup import enable_decode_staging, enable_prefill_staging
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.engines import engine_available
from staging_contracts.engines.local import LocalEngine
from staging_contracts.protocols import TransferEngine
from tests.interop._reference import Reference
from tests.interop._sides import ReferenceDecodeRank, ReferencePrefillRank
from tests.local_cluster import Geometry, pools_equal, rank_heads, wait_for

if TYPE_CHECKING:
    from staging_contracts.backends.nixl import NixlKVManager

NIXL_OK, NIXL_WHY = engine_available("nixl")

ROOMS = (21, 22)
PAGES = 10
CHUNK_PAGES = 4


@dataclass
class Data:
    """One room's KV data and pages."""

    room: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    prefill_pages: list[int]
    decode_pages: list[int]

    def chunks(self) -> list[ChunkSpec]:
        return [
            ChunkSpec(i, start, tuple(self.prefill_pages[start : start + CHUNK_PAGES]))
            for i, start in enumerate(range(0, PAGES, CHUNK_PAGES))
        ]


def make_rooms(g: Geometry, *, finite: bool) -> list[Data]:
    """Random KV data for each room (random bits; no NaNs when ``finite``) on disjoint pages."""
    generator = torch.Generator().manual_seed(17)
    pages = torch.randperm(g.pool_pages, generator=generator).tolist()
    out = []
    for n, room in enumerate(ROOMS):
        shape = (PAGES * g.page_size, g.total_heads, g.head_dim)

        def data(shape: tuple[int, int, int] = shape) -> torch.Tensor:
            bits = torch.randint(-(2**15), 2**15, shape, generator=generator, dtype=torch.int32)
            values = bits.to(torch.int16).view(g.dtype)
            if finite:
                values = torch.where(values.isnan(), torch.zeros_like(values), values)
            return values

        used = pages[2 * n * PAGES : 2 * (n + 1) * PAGES]
        out.append(
            Data(
                room,
                [data() for _ in range(g.layers)],
                [data() for _ in range(g.layers)],
                used[:PAGES],
                used[PAGES:],
            )
        )
    return out


def place(pool: KVBufferTensors, data: Data, pages: list[int], heads: list[int]) -> None:
    """Write a room's tokens of ``heads`` into ``pages`` of ``pool``."""
    ps = pool.page_size
    index = torch.tensor([p * ps + t for p in pages for t in range(ps)])
    for layer in range(len(pool.k_buffers)):
        pool.k_buffers[layer][index] = data.k[layer][:, heads]
        pool.v_buffers[layer][index] = data.v[layer][:, heads]


def expected_decode(g: Geometry, rank: int, rooms: list[Data]) -> KVBufferTensors:
    """A decode rank's pool once every room landed."""
    pool = g.empty_pool(g.decode_tp, rank)
    for data in rooms:
        place(pool, data, data.decode_pages, rank_heads(g.total_heads, g.decode_tp, rank))
    return pool


def prefill_pools(g: Geometry, rooms: list[Data]) -> list[KVBufferTensors]:
    pools = [g.empty_pool(g.prefill_tp, p) for p in range(g.prefill_tp)]
    for p, pool in enumerate(pools):
        for data in rooms:
            place(pool, data, data.prefill_pages, rank_heads(g.total_heads, g.prefill_tp, p))
    return pools


def ring_for(g: Geometry) -> int:
    """A ring of two and a half chunk regions: the third region of a room wraps."""
    layout = compute_staging_layout(
        g.prefill_tp, g.decode_tp, 0, g.total_heads, CHUNK_PAGES * g.page_size, 16, g.layers
    )
    return layout.total_bytes * 5 // 2


GEOMETRIES = [
    pytest.param(Geometry(2, 1, 4, pool_pages=64), id="P2-D1"),
    pytest.param(Geometry(1, 2, 4, pool_pages=64), id="P1-D2"),
]


# --------------------------------------------------------------------------- forward


@dataclass
class Forward:
    """Our NIXL prefill managers and writers, the reference's decode ranks, wired."""

    prefill: list[NixlKVManager]
    writers: list[StagingWriter]
    decode: list[ReferenceDecodeRank]
    decode_pools: list[KVBufferTensors]
    targets: list[DecodeTarget]


@contextmanager
def forward_sides(
    reference: Reference,
    g: Geometry,
    rooms: list[Data],
    *,
    zmq_chosen_by: Literal["manager", "setup"] = "manager",
) -> Iterator[Forward]:
    """Our prefill (arrival over ZMQ) and its decode ranks, the rooms registered on decode.
    ``zmq_chosen_by``: ``"manager"``, ``NixlKVManager(arrival="zmq")``; ``"setup"``, a manager
    in its default mode and ``enable_prefill_staging(..., arrival="zmq")``."""
    from staging_contracts.backends.nixl import NixlKVManager
    from staging_contracts.engines.nixl import NixlEngine

    ring = ring_for(g)
    by_manager = zmq_chosen_by == "manager"
    with ExitStack() as stack:
        prefill = []
        for p in range(g.prefill_tp):
            manager = NixlKVManager(
                g.kv_args(g.prefill_tp, p),
                role=Role.PREFILL,
                attn_tp_size=g.prefill_tp,
                arrival="zmq" if by_manager else "notification",
            )
            stack.callback(manager.close)
            prefill.append(manager)
        pools = prefill_pools(g, rooms)
        writers = [
            enable_prefill_staging(
                m,
                kv_buffers=pool,
                max_chunk_pages=CHUNK_PAGES,
                arrival=None if by_manager else "zmq",
            )
            for m, pool in zip(prefill, pools, strict=True)
        ]
        for manager in prefill:
            manager.start()
        decode: list[ReferenceDecodeRank] = []
        decode_pools = [g.empty_pool(g.decode_tp, d) for d in range(g.decode_tp)]
        for d in range(g.decode_tp):
            engine = NixlEngine(load_ib_modules=False)
            stack.callback(engine.close)
            rank = ReferenceDecodeRank(
                reference,
                kv_args=g.kv_args(g.decode_tp, d),
                decode_tp=g.decode_tp,
                pool=decode_pools[d],
                ring_bytes=ring,
                engine=engine,
                progress=engine.progress,
            )
            stack.callback(rank.close)
            decode.append(rank)
            for manager in prefill:
                manager.engine.add_peer(engine.session_id, engine.metadata())
        targets = [
            DecodeTarget(d, rank.engine.session_id, rank.endpoint, rank.allocator.base_ptr, ring)
            for d, rank in enumerate(decode)
        ]
        for slot, data in enumerate(rooms):
            for d, rank in enumerate(decode):
                feeders = prefill_ranks_for_decode(g.prefill_tp, g.decode_tp, d)
                rank.register_room(
                    data.room,
                    slot,
                    data.decode_pages,
                    {p: prefill[p].endpoint for p in feeders},
                    g.prefill_tp,
                )
        yield Forward(prefill, writers, decode, decode_pools, targets)


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
@pytest.mark.parametrize("g", GEOMETRIES)
def test_our_prefill_stages_into_its_decode(reference: Reference, g: Geometry) -> None:
    """Our NIXL prefill writers (arrival over ZMQ) against its decode handler: every STAGING_REQ
    answered by its allocator, every region waited for by its WATERMARK, every CHUNK_READY
    taken by its handler and scattered by its kernel; its decode pools are bit-exact."""
    rooms = make_rooms(g, finite=False)
    with forward_sides(reference, g, rooms) as sides:
        writers, decode, targets = sides.writers, sides.decode, sides.targets
        decode_pools = sides.decode_pools
        errors: list[BaseException] = []

        def work(writer_index: int) -> None:
            writer = writers[writer_index]
            try:
                for data in rooms:
                    chunks = data.chunks()
                    writer.prefetch(
                        data.room, [(c.chunk_idx, len(c.pages)) for c in chunks], targets
                    )
                    for chunk in chunks:
                        writer.send_chunk(data.room, chunk, targets)
            except Exception as exc:  # noqa: BLE001 - collected for the test to assert on
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(writers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == []
        for data in rooms:
            for rank in decode:
                rank.finish_room(data.room)
        for data in rooms:
            assert all(rank.wait_done(data.room) for rank in decode), data.room
        for d, rank in enumerate(decode):
            assert rank.errors == []
            assert pools_equal(decode_pools[d], expected_decode(g, d, rooms)), f"decode rank {d}"
            assert rank.allocator.round >= 1  # regions wrapped: WATERMARK was waited for
            writers_per_chunk = len(prefill_ranks_for_decode(g.prefill_tp, g.decode_tp, d))
            arrivals = rank.received.count(b"CHUNK_READY")
            assert arrivals == len(ROOMS) * 3 * writers_per_chunk
            assert {bytes(f[0]) for f in rank.ignored} <= {b"PING"}  # our liveness, its log
        for writer in writers:
            assert writer.arrival == "zmq"
            for rank in decode:
                assert writer._watermarks.latest(rank.engine.session_id).round >= 1


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
@pytest.mark.parametrize("liveness", [True, False], ids=["liveness-on", "liveness-off"])
def test_a_room_outlasting_the_liveness_timeout_needs_the_switch(
    reference: Reference, liveness: bool
) -> None:
    """Its decode takes our PING for foreign traffic and never answers PONG. A room to it that
    lasts longer than PeerLiveness.timeout_s (5 s by default, 0.3 s here): with liveness on
    (the default) our prefill declares its decode dead and fails the room; with the switch
    (DecodeTarget(..., liveness=False)) its decode is never pinged, the room survives the
    pause and its pool is bit-exact. The pause is measured by the liveness itself: a
    sentinel peer, watched after the first chunk and never answering, is declared dead only
    once the room has been silent for longer than the timeout. The prefill manager is in its
    default mode and chooses ZMQ arrival at set-up (enable_prefill_staging(arrival="zmq"))."""
    g = Geometry(1, 1, 4, pool_pages=64)
    rooms = make_rooms(g, finite=False)[:1]
    (data,) = rooms
    chunks = data.chunks()
    with forward_sides(reference, g, rooms, zmq_chosen_by="setup") as sides:
        (manager,), (writer,), (rank,) = sides.prefill, sides.writers, sides.decode
        assert manager.arrival == "notification"
        assert writer.arrival == "zmq"
        targets = [replace(t, liveness=liveness) for t in sides.targets]
        lost: list[tuple[int, str]] = []
        writer.on_room_lost(lambda room, reason: lost.append((room, reason)))
        manager.liveness.interval_s, manager.liveness.timeout_s = 0.05, 0.3
        sentinel_context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sentinel = sentinel_context.socket(zmq.PULL)
        sentinel.setsockopt(zmq.LINGER, 0)
        sentinel_endpoint = f"tcp://127.0.0.1:{sentinel.bind_to_random_port('tcp://127.0.0.1')}"
        try:
            writer.prefetch(data.room, [(c.chunk_idx, len(c.pages)) for c in chunks], targets)
            writer.send_chunk(data.room, chunks[0], targets)
            manager.liveness.watch(sentinel_endpoint)
            assert wait_for(lambda: manager.liveness.is_dead(sentinel_endpoint), 10)
            assert sentinel.poll(1000)
            assert sentinel.recv_multipart()[0] == b"PING"
            if liveness:
                # dead in the sentinel's tick or before; subscribers hear it after the verdict
                reason = f"decode rank at {rank.endpoint} is dead"
                assert wait_for(lambda: lost == [(data.room, reason)], 5), lost
                assert manager.liveness.is_dead(rank.endpoint)
                with pytest.raises(StagingFailed, match=r"chunk 1: decode rank 0 at .* is dead"):
                    writer.send_chunk(data.room, chunks[1], targets)
                assert wait_for(lambda: any(f[0] == b"PING" for f in rank.ignored), 5)
                return
            for chunk in chunks[1:]:
                writer.send_chunk(data.room, chunk, targets)
            rank.finish_room(data.room)
            assert rank.wait_done(data.room)
            assert lost == []
            assert not manager.liveness.is_dead(rank.endpoint)
            assert rank.errors == []
            assert rank.ignored == []  # not one PING reached it
            assert rank.received.count(b"CHUNK_READY") == len(chunks)
            assert pools_equal(sides.decode_pools[0], expected_decode(g, 0, rooms))
        finally:
            manager.liveness.unwatch(sentinel_endpoint)
            sentinel.close()
            sentinel_context.term()


# --------------------------------------------------------------------------- reverse


@dataclass
class OurDecode:
    """Our decode managers, whatever the backend."""

    managers: list[LocalKVManager]
    handlers: list[object]
    pools: list[KVBufferTensors]


def reverse_backends() -> Iterator[object]:
    yield pytest.param("local", id="local")
    yield pytest.param(
        "nixl",
        id="nixl",
        marks=[pytest.mark.nixl, pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)],
    )


@pytest.mark.parametrize("backend", list(reverse_backends()))
@pytest.mark.parametrize("g", GEOMETRIES)
def test_its_prefill_stages_into_our_decode(
    reference: Reference, g: Geometry, backend: str
) -> None:
    """Its prefill (prefetch_staging_reqs, check_ready on its watermarks and answers,
    send_kvcache_staged with its gather, send_chunk_ready) against our decode handler; our
    decode pools are bit-exact (finite KV values: its gather rewrites NaN payloads, see
    test_kernels)."""
    rooms = make_rooms(g, finite=True)
    ring = ring_for(g)
    with ExitStack() as stack:
        decode_managers: list[LocalKVManager | NixlKVManager] = []
        decode_engines: list[TransferEngine] = []
        for d in range(g.decode_tp):
            manager: LocalKVManager | NixlKVManager
            if backend == "nixl":
                from staging_contracts.backends.nixl import NixlKVManager

                manager = NixlKVManager(
                    g.kv_args(g.decode_tp, d), role=Role.DECODE, attn_tp_size=g.decode_tp
                )
            else:
                manager = LocalKVManager(
                    g.kv_args(g.decode_tp, d), role=Role.DECODE, attn_tp_size=g.decode_tp
                )
            stack.callback(manager.close)
            decode_managers.append(manager)
            decode_engines.append(manager.engine)
        decode_pools = [g.empty_pool(g.decode_tp, d) for d in range(g.decode_tp)]
        handlers = [
            enable_decode_staging(m, kv_buffers=pool, ring_bytes=ring)
            for m, pool in zip(decode_managers, decode_pools, strict=True)
        ]
        pools = prefill_pools(g, rooms)
        prefill: list[ReferencePrefillRank] = []
        for p in range(g.prefill_tp):
            if backend == "nixl":
                from staging_contracts.engines.nixl import NixlEngine

                engine: TransferEngine = NixlEngine(load_ib_modules=False, notifications=False)
            else:
                engine = LocalEngine()
            stack.callback(engine.close)
            rank = ReferencePrefillRank(
                reference,
                kv_args=g.kv_args(g.prefill_tp, p),
                prefill_tp=g.prefill_tp,
                pool=pools[p],
                chunk_pages=CHUNK_PAGES,
                engine=engine,
            )
            stack.callback(rank.close)
            prefill.append(rank)
        for manager in decode_managers:
            manager.start()
        for rank in prefill:
            for decode_engine in decode_engines:
                rank.engine.add_peer(decode_engine.session_id, decode_engine.metadata())
        endpoints = [rank.endpoint for rank in prefill]
        for data in rooms:
            for d, handler in enumerate(handlers):
                handler.register_room(
                    RoomPlan(
                        data.room,
                        tuple(data.decode_pages),
                        CHUNK_PAGES,
                        g.prefill_tp,
                        peers_for(endpoints, g.prefill_tp, g.decode_tp, d),
                    )
                )
            for p, rank in enumerate(prefill):
                fed = [
                    d
                    for d in range(g.decode_tp)
                    if p in prefill_ranks_for_decode(g.prefill_tp, g.decode_tp, d)
                ]
                rank.add_room(
                    data.room,
                    {
                        decode_engines[d].session_id: (
                            decode_managers[d].endpoint,
                            data.decode_pages,
                        )
                        for d in fed
                    },
                )

        errors: list[BaseException] = []

        def work(p: int) -> None:
            rank = prefill[p]
            try:
                for data in rooms:
                    rank.prefetch(data.room)
                    for chunk in data.chunks():
                        for d in range(g.decode_tp):
                            if p not in prefill_ranks_for_decode(g.prefill_tp, g.decode_tp, d):
                                continue
                            target = types.SimpleNamespace(
                                staging_base_ptr=handlers[d]._allocator.base_ptr,
                                staging_total_size=ring,
                                dst_tp_rank=d,
                                dst_attn_tp_size=g.decode_tp,
                                dst_kv_item_len=g.kv_args(g.decode_tp, d).kv_item_lens[0],
                                dst_kv_layer_ids=list(range(g.layers)),
                                staging=None,
                            )
                            rank.send_chunk(
                                data.room,
                                decode_engines[d].session_id,
                                target,
                                chunk.page_start,
                                list(chunk.pages),
                            )
            except Exception as exc:  # noqa: BLE001 - collected for the test to assert on
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(p,)) for p in range(g.prefill_tp)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == []
        for data in rooms:
            assert wait_for(
                lambda room=data.room: all(
                    h.poll_room(room) is RoomStatus.SUCCESS for h in handlers
                ),
                20,
            ), [h.poll_room(data.room) for h in handlers]
        for d, pool in enumerate(decode_pools):
            assert pools_equal(pool, expected_decode(g, d, rooms)), f"decode rank {d}"
            assert handlers[d]._allocator.get_watermark().round >= 1
        for rank in prefill:
            assert rank.errors == []
            assert rank.manager.engine.writes == len(ROOMS) * 3 * len(
                [
                    d
                    for d in range(g.decode_tp)
                    if prefill.index(rank) in prefill_ranks_for_decode(g.prefill_tp, g.decode_tp, d)
                ]
            )
            assert {bytes(f[0]) for f in rank.ignored} <= {b"PING"}  # our liveness
