"""Issue 24, findings 1 and 2 through real NIXL agents with the cluster secret set.

* Finding 1: a real prefill process stops (``SIGSTOP``) inside its engine write, past the
  liveness timeout: decode declares it dead, fails its room and reuses the region for the next
  room. When it is continued its write lands in that room's region, over a writer that already
  arrived; the next room must not report SUCCESS with those bytes: it fails with ``integrity``.
* Finding 2: a hostile NIXL agent without the secret, holding decode's metadata, sends the
  arrival notifications of a room's chunk before any byte landed: none completes it, each is
  counted in decode's ``unauthorized``, and the room completes bit-exact from its writer.

Both fail on the code before integrity tags (which they import nothing of).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from staging_contracts import KVBufferTensors
from staging_contracts._control.security import SECRET_ENV
from staging_contracts._decode.handler import PrefillPeer, RoomPlan, RoomStatus, peers_for
from staging_contracts._prefill.writer import DecodeTarget
from staging_contracts.backends._common import Role
from staging_contracts.backends._staging_setup import enable_decode_staging, enable_prefill_staging
from staging_contracts.engines import engine_available
from tests.integrity_nixl_peers import GEOMETRY, PAUSED_ROOM, paused_writer_main
from tests.local_cluster import Geometry, Request, make_request, pools_equal, rank_heads, wait_for

if TYPE_CHECKING:
    from staging_contracts.backends.nixl import NixlKVManager

NIXL_OK, NIXL_WHY = engine_available("nixl")
pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)]

SECRET = "integrity over NIXL: 32 bytes ok!"
RING_BYTES = 1 << 16
LIVENESS_TIMEOUT_S = 1.0
"""Decode's liveness timeout in these tests: the pause lasts a little longer."""


def place(
    pool: KVBufferTensors, request: Request, pages: tuple[int, ...], heads: list[int]
) -> None:
    """Write the request's tokens of ``heads`` into ``pages`` of ``pool``."""
    ps = pool.page_size
    index = torch.tensor([p * ps + t for p in pages for t in range(ps)])
    for layer in range(len(pool.k_buffers)):
        pool.k_buffers[layer][index] = request.k[layer][:, heads]
        pool.v_buffers[layer][index] = request.v[layer][:, heads]


def expected_pool(g: Geometry, request: Request) -> KVBufferTensors:
    pool = g.empty_pool(g.decode_tp, 0)
    place(pool, request, request.decode_pages, rank_heads(g.total_heads, g.decode_tp, 0))
    return pool


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state ``T`` in ``/proc/<pid>/stat``)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] in ("T", "t")


@contextmanager
def managers(
    g: Geometry, prefill_ranks: int
) -> Iterator[tuple[NixlKVManager, list[NixlKVManager]]]:
    """A NIXL decode manager (rank 0 of D=1, a short liveness timeout) and prefill managers of
    ranks ``0 .. prefill_ranks - 1``; closed at the end."""
    from staging_contracts.backends.nixl import NixlKVManager

    made: list[NixlKVManager] = []
    try:
        decode = NixlKVManager(g.kv_args(g.decode_tp, 0), role=Role.DECODE, attn_tp_size=1)
        made.append(decode)
        decode.liveness.interval_s = 0.2
        decode.liveness.timeout_s = LIVENESS_TIMEOUT_S
        prefill = []
        for rank in range(prefill_ranks):
            manager = NixlKVManager(
                g.kv_args(g.prefill_tp, rank), role=Role.PREFILL, attn_tp_size=g.prefill_tp
            )
            made.append(manager)
            prefill.append(manager)
        yield decode, prefill
    finally:
        for manager in made:
            manager.close()


def wire(decode: NixlKVManager, prefill: list[NixlKVManager]) -> DecodeTarget:
    """Trust each other, start, load decode's metadata into each prefill agent."""
    for manager in prefill:
        decode.trust_peer(manager.endpoint, manager.curve_key)
        manager.trust_peer(decode.endpoint, decode.curve_key)
    for manager in (decode, *prefill):
        manager.start()
    session = decode.engine.session_id
    for manager in prefill:
        manager.engine.add_peer(session, decode.engine.metadata())
    handler = decode._staging_handler
    assert handler is not None
    ring_base = decode._staging_ctx.allocator.base_ptr  # type: ignore[union-attr]  # a decode context
    return DecodeTarget(0, session, decode.endpoint, ring_base, RING_BYTES)


