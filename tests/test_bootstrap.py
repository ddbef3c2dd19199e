"""Bootstrap: ranks in separate processes find each other through a small ZMQ server."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from staging_contracts.cluster.bootstrap import (
    BootstrapError,
    BootstrapServer,
    RankInfo,
    arrive,
    query_ranks,
    register_rank,
    wait_barrier,
)


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    """A running bootstrap server, stopped after the test."""
    running = BootstrapServer()
    running.start()
    try:
        yield running
    finally:
        running.stop()


def raw_requests(endpoint: str, requests: list[bytes]) -> list[Any]:
    """Send each raw request on one REQ socket; return the decoded answers."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    answers = []
    try:
        for raw in requests:
            sock.send(raw)
            assert sock.poll(5000)
            answers.append(json.loads(sock.recv()))
    finally:
        sock.close(linger=0)
    return answers


def test_register_then_query_returns_ranks_in_order(server: BootstrapServer) -> None:
    """Ranks registered in any order come back sorted, metadata intact."""
    for rank in (1, 0):
        info = RankInfo(
            "decode", rank, f"tcp://127.0.0.1:{5000 + rank}", f"s{rank}", b"\x00\xff", 4096, 64
        )
        register_rank(server.endpoint, info)
    infos = query_ranks(server.endpoint, "decode", 2, timeout=5)
    assert [i.tp_rank for i in infos] == [0, 1]
    assert infos[0].metadata == b"\x00\xff"
    assert infos[1].ring_base == 4096


def test_query_times_out_while_ranks_are_missing(server: BootstrapServer) -> None:
    """Waiting for ranks that never register ends with BootstrapError."""
    with pytest.raises(BootstrapError, match=r"^2 prefill ranks did not register within 0.2s$"):
        query_ranks(server.endpoint, "prefill", 2, timeout=0.2)


def test_malformed_requests_get_an_error_and_the_server_keeps_serving(
    server: BootstrapServer,
) -> None:
    """Garbage and bad rank infos are answered with an error; later requests still work."""
    answers = raw_requests(
        server.endpoint,
        [b"not json", b"[1]", json.dumps({"op": "register", "info": {"role": "x"}}).encode()],
    )
    assert [answer["ok"] for answer in answers] == [False, False, False]
    register_rank(server.endpoint, RankInfo("prefill", 0, "tcp://127.0.0.1:1", "p0", b""))
    assert len(query_ranks(server.endpoint, "prefill", 1, timeout=5)) == 1


def test_rank_info_rejects_bad_documents() -> None:
    """A rank info with a bad role or missing fields is a ValueError."""
    with pytest.raises(ValueError, match=r"^bad rank info: role 'router'"):
        RankInfo.from_json(RankInfo("prefill", 0, "e", "s", b"").to_json() | {"role": "router"})
    with pytest.raises(ValueError, match=r"^bad rank info: 'session_id'$"):
        RankInfo.from_json({"role": "prefill", "tp_rank": 0, "endpoint": "e", "metadata": ""})


def test_barrier_waits_for_every_party(server: BootstrapServer) -> None:
    """wait_barrier returns once the count is reached (arrivals are idempotent)."""
    arrive(server.endpoint, "rooms", "decode-0")
    arrive(server.endpoint, "rooms", "decode-0")
    with pytest.raises(BootstrapError, match=r"^barrier 'rooms' did not reach 2 within 0.1s$"):
        wait_barrier(server.endpoint, "rooms", 2, timeout=0.1)
    arrive(server.endpoint, "rooms", "decode-1")
    wait_barrier(server.endpoint, "rooms", 2, timeout=5)


def test_a_query_waits_on_the_server_not_by_polling(server: BootstrapServer) -> None:
    """One query request is held by the server and answered when the last rank registers."""
    found: list[list[RankInfo]] = []
    waiter = threading.Thread(
        target=lambda: found.append(query_ranks(server.endpoint, "prefill", 2, timeout=10))
    )
    waiter.start()
    time.sleep(0.3)
    assert not found
    for rank in (0, 1):
        register_rank(server.endpoint, RankInfo("prefill", rank, "tcp://h:1", f"p{rank}", b""))
    waiter.join(5)
    assert [info.tp_rank for info in found[0]] == [0, 1]
    assert server.requests_served == 3  # the query once, then two registrations


def test_a_barrier_waits_on_the_server_not_by_polling(server: BootstrapServer) -> None:
    """One barrier request is held by the server and answered on the last arrival."""
    waiter = threading.Thread(target=lambda: wait_barrier(server.endpoint, "done", 2, timeout=10))
    waiter.start()
    arrive(server.endpoint, "done", "decode-0")
    time.sleep(0.3)
    assert waiter.is_alive()
    arrive(server.endpoint, "done", "decode-1")
    waiter.join(5)
    assert not waiter.is_alive()
    assert server.requests_served == 3


@pytest.mark.parametrize("wait_s", [-1, "soon", 301])
def test_a_bad_wait_is_refused(server: BootstrapServer, wait_s: object) -> None:
    """A request whose wait_s is not a number in [0, MAX_WAIT_S] gets an error answer."""
    request = json.dumps({"op": "count", "barrier": "b", "wait_s": wait_s}).encode()
    [answer] = raw_requests(server.endpoint, [request])
    assert answer == {"ok": False, "error": "wait_s must be a number in [0, 300.0]"}
