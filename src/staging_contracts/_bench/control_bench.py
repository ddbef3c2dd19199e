"""Group ``control``: how fast a decode rank answers ``STAGING_REQ``.

``control.staging-req-rate``: requests answered per second by a real decode listener (codec,
mixin, handler, allocator, ``STAGING_RSP`` back over ZMQ) against a raw pyzmq PUSH/PULL echo
of the same frames; ``.curve``: the same with the control plane authenticated (CURVE, the
client a trusted prefill peer) against the plain rate. Both sides run in this process: a
client keeps :data:`WINDOW` requests in flight and counts the answers; only the server differs.
"""

from __future__ import annotations

import secrets
import statistics
import threading
import time
from collections.abc import Callable
from typing import Final

import torch
import zmq

from .._control.security import ControlSecurity
from .._control.wire import StagingReq, StagingRsp
from .._decode.handler import RoomPlan
from .._decode.rooms import PrefillPeer
from ..backends._common import Role
from ..backends._staging_setup import enable_decode_staging
from ..backends.local import LocalKVManager
from ..protocols import KVArgsRecord, KVBufferTensors
from . import BenchOptions, BenchRow, ratio_row, smoke

WINDOW: Final = 256
"""Requests in flight at once."""


def _socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def _bind(sock: zmq.Socket[bytes]) -> str:
    sock.bind("tcp://127.0.0.1:*")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


def _drive(
    requests: list[list[bytes]],
    send_to: str,
    answers: zmq.Socket[bytes],
    is_answer: Callable[[list[bytes]], bool],
    security: ControlSecurity | None = None,
) -> float:
    """Send every request keeping ``WINDOW`` in flight; return the seconds until the last answer."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    push = _socket(ctx, zmq.PUSH)
    if security is not None and not security.connect(push, send_to):
        raise RuntimeError(f"no CURVE key for {send_to}")
    push.connect(send_to)
    try:
        start = time.perf_counter()
        sent = answered = 0
        total = len(requests)
        while answered < total:
            while sent < total and sent - answered < WINDOW:
                push.send_multipart(requests[sent])
                sent += 1
            if answers.poll(5000) == 0:
                raise TimeoutError(f"no answer after {answered} of {total}")
            if is_answer(answers.recv_multipart()):
                answered += 1
        return time.perf_counter() - start
    finally:
        push.close(linger=0)


def _decode_rate(count: int, secret: bytes | None = None) -> float:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    answers = _socket(ctx, zmq.PULL)
    client = None if secret is None else ControlSecurity(secret)
    if client is not None:
        client.serve(answers)  # the decode rank encrypts its answers to this peer
    endpoint = _bind(answers)
    kv_args = KVArgsRecord(
        page_size=1,
        kv_item_lens=(16,) * 2,
        engine_rank=0,
        device="cpu",
        total_kv_head_num=1,
        kv_head_num=1,
        kv_layer_ids=(0,),
    )
    pool = KVBufferTensors((torch.zeros(4, 1, 8),), (torch.zeros(4, 1, 8),), 1)
    manager = LocalKVManager(kv_args, role=Role.DECODE, attn_tp_size=1, secret=secret)
    try:
        if client is not None:
            manager.trust_peer(endpoint, client.keys.public)
            client.directory.trust(manager.curve_key or b"", manager.endpoint)
        handler = enable_decode_staging(manager, kv_buffers=pool, ring_bytes=1 << 20)
        manager.start()
        handler.register_room(RoomPlan(1, (0,) * count, 1, 1, (PrefillPeer(0, endpoint),)))
        session = manager.engine.session_id
        requests = [StagingReq(1, chunk, 1, session).to_frames() for chunk in range(count)]
        seconds = _drive(
            requests, manager.endpoint, answers, lambda f: f[0] == b"STAGING_RSP", client
        )
        return count / seconds  # the room is never completed: closing drops it
    finally:
        manager.close()
        answers.close(linger=0)
        if client is not None:
            client.close()


def _echo_rate(count: int) -> float:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    answers = _socket(ctx, zmq.PULL)
    answers_endpoint = _bind(answers)
    inbox = _socket(ctx, zmq.PULL)
    inbox_endpoint = _bind(inbox)
    reply = StagingRsp(1, 0, 0, 0, 64, "echo").to_frames()
    stop = threading.Event()

    def echo() -> None:
        out = _socket(ctx, zmq.PUSH)
        out.connect(answers_endpoint)
        try:
            while not stop.is_set():
                if inbox.poll(5):
                    while True:
                        try:
                            inbox.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        out.send_multipart(reply)
        finally:
            out.close(linger=0)
            inbox.close(linger=0)

    thread = threading.Thread(target=echo, name="bench-echo", daemon=True)
    thread.start()
    try:
        requests = [StagingReq(1, chunk, 1, "echo").to_frames() for chunk in range(count)]
        seconds = _drive(requests, inbox_endpoint, answers, lambda f: True)
        return count / seconds
    finally:
        stop.set()
        thread.join(5)
        answers.close(linger=0)


def run(options: BenchOptions) -> list[BenchRow]:
    """Run the group; ``options.quick`` trades precision for time (:func:`smoke` rows)."""
    quick = options.quick
    count = 2_000 if quick else 20_000
    ours: list[float] = []
    anchor: list[float] = []
    curve: list[float] = []
    secret = secrets.token_hex(16).encode()
    for _ in range(1 if quick else 5):
        anchor.append(_echo_rate(count))
        ours.append(_decode_rate(count))
        curve.append(_decode_rate(count, secret))
    plain = statistics.median(ours)
    rows = [
        ratio_row("control.staging-req-rate", plain, statistics.median(anchor), "msg/s", ">= 0.5"),
        ratio_row(
            "control.staging-req-rate.curve", statistics.median(curve), plain, "msg/s", ">= 0.8"
        ),
    ]
    return smoke(rows) if quick else rows  # one small repetition: nothing to judge
