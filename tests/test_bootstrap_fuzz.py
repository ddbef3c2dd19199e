"""The bootstrap server against hostile requests: poison payloads and a seeded fuzz.

Each bad request must get a clear error answer, and the server must keep serving. The fuzz
is a seeded generator (reproducible, bounded in count and time), not hypothesis: 10k round
trips through hypothesis would take minutes.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from staging_contracts._cluster.bootstrap import (
    BootstrapServer,
    RankInfo,
    query_ranks,
    register_rank,
)

ANSWER_TIMEOUT_MS = 5000
FUZZ_REQUESTS = 10_000
FUZZ_DEADLINE_S = 90.0
"""Bound on the fuzz loop (it takes a few seconds)."""
FUZZ_SEED = 20_240_917
BOOTSTRAP_LOGGER = "staging_contracts._cluster.bootstrap"
MAX_ERROR_CHARS = 300


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    """A running bootstrap server, stopped after the test."""
    running = BootstrapServer()
    running.start()
    try:
        yield running
    finally:
        running.stop()


class Client:
    """A REQ socket that sends raw requests and decodes the answers."""

    def __init__(self, endpoint: str) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, raw: bytes) -> Any:
        """One request, one answer (within ANSWER_TIMEOUT_MS, or the test fails)."""
        self.sock.send(raw)
        assert self.sock.poll(ANSWER_TIMEOUT_MS), f"no answer to {raw[:80]!r}"
        return json.loads(self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)


def assert_clear_error(answer: object) -> None:
    """An error answer: ``ok`` false and a short, non-empty text."""
    assert isinstance(answer, dict)
    assert answer["ok"] is False
    assert isinstance(answer["error"], str)
    assert 0 < len(answer["error"]) <= MAX_ERROR_CHARS


def assert_still_serving(server: BootstrapServer, rank: int) -> None:
    """A registration (replacing whatever the fuzz registered there) and a query still work."""
    info = RankInfo("prefill", rank, "tcp://127.0.0.1:1", f"p{rank}", b"m")
    register_rank(server.endpoint, info, timeout=5, replace=True)
    found = query_ranks(server.endpoint, "prefill", rank + 1, timeout=5)
    assert found[rank] == info


def register(info: dict[str, object]) -> str:
    """A raw registration request (JSON text, so that Infinity and NaN can appear)."""
    fields = {
        "role": '"decode"',
        "tp_rank": "0",
        "endpoint": '"tcp://h:1"',
        "session_id": '"s"',
        "metadata": '""',
    }
    fields.update({key: str(value) for key, value in info.items()})
    body = ", ".join(f'"{key}": {value}' for key, value in fields.items())
    return f'{{"op": "register", "info": {{{body}}}}}'


POISON = {
    "deep-array": b"[" * 100_000 + b"]" * 100_000,
    "deep-object": b'{"a": ' * 100_000 + b"1" + b"}" * 100_000,
    "count-infinity": b'{"op": "query", "role": "decode", "count": Infinity, "wait_s": 1}',
    "count-nan": b'{"op": "query", "role": "decode", "count": NaN, "wait_s": 1}',
    "count-1e400": b'{"op": "query", "role": "decode", "count": 1e400, "wait_s": 1}',
    "count-huge": b'{"op": "query", "role": "decode", "count": 1' + b"0" * 5000 + b"}",
    "count-string": b'{"op": "query", "role": "decode", "count": "2", "wait_s": 1}',
    "wait-for-x": b'{"op": "count", "barrier": "b", "wait_for": "x", "wait_s": 1}',
    "wait-for-nan": b'{"op": "count", "barrier": "b", "wait_for": NaN, "wait_s": 1}',
    "wait-for-infinity": b'{"op": "count", "barrier": "b", "wait_for": Infinity, "wait_s": 1}',
    "wait-for-list": b'{"op": "count", "barrier": "b", "wait_for": [1], "wait_s": 1}',
    "wait-nan": b'{"op": "count", "barrier": "b", "wait_s": NaN}',
    "wait-infinity": b'{"op": "count", "barrier": "b", "wait_s": Infinity}',
    "tp-rank-infinity": register({"tp_rank": "Infinity"}).encode(),
    "tp-rank-nan": register({"tp_rank": "NaN"}).encode(),
    "tp-rank-1e400": register({"tp_rank": "1e400"}).encode(),
    "tp-rank-float": register({"tp_rank": "1.5"}).encode(),
    "tp-rank-true": register({"tp_rank": "true"}).encode(),
    "tp-rank-2**80": register({"tp_rank": str(2**80)}).encode(),
    "ring-base-negative": register({"ring_base": "-1"}).encode(),
    "ring-size-infinity": register({"ring_size": "Infinity"}).encode(),
    "metadata-not-base64": register({"metadata": '"!!"'}).encode(),
    "metadata-number": register({"metadata": "7"}).encode(),
    "endpoint-object": register({"endpoint": "{}"}).encode(),
    "info-list": b'{"op": "register", "info": [1, 2]}',
    "barrier-list": b'{"op": "arrive", "barrier": [[[]]], "party": "p"}',
    "party-missing": b'{"op": "arrive", "barrier": "b"}',
    "op-object": b'{"op": {"op": "query"}}',
    "op-missing": b"{}",
    "not-utf8": b"\xff\xfe\xfd",
    "empty": b"",
    "number": b"1e400",
    "string": b'"query"',
}


@pytest.mark.parametrize("payload", POISON.values(), ids=POISON.keys())
def test_the_server_survives_each_poison_payload(server: BootstrapServer, payload: bytes) -> None:
    """Each payload gets a clear error answer; registrations and queries still work."""
    client = Client(server.endpoint)
    try:
        assert_clear_error(client.ask(payload))
        assert_clear_error(client.ask(payload))  # and again: nothing was left half done
    finally:
        client.close()
    assert_still_serving(server, 0)


def fuzz_value(rng: random.Random, depth: int = 0) -> object:
    """A random JSON value; non-finite floats become Infinity/NaN in ``json.dumps``."""
    kind = rng.randrange(12 if depth < 4 else 8)
    if kind == 0:
        return rng.randint(-3, 3)
    if kind == 1:
        return rng.choice([2**31, 2**63, -(2**64), 10**40, 2**16, 65_535])
    if kind == 2:
        return rng.choice([math.inf, -math.inf, math.nan, 1e308, -0.0, 0.5, 1e-300])
    if kind == 3:
        return rng.choice(["", "prefill", "decode", "x" * rng.randrange(1, 600), "\u2603"])
    if kind == 4:
        return rng.choice([True, False, None])
    if kind == 5:
        return "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(0, 20)))
    if kind == 6:
        return rng.randint(0, 3)
    if kind == 7:
        return rng.choice([[], {}, [[[[]]]], {"a": {"b": {}}}])
    if kind in (8, 9):
        return [fuzz_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {rng.choice(FIELDS): fuzz_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


FIELDS = ["op", "info", "role", "count", "barrier", "party", "wait_for", "tp_rank", "ring_base"]
WAITS: list[object] = [0, -1, "x", None, True, math.inf, math.nan, 301, 0.002, [], {}]
"""Values of ``wait_s``: none valid and long, so no fuzz request is held for long."""


def fuzz_template(rng: random.Random) -> dict[str, object]:
    """A valid request of a random op."""
    op = rng.choice(["register", "query", "arrive", "count"])
    if op == "register":
        role = rng.choice(["prefill", "decode"])
        info = RankInfo(role, rng.randrange(4), "tcp://h:1", "s", rng.randbytes(8), 64, 4096)
        return {"op": op, "info": info.to_json()}
    if op == "query":
        return {"op": op, "role": rng.choice(["prefill", "decode"]), "count": rng.randint(1, 4)}
    barrier = rng.choice(["b", "c"])
    if op == "arrive":
        return {"op": op, "barrier": barrier, "party": f"p{rng.randrange(4)}"}
    return {"op": op, "barrier": barrier, "wait_for": rng.randint(0, 4)}


def mutate(rng: random.Random, doc: dict[str, object]) -> None:
    """Replace, drop or add one field of ``doc`` (or of its rank info)."""
    info = doc.get("info")
    target = info if isinstance(info, dict) and rng.random() < 0.6 else doc
    keys = list(target)
    action = rng.randrange(3)
    if action == 0 and keys:
        target[rng.choice(keys)] = fuzz_value(rng)
    elif action == 1 and keys:
        del target[rng.choice(keys)]
    else:
        target[rng.choice(FIELDS)] = fuzz_value(rng)


def fuzz_request(rng: random.Random) -> bytes:
    """Random bytes, random JSON, or a valid request with a few random mutations."""
    kind = rng.random()
    if kind < 0.1:
        return rng.randbytes(rng.randrange(0, 64))
    if kind < 0.2:
        return json.dumps(fuzz_value(rng)).encode()
    doc = fuzz_template(rng)
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        mutate(rng, doc)
    if rng.random() < 0.3:
        doc["wait_s"] = rng.choice(WAITS)
    text = json.dumps(doc)
    if rng.random() < 0.05:  # cut short: invalid JSON
        text = text[: rng.randrange(len(text))]
    return text.encode()


def test_the_server_survives_a_seeded_fuzz(
    server: BootstrapServer, caplog: pytest.LogCaptureFixture
) -> None:
    """10k random requests: each gets a well-formed answer, errors are clear, logs stay short."""
    caplog.set_level(logging.WARNING, logger=BOOTSTRAP_LOGGER)
    rng = random.Random(FUZZ_SEED)
    client = Client(server.endpoint)
    refused = 0
    deadline = time.monotonic() + FUZZ_DEADLINE_S
    done = 0
    try:
        while done < FUZZ_REQUESTS and time.monotonic() < deadline:
            answer = client.ask(fuzz_request(rng))
            assert isinstance(answer, dict)
            assert isinstance(answer["ok"], bool)
            if not answer["ok"]:
                assert_clear_error(answer)
                refused += 1
            done += 1
    finally:
        client.close()
    assert done == FUZZ_REQUESTS, f"only {done} fuzz requests before the deadline"
    assert FUZZ_REQUESTS // 5 < refused < FUZZ_REQUESTS * 4 // 5  # both paths exercised
    assert_still_serving(server, 0)
    lines = [record for record in caplog.records if record.name == BOOTSTRAP_LOGGER]
    assert len(lines) <= 30, f"{len(lines)} log lines for {refused} bad requests"
