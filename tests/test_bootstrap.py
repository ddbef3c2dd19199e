"""Bootstrap: ranks in separate processes find each other through a small ZMQ server."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from staging_contracts._cluster import bootstrap
from staging_contracts._cluster.bootstrap import (
    MAX_RANKS,
    MAX_REQUEST_BYTES,
    MAX_WAITERS,
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


def dealer(endpoint: str, source: str | None = None) -> zmq.Socket[bytes]:
    """A DEALER socket: many requests in flight on one connection (from the loopback address
    ``source``, e.g. ``127.0.0.2``, when given: another peer to the server)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint if source is None else endpoint.replace("//", f"//{source}:0;", 1))
    return sock


def collect(sock: zmq.Socket[bytes], count: int, timeout: float) -> list[dict[str, Any]]:
    """Up to ``count`` answers ([b"", body]) arriving within ``timeout``."""
    answers: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while len(answers) < count and (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            frames = sock.recv_multipart()
            assert frames[0] == b""
            answers.append(json.loads(frames[1]))
    return answers


def test_held_requests_are_bounded_and_cheap_to_hold(server: BootstrapServer) -> None:
    """Past MAX_WAITERS a waiting request is refused at once; holding the rest costs ~no CPU.
    (The holders come from four peer addresses: one may hold MAX_WAITERS_PER_PEER.)"""
    clients = 8  # (one peer's answers are capped by ZMQ's queue of 1000 per peer)
    holders = [dealer(server.endpoint, f"127.0.0.{2 + i % 4}") for i in range(clients)]
    late = dealer(server.endpoint, "127.0.0.6")
    extra = 5
    query = json.dumps({"op": "query", "role": "decode", "count": 2, "wait_s": 60}).encode()
    busy = {
        "ok": False,
        "error": f"server busy: {MAX_WAITERS} requests already wait; retry later",
        "busy": True,
    }
    try:
        for index in range(MAX_WAITERS):
            holders[index % clients].send_multipart([b"", query])
        assert wait_until(lambda: server.waiting == MAX_WAITERS)
        for _ in range(extra):
            late.send_multipart([b"", query])
        assert collect(late, extra, 5.0) == [busy] * extra
        assert server.waiting == MAX_WAITERS

        cpu = time.process_time()
        time.sleep(0.5)
        assert time.process_time() - cpu < 0.1  # the held requests are not re-checked

        started = time.monotonic()
        count = json.dumps({"op": "count", "barrier": "b"}).encode()
        assert raw_requests(server.endpoint, [count] * 50) == [{"ok": True, "count": 0}] * 50
        assert time.monotonic() - started < 2.0

        started = time.monotonic()
        for rank in (0, 1):
            register_rank(server.endpoint, RankInfo("decode", rank, "tcp://h:1", f"d{rank}", b""))
        released = [a for sock in holders for a in collect(sock, MAX_WAITERS // clients, 5.0)]
        assert len(released) == MAX_WAITERS
        assert time.monotonic() - started < 2.0
        assert all([i["tp_rank"] for i in a["infos"]] == [0, 1] for a in released)
        assert server.waiting == 0
    finally:
        for sock in [*holders, late]:
            sock.close(linger=0)


def test_stopping_refuses_the_held_requests() -> None:
    """A query held when the server stops is refused with a clear error, not left to time out."""
    running = BootstrapServer()
    running.start()
    errors: list[BaseException] = []

    def query() -> None:
        try:
            query_ranks(running.endpoint, "decode", 1, timeout=30)
        except BootstrapError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=query)
    waiter.start()
    assert wait_until(lambda: running.waiting == 1)
    running.stop()
    waiter.join(5)
    assert not waiter.is_alive()
    assert [str(e) for e in errors] == [
        "bootstrap server refused: {'ok': False, 'error': 'bootstrap server stopped'}"
    ]


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll a predicate until it holds or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


@pytest.mark.parametrize(
    "frames",
    [[b"body"], [b"", b"a", b"b"], [b"x"] * 100],
    ids=["no-delimiter", "two-bodies", "hundred-frames"],
)
def test_a_bad_envelope_gets_an_error_answer(server: BootstrapServer, frames: list[bytes]) -> None:
    """A request not shaped like a REQ socket's is answered with an error (to its sender)."""
    sock = dealer(server.endpoint)
    try:
        sock.send_multipart(frames)
        [answer] = collect(sock, 1, 5.0)
    finally:
        sock.close(linger=0)
    assert answer["ok"] is False
    assert answer["error"].startswith("expected a REQ request (2 frames: b'', body), got ")
    assert server.alive


def test_an_oversized_request_is_dropped_by_zmq(server: BootstrapServer) -> None:
    """A request over MAX_REQUEST_BYTES never reaches the server thread; it keeps serving."""
    sock = dealer(server.endpoint)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.send_multipart([b"", b"x" * (MAX_REQUEST_BYTES + 1)], copy=False)
        assert monitor.poll(5000), "ZMQ did not drop the oversized request's connection"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
    assert server.requests_served == 0
    register_rank(server.endpoint, RankInfo("prefill", 0, "tcp://h:1", "p0", b""))
    assert server.alive


def test_an_answer_too_large_is_refused(
    server: BootstrapServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A query whose answer would pass MAX_ANSWER_BYTES gets an error answer instead."""
    register_rank(server.endpoint, RankInfo("decode", 0, "tcp://h:1", "d0", b"m" * 300))
    monkeypatch.setattr(bootstrap, "MAX_ANSWER_BYTES", 200)
    with pytest.raises(BootstrapError, match=r"answer too large \(\d+ bytes, at most 200\)"):
        query_ranks(server.endpoint, "decode", 1, timeout=5)


def test_bad_requests_are_logged_sparingly_with_exact_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Hundreds of bad requests: a few lines per interval, summaries adding up to the count."""
    caplog.set_level(logging.WARNING, logger="staging_contracts._cluster.bootstrap")
    running = BootstrapServer(log_burst=1, log_interval_s=0.05)
    running.start()
    started = time.monotonic()
    try:
        for _ in range(4):
            raw_requests(running.endpoint, [b"not json"] * 50)
            time.sleep(0.06)
    finally:
        running.stop()
    elapsed = time.monotonic() - started
    assert running.requests_refused == 200
    one_by_one = [m for m in caplog.messages if m.startswith("bootstrap request rejected")]
    summaries = [
        re.fullmatch(r"bootstrap: rejected requests: (\d+) more not logged one by one .*", m)
        for m in caplog.messages
        if "more not logged" in m
    ]
    assert summaries
    assert all(summaries)
    assert len(one_by_one) + sum(int(m.group(1)) for m in summaries if m) == 200
    assert len(one_by_one) <= elapsed / 0.05 + 1


def test_rank_info_checks_types_and_bounds() -> None:
    """Numbers must be integers in range, strings strings; the error names the field."""
    good = RankInfo("decode", 1, "tcp://h:1", "s", b"\x01", 4096, 64).to_json()
    assert RankInfo.from_json(good) == RankInfo("decode", 1, "tcp://h:1", "s", b"\x01", 4096, 64)
    cases = {
        "tp_rank": (1.0, r"^bad rank info: role 'decode', rank 1.0$"),
        "ring_base": (-1, r"^bad rank info: ring_base must be an integer in \[0, \d+\], got -1$"),
        "ring_size": (True, r"^bad rank info: ring_size must be an integer .*, got True$"),
        "endpoint": ("", r"^bad rank info: endpoint must be a string of 1-256 characters"),
        "session_id": (["s"], r"^bad rank info: session_id must be .*, got an array$"),
        "metadata": ("@@", r"^bad rank info: metadata is not base64: '@@'$"),
    }
    for field, (value, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            RankInfo.from_json(good | {field: value})
    with pytest.raises(ValueError, match=rf"^bad rank info: role 'decode', rank {MAX_RANKS}$"):
        RankInfo.from_json(good | {"tp_rank": MAX_RANKS})