def test_a_paused_writer_s_late_write_fails_the_next_room_with_integrity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding 1 through real processes: SIGSTOP past the liveness timeout, SIGCONT once
    the next room's first writer landed in the reused region; that room fails (integrity)."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.setenv("STAGING_CONTRACTS_INTEGRITY", "1")  # off by default; the child too
    g = GEOMETRY
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    child = spawn.Process(target=paused_writer_main, args=(theirs,), daemon=True)
    child.start()
    try:
        with managers(g, 2) as (decode, prefill):
            decode_pool = g.empty_pool(1, 0)
            handler = enable_decode_staging(decode, kv_buffers=decode_pool, ring_bytes=RING_BYTES)
            used = {0, 1}  # room 700's pages on both sides
            request = make_request(g, 701, 2, 2, seed=7, used=used)
            pools = [g.empty_pool(2, p) for p in range(2)]
            for p, pool in enumerate(pools):
                place(pool, request, request.prefill_pages, rank_heads(g.total_heads, 2, p))
            writers = [
                enable_prefill_staging(m, kv_buffers=pool, max_chunk_pages=2)
                for m, pool in zip(prefill, pools, strict=True)
            ]
            assert ours.poll(60)
            paused_endpoint, paused_key = ours.recv()
            decode.trust_peer(paused_endpoint, paused_key)
            target = wire(decode, prefill)
            # Room 700: writer 0 is the child, writer 1 prefill rank 1 here (it asks for the
            # chunk's region too, so that it knows decode's session and answers its fence).
            handler.register_room(
                RoomPlan(
                    PAUSED_ROOM,
                    (0, 1),
                    2,
                    2,
                    (PrefillPeer(0, paused_endpoint), PrefillPeer(1, prefill[1].endpoint)),
                )
            )
            ours.send(
                (
                    decode.endpoint,
                    decode.curve_key,
                    target.session_id,
                    decode.engine.metadata(),
                    target.ring_base,
                    RING_BYTES,
                )
            )
            writers[1].prefetch(PAUSED_ROOM, [(0, 2)], [target])
            assert ours.poll(60)
            assert ours.recv() == "stopping"
            assert child.pid is not None
            assert wait_for(lambda: stopped(child.pid), timeout=10)
            paused_at = time.monotonic()
            # Declared dead: room 700 fails, its region is freed (writer 1 answered its fence).
            assert wait_for(
                lambda: (
                    handler.poll_room(PAUSED_ROOM) is RoomStatus.FAILED
                    and not handler.fenced_rooms
                    and handler.allocator.live_count == 0
                ),
                timeout=20,
            )
            assert "is dead" in (handler.room_failure(PAUSED_ROOM) or "")
            # Room 701 of the two writers here gets the same bytes of the ring (fresh round).
            handler.register_room(
                RoomPlan(
                    701,
                    request.decode_pages,
                    2,
                    2,
                    peers_for([m.endpoint for m in prefill], 2, 1, 0),
                )
            )
            (chunk,) = request.chunks()
            for writer in writers:
                writer.prefetch(701, [(0, 2)], [target])
            writers[0].send_chunk(701, chunk, [target])
            assert wait_for(lambda: decode.staging_stats().arrivals >= 1, timeout=10)
            os.kill(child.pid, signal.SIGCONT)
            assert time.monotonic() - paused_at > LIVENESS_TIMEOUT_S
            assert ours.poll(60)
            reply = ours.recv()
            assert reply[0] == "written", reply
            writers[1].send_chunk(701, chunk, [target])
            assert wait_for(
                lambda: handler.poll_room(701) in (RoomStatus.SUCCESS, RoomStatus.FAILED),
                timeout=20,
            )
            assert handler.poll_room(701) is RoomStatus.FAILED, (
                "SUCCESS: the late write's bytes were taken",
                pools_equal(decode_pool, expected_pool(g, request)),
            )
            assert (handler.room_failure(701) or "").startswith("integrity")
            ours.send("close")
            child.join(30)
            assert child.exitcode == 0
    finally:
        if child.is_alive():
            os.kill(child.pid or 0, signal.SIGCONT)
            child.kill()
            child.join(10)


def test_a_hostile_agent_s_notifications_complete_no_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 2 with a real hostile NIXL agent: it loads decode's metadata and sends the
    room's arrival notifications (plain, and with a made-up MAC) before any byte landed; none
    counts, each is counted unauthorized, and the writer's own bytes complete the room."""
    from staging_contracts.engines.nixl import NixlEngine

    monkeypatch.setenv(SECRET_ENV, SECRET)
    g = Geometry(1, 1, 2)
    with managers(g, 1) as (decode, prefill):
        decode_pool = g.empty_pool(1, 0)
        handler = enable_decode_staging(decode, kv_buffers=decode_pool, ring_bytes=RING_BYTES)
        request = make_request(g, 710, 2, 2, seed=3, used=set())
        pool = g.empty_pool(1, 0)
        place(pool, request, request.prefill_pages, rank_heads(g.total_heads, 1, 0))
        (writer,) = [enable_prefill_staging(prefill[0], kv_buffers=pool, max_chunk_pages=2)]
        target = wire(decode, prefill)
        handler.register_room(
            RoomPlan(710, request.decode_pages, 2, 1, peers_for([prefill[0].endpoint], 1, 1, 0))
        )
        writer.prefetch(710, [(0, 2)], [target])
        assert wait_for(lambda: handler.poll_room(710) is RoomStatus.TRANSFERRING, timeout=10)
        hostile = NixlEngine(load_ib_modules=False)
        try:
            hostile.add_peer(target.session_id, decode.engine.metadata())
            fields = [b"CHUNK_READY", b"710", b"0", b"0", b"2", target.session_id.encode()]
            plain = b"\x00".join([*fields, b"0"])
            made_up = b"\x00".join([*fields, b"0", b"0", b"0" * 16 + b":" + b"0" * 32])
            for payload in (plain, made_up):
                hostile.write(target.session_id, [], payload)

            # Its agent has no progress thread: drive it until its sends went out.
            def counted() -> bool:
                hostile.progress()
                return decode.unauthorized >= 2

            assert wait_for(counted, timeout=10)
        finally:
            hostile.close()
        assert handler.poll_room(710) is RoomStatus.TRANSFERRING
        (chunk,) = request.chunks()
        writer.send_chunk(710, chunk, [target])
        assert wait_for(lambda: handler.poll_room(710) is RoomStatus.SUCCESS, timeout=10)
        assert pools_equal(decode_pool, expected_pool(g, request))
        assert decode.unauthorized == 2
