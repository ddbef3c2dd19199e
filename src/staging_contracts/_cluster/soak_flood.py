"""The soak's ``flood`` fault: a burst of bad and unwanted control messages at one rank.

Two threads (:func:`send_flood`) send one rank's control listener malformed messages
(:func:`malformed_message`) and well-formed ones it must not keep (:func:`unwanted_message`);
with the cluster secret, through CURVE sockets whose key the rank was told to trust for
:data:`FLOOD_ENDPOINT`, so that they pass the handshake, as a registered participant's do.
:func:`flood_counts` and :func:`state_bounds` judge what the rank did with them. What the
fault is for: docs/operating.md (its ``flood`` row) and docs/security.md.

**Threads:** :func:`send_flood` runs on each flood thread; the rest is pure.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import zmq

from .._control.room_messages import (
    Ping,
    Pong,
    RoomFailed,
    RoomFailedAck,
    RoomFence,
    RoomFenced,
    RoomMeta,
)
from .._control.security import CurveKeys
from .._control.transport import MAX_FRAMES
from .._control.wire import MESSAGE_TYPES, ChunkReady, StagingRsp
from ..backends._kv_requests import DEFAULT_EARLY_META_PER_PEER
from ._messages import RankStatus

FLOOD_DEADLINE_S: Final = 10.0
"""Longest one flood burst lasts, whatever its frame count."""
FLOOD_LINGER_MS: Final = 10_000
"""Longest a flood socket keeps sending what it queued once the burst ends."""
FLOOD_ENDPOINT: Final = "tcp://127.0.0.1:9"
"""The endpoint the target trusts the flooder's key for (the flooder listens nowhere, and
none of the messages it sends is answered)."""
_ROOMS_NEVER_OPENED: Final = 1 << 40
"""Room ids from here on are never issued by the soak (its rooms count from 1 000 000)."""

COUNTERS: Final = (
    "listener_malformed",
    "unauthorized",
    "staging_dropped",
    "answers_dropped",
    "early_meta_held",
)
"""The target's counters (:class:`~._messages.RankStatus` fields) that account for a flood
message, one each: malformed (the codec or the frame count refused it), unauthorized (an
authenticated sender an authoriser refused: a late ``STAGING_RSP`` from a participant that
is not the session's decode rank, a ``CHUNK_READY`` without a MAC), staging dropped (a
well-formed message for a room the rank does not know), answers dropped (a ``STAGING_RSP``
no open room asked for) and early meta held (a ``ROOM_META`` for a room not opened, held
within the sender's cap). With the secret, a malformed message of a kind an authoriser
judges (``STAGING_RSP``, ``ROOM_FENCE``, ...) may be refused there before any codec sees it:
it counts in ``unauthorized``. The rank's own traffic moves some of these counters too, so
they add up to at least what was sent."""
STATE: Final = ("answers_held", "early_meta", "open_rooms")
"""What a flood could grow on its target (:class:`~._messages.RankStatus` fields): the answer
table, the early ``ROOM_META`` store, the rank's open rooms."""


@dataclass(frozen=True, slots=True)
class FloodTarget:
    """Where one flood thread sends and what it names."""

    endpoint: str
    """The target's control listener."""
    role: str
    """``"prefill"`` or ``"decode"``."""
    session_id: str
    """The decode session the messages name (the target's own, for decode; a decode rank's,
    for prefill)."""
    late_rooms: Sequence[int] = ()
    """Rooms that closed lately (the late answers name them)."""
    keys: CurveKeys | None = None
    """The flooder's CURVE keys (the target trusts them), or ``None`` without a secret."""
    server_key: bytes = b""
    """The target's CURVE public key (Z85), with ``keys``."""


_KINDS: Final = (
    *sorted(MESSAGE_TYPES),
    RoomMeta.KIND,
    RoomFailed.KIND,
    RoomFailedAck.KIND,
    RoomFence.KIND,
    RoomFenced.KIND,
    Ping.KIND,
    Pong.KIND,
)


def malformed_message(rng: random.Random) -> list[bytes]:
    """One control message no codec accepts: random bytes, a known type with bad fields, or
    too many frames. Every field after the type starts with a NUL byte, which no field of any
    message may hold, so the message is malformed whatever its type and frame count."""

    def junk() -> bytes:
        return b"\x00" + rng.randbytes(rng.randrange(0, 48))

    shape = rng.randrange(4)
    if shape == 0:
        return [junk() for _ in range(rng.randrange(1, 4))]
    if shape == 1:
        return [rng.choice(_KINDS), *(junk() for _ in range(rng.randrange(1, 7)))]
    if shape == 2:
        return [rng.choice(_KINDS), *(b"\x00" for _ in range(MAX_FRAMES + rng.randrange(1, 9)))]
    return [b""]


def unwanted_message(target: FloodTarget, rng: random.Random) -> tuple[str, list[bytes]]:
    """One well-formed message the target must drop or hold within a bound, and its kind: to
    prefill, a late ``STAGING_RSP`` (a room that closed or was never asked) or a ``ROOM_META``
    for a room never opened; to decode, a ``CHUNK_READY`` without a tag for a room it never
    registered."""
    never = _ROOMS_NEVER_OPENED + rng.randrange(1 << 30)
    if target.role == "decode":
        ready = ChunkReady(never, rng.randrange(8), rng.randrange(64), 1, target.session_id, 0)
        return "CHUNK_READY", ready.to_frames()
    if rng.random() < 0.5:
        room = rng.choice(target.late_rooms) if target.late_rooms else never
        offset = rng.randrange(1 << 20)
        answer = StagingRsp(room, rng.randrange(8), offset, 0, offset + 4096, target.session_id)
        return "STAGING_RSP", answer.to_frames()
    meta = RoomMeta(never, 0, 16, 4, rng.randrange(1, 1 << 30))
    return "ROOM_META", meta.to_frames()


def send_flood(
    ctx: zmq.Context[zmq.Socket[bytes]],
    target: FloodTarget,
    count: int,
    seed: int,
    sent: Counter[str],
) -> None:
    """Send up to ``count`` messages to ``target`` within :data:`FLOOD_DEADLINE_S`, every
    other one malformed; ``sent`` counts those that went, by kind (``malformed`` or the
    well-formed message's type). **Blocking:** up to the deadline plus the linger."""
    rng = random.Random(seed)
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, FLOOD_LINGER_MS)  # what is queued at the end still goes
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.SNDTIMEO, 100)
    if target.keys is not None:
        target.keys.connect_to(sock, target.server_key)
    sock.connect(target.endpoint)
    deadline = time.monotonic() + FLOOD_DEADLINE_S
    total = 0
    try:
        while total < count and time.monotonic() < deadline:
            if total % 2:
                kind, frames = unwanted_message(target, rng)
            else:
                kind, frames = "malformed", malformed_message(rng)
            try:
                sock.send_multipart(frames)
            except zmq.Again:
                continue
            sent[kind] += 1
            total += 1
    finally:
        sock.close()


def flood_counts(before: RankStatus, after: RankStatus) -> dict[str, int]:
    """How much each of :data:`COUNTERS` moved on the target between two ``status`` answers
    (a counter the target does not report moved 0)."""
    return {name: (getattr(after, name) or 0) - (getattr(before, name) or 0) for name in COUNTERS}


def flood_state(status: RankStatus) -> dict[str, int]:
    """What ``status`` says of each of :data:`STATE` (those its side reports)."""
    return {name: getattr(status, name) for name in STATE if getattr(status, name) is not None}


def state_bounds(rooms_in_flight: int, chunks: int, decode_tp: int) -> dict[str, int]:
    """The most each of :data:`STATE` may hold on a rank once a flood is over: what the
    soak's own rooms can hold (twice the rooms in flight, for rooms ending and starting), and
    for the early ``ROOM_META`` store one sender's cap more (the flooder's)."""
    rooms = 2 * rooms_in_flight
    return {
        "answers_held": rooms * chunks * decode_tp,
        "early_meta": rooms * decode_tp + DEFAULT_EARLY_META_PER_PEER,
        "open_rooms": rooms,
    }
