"""Bootstrap waiter slots shared per peer, and queries that retry a busy server (issue 24,
finding 8): a local process without the secret filled the 1024 slots, and a rank's start-up
query then failed at once."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from staging_contracts._cluster.bootstrap import (
    MAX_WAITERS,
    BootstrapError,
    BootstrapServer,
    RankInfo,
    query_ranks,
    register_rank,
)
from tests.test_bootstrap import collect, dealer, wait_until

QUERY = {"op": "query", "role": "decode", "count": 1}


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    running = BootstrapServer(secret=None)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def hold(endpoint: str, source: str, count: int, wait_s: float) -> list[zmq.Socket[bytes]]:
    """``count`` waiting queries from the loopback address ``source``, on 4 connections."""
    socks = [dealer(endpoint, source) for _ in range(4)]
    body = json.dumps({**QUERY, "wait_s": wait_s}).encode()
    for index in range(count):
        socks[index % len(socks)].send_multipart([b"", body])
    return socks


def query_in_thread(endpoint: str, timeout: float) -> tuple[threading.Thread, list[object]]:
    """``query_ranks`` on a thread of its own (from 127.0.0.1); its result or error."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(query_ranks(endpoint, "decode", 1, timeout=timeout))
        except BootstrapError as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_one_peer_cannot_take_every_waiter_slot(server: BootstrapServer) -> None:
    """A peer (127.0.0.2) sends MAX_WAITERS waiting queries: only its share is held, the rest
    are answered busy, and a rank's query from another address still waits and gets its
    answer (on main it was refused at once)."""
    attacker = hold(server.endpoint, "127.0.0.2", MAX_WAITERS, 60.0)
    try:
        assert wait_until(lambda: server.waiting == server.max_waiters_per_peer)
        refused = [a for sock in attacker for a in collect(sock, MAX_WAITERS, 1.0)]
        assert len(refused) == MAX_WAITERS - server.max_waiters_per_peer
        assert all(a.get("busy") is True for a in refused)
        thread, out = query_in_thread(server.endpoint, 20.0)
        assert wait_until(lambda: server.waiting == server.max_waiters_per_peer + 1)
        register_rank(server.endpoint, RankInfo("decode", 0, "tcp://h:1", "d0", b""))
        thread.join(20)
        assert len(out) == 1, out
        assert isinstance(out[0], list), out
        assert [info.tp_rank for info in out[0]] == [0]
    finally:
        for sock in attacker:
            sock.close(linger=0)


def test_a_query_refused_busy_retries_until_a_slot_frees(server: BootstrapServer) -> None:
    """Every slot is held (four peers, a share each); a rank's query is answered busy, backs
    off and asks again, and is answered once the held queries ran out (on main it raised at
    once)."""
    share = server.max_waiters_per_peer
    peers = [f"127.0.0.{2 + i}" for i in range(MAX_WAITERS // share)]
    holders = [sock for source in peers for sock in hold(server.endpoint, source, share, 1.0)]
    try:
        assert wait_until(lambda: server.waiting == MAX_WAITERS)
        refused = server.requests_refused
        thread, out = query_in_thread(server.endpoint, 30.0)
        assert wait_until(lambda: server.requests_refused > refused)  # it was answered busy
        assert wait_until(lambda: server.waiting == 1, timeout=10.0)  # the holders ran out
        register_rank(server.endpoint, RankInfo("decode", 0, "tcp://h:1", "d0", b""))
        thread.join(20)
        assert len(out) == 1, out
        assert isinstance(out[0], list), out
    finally:
        for sock in holders:
            sock.close(linger=0)


def test_a_busy_server_still_busy_at_the_timeout_raises() -> None:
    """A query that is refused busy until its timeout fails then, after bounded retries."""
    running = BootstrapServer(secret=None, max_waiters=1)
    running.start()
    holder = hold(running.endpoint, "127.0.0.2", 1, 60.0)
    try:
        assert wait_until(lambda: running.waiting == 1)
        started = running.requests_served
        begin = time.monotonic()
        with pytest.raises(
            BootstrapError, match=r"within 1.0s \(the server was busy: no waiter slot\)$"
        ):
            query_ranks(running.endpoint, "decode", 1, timeout=1.0)
        assert time.monotonic() - begin < 5.0
        assert 2 <= running.requests_served - started <= 40  # backed off, not spinning
    finally:
        for sock in holder:
            sock.close(linger=0)
        running.stop()
