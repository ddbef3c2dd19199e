"""Child-process entry of the paused-writer test (started with ``spawn``): a NIXL prefill
rank that stops itself (``SIGSTOP``) inside its engine write, so that its write is in flight
while decode declares it dead, and lands once the parent sends ``SIGCONT``.

The cluster secret comes from the environment the parent set before spawning.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from multiprocessing.connection import Connection

import torch

from staging_contracts._prefill.writer import ChunkSpec, DecodeTarget
from staging_contracts.backends._common import Role
from staging_contracts.backends._staging_setup import enable_prefill_staging
from staging_contracts.protocols import Transfer
from tests.local_cluster import Geometry

__all__ = ["GEOMETRY", "PAUSED_ROOM", "paused_writer_main"]

GEOMETRY = Geometry(2, 1, 4)
"""P=2 -> D=1: two writers per region, the paused one is writer 0."""
PAUSED_ROOM = 700
WAIT_S = 60.0


def _recv(conn: Connection) -> object:
    if not conn.poll(WAIT_S):
        raise TimeoutError("the parent did not answer")
    return conn.recv()


def paused_writer_main(conn: Connection) -> None:
    """Prefill rank 0 of room ``PAUSED_ROOM``: stage its one chunk, stopping itself inside the
    engine write; report ``("written", bytes)`` once the write returned."""
    from staging_contracts.backends.nixl import NixlKVManager

    g = GEOMETRY
    manager = NixlKVManager(g.kv_args(g.prefill_tp, 0), role=Role.PREFILL, attn_tp_size=2)
    try:
        pool = g.empty_pool(g.prefill_tp, 0)
        generator = torch.Generator().manual_seed(4242)
        for buffer in (*pool.k_buffers, *pool.v_buffers):
            raw = torch.randint(-(2**14), 2**14, buffer.shape, generator=generator)
            buffer.copy_(raw.to(torch.int16).view(g.dtype))
        writer = enable_prefill_staging(manager, kv_buffers=pool, max_chunk_pages=2)
        conn.send((manager.endpoint, manager.curve_key))
        told = _recv(conn)
        if not isinstance(told, tuple):
            raise TypeError(f"expected the decode's tuple, got {told!r}")
        endpoint: str = told[0]
        key: bytes = told[1]
        session: str = told[2]
        metadata: bytes = told[3]
        ring_base: int = told[4]
        ring_size: int = told[5]
        manager.trust_peer(endpoint, key)
        manager.start()
        manager.engine.add_peer(session, metadata)
        write = manager.engine.write

        def paused_write(
            peer: str, transfers: Sequence[Transfer], notify: bytes | None = None
        ) -> None:
            conn.send("stopping")
            os.kill(os.getpid(), signal.SIGSTOP)  # in flight: past every fence check
            write(peer, transfers, notify)

        setattr(manager.engine, "write", paused_write)  # noqa: B010 - this instance only
        target = DecodeTarget(0, session, endpoint, ring_base, ring_size)
        written = writer.send_chunk(PAUSED_ROOM, ChunkSpec(0, 0, (0, 1)), [target])
        conn.send(("written", written))
        _recv(conn)  # "close"
    finally:
        manager.close()
