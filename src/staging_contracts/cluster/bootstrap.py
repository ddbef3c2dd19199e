"""Bootstrap: how prefill and decode ranks in separate processes find each other.

A :class:`BootstrapServer` (a ZMQ ROUTER socket on loopback, served by a thread) collects
one :class:`RankInfo` per rank — its control endpoint, engine session id and metadata, and on
decode the staging ring's base address and size — and answers queries for all ranks of a
role once every one of them has registered. Requests and answers are small JSON documents;
a malformed request gets an error answer and the server keeps serving.

Waiting is done by the server: :func:`query_ranks` and :func:`wait_barrier` send one request
with ``wait_s``, which the server answers as soon as it is satisfied (or when ``wait_s`` ran
out), so no rank polls with a new connection every few milliseconds, taking CPU from the
ranks still transferring.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Final

import zmq

__all__ = [
    "BootstrapError",
    "BootstrapServer",
    "RankInfo",
    "arrive",
    "query_ranks",
    "register_rank",
    "wait_barrier",
]

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES: Final = 1 << 20
MAX_WAIT_S: Final = 300.0
"""Longest ``wait_s`` the server holds a request for."""
_MIN_ANSWER_S: Final = 1.0
_SERVER_POLL_MS: Final = 20


class BootstrapError(RuntimeError):
    """The bootstrap server did not answer, or refused a request."""


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What a rank tells its peers at bootstrap."""

    role: str
    """``"prefill"`` or ``"decode"``."""
    tp_rank: int
    """Attention-TP rank."""
    endpoint: str
    """Control listener (``tcp://host:port``)."""
    session_id: str
    """Engine session id (Mooncake ``host:port``, NIXL agent name)."""
    metadata: bytes
    """Engine metadata a peer passes to ``add_peer``."""
    ring_base: int = 0
    """Decode: address of the staging ring."""
    ring_size: int = 0
    """Decode: bytes of the staging ring."""

    def to_json(self) -> dict[str, Any]:
        """As a JSON-ready dict (metadata base64-encoded)."""
        doc = asdict(self)
        doc["metadata"] = base64.b64encode(self.metadata).decode()
        return doc

    @classmethod
    def from_json(cls, doc: object) -> RankInfo:
        """Parse a dict made by :meth:`to_json`.

        Raises:
            ValueError: missing or mistyped fields.
        """
        if not isinstance(doc, dict):
            raise ValueError("rank info must be an object")
        try:
            info = cls(
                role=str(doc["role"]),
                tp_rank=int(doc["tp_rank"]),
                endpoint=str(doc["endpoint"]),
                session_id=str(doc["session_id"]),
                metadata=base64.b64decode(str(doc["metadata"]), validate=True),
                ring_base=int(doc.get("ring_base", 0)),
                ring_size=int(doc.get("ring_size", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad rank info: {exc}") from None
        if info.role not in ("prefill", "decode") or info.tp_rank < 0:
            raise ValueError(f"bad rank info: role {info.role!r}, rank {info.tp_rank}")
        return info


@dataclass(slots=True)
class _Waiter:
    """A request the server answers once it is satisfied, or at ``deadline``."""

    identity: bytes
    doc: dict[str, Any]
    deadline: float


class BootstrapServer:
    """Collects rank infos and answers queries, on a thread of its own.

    **Thread-safety:** ``start``/``stop`` from the owner's thread; requests are served on
    the server thread.

    Args:
        host: address to bind (loopback by default).
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{host}:*")
        last = self._socket.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint: str = last.decode() if isinstance(last, bytes) else str(last)
        """Where ranks send their requests."""
        self._infos: dict[tuple[str, int], RankInfo] = {}
        self._barriers: dict[str, set[str]] = {}
        self._waiters: list[_Waiter] = []
        self.requests_served = 0
        """Requests received so far (each wait is one request, however long it waits)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bootstrap-server", daemon=True)

    def start(self) -> None:
        """Start serving."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the socket; safe to call twice."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif not self._socket.closed:
            self._socket.close(linger=0)

    def infos(self, role: str) -> list[RankInfo]:
        """The ranks of a role registered so far, by rank."""
        return sorted(
            (i for (r, _), i in self._infos.items() if r == role), key=lambda i: i.tp_rank
        )

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(self._poll_ms()):
                    self._serve(self._socket.recv_multipart())
                self._answer_waiters()  # after any change, and for waits that ran out
        finally:
            self._socket.close(linger=0)

    def _poll_ms(self) -> int:
        if not self._waiters:
            return _SERVER_POLL_MS
        soonest = min(waiter.deadline for waiter in self._waiters) - time.monotonic()
        return max(0, min(_SERVER_POLL_MS, int(soonest * 1000) + 1))

    def _serve(self, frames: list[bytes]) -> None:
        # A REQ client's request arrives as [identity, b"", body].
        if len(frames) != 3 or frames[1]:
            logger.warning("bootstrap: dropped a request of %d frames", len(frames))
            return
        identity, _, raw = frames
        doc, answer = self._answer(raw)
        self.requests_served += 1
        if doc is not None and doc.get("wait_s", 0) > 0 and not _satisfied(doc, answer):
            deadline = time.monotonic() + doc["wait_s"]
            self._waiters.append(_Waiter(identity, doc, deadline))
        else:
            self._reply(identity, answer)

    def _answer_waiters(self) -> None:
        now = time.monotonic()
        still: list[_Waiter] = []
        for waiter in self._waiters:
            answer = self._answer_doc(waiter.doc)  # a read, accepted once already
            if _satisfied(waiter.doc, answer) or now >= waiter.deadline:
                self._reply(waiter.identity, answer)
            else:
                still.append(waiter)
        self._waiters = still

    def _reply(self, identity: bytes, answer: dict[str, Any]) -> None:
        try:
            self._socket.send_multipart(
                [identity, b"", json.dumps(answer).encode()], flags=zmq.NOBLOCK
            )
        except zmq.ZMQError as exc:  # the client left: nobody to answer
            logger.info("bootstrap: answer not delivered: %s", exc)

    def _answer(self, raw: bytes) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """The parsed request (``None`` if malformed) and its answer as of now."""
        try:
            if len(raw) > MAX_REQUEST_BYTES:
                raise ValueError("request too large")
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("request must be an object")
            wait_s = doc.get("wait_s", 0)
            if not isinstance(wait_s, int | float) or not 0 <= wait_s <= MAX_WAIT_S:
                raise ValueError(f"wait_s must be a number in [0, {MAX_WAIT_S}]")
            return doc, self._answer_doc(doc)
        except (ValueError, TypeError, KeyError) as exc:
            logger.warning("bootstrap request rejected: %s", exc)
            return None, {"ok": False, "error": str(exc)}

    def _answer_doc(self, doc: dict[str, Any]) -> dict[str, Any]:
        op = doc.get("op")
        if op == "register":
            info = RankInfo.from_json(doc.get("info"))
            self._infos[(info.role, info.tp_rank)] = info
            return {"ok": True}
        if op == "query":
            role = str(doc.get("role"))
            count = int(doc.get("count", 0))
            found = self.infos(role)
            if count < 1 or len(found) < count:
                return {"ok": True, "pending": count - len(found)}
            return {"ok": True, "infos": [i.to_json() for i in found[:count]]}
        if op == "arrive":
            self._barriers.setdefault(str(doc["barrier"]), set()).add(str(doc["party"]))
            return {"ok": True}
        if op == "count":
            return {"ok": True, "count": len(self._barriers.get(str(doc["barrier"]), ()))}
        raise ValueError(f"unknown op {op!r}")


def _satisfied(doc: dict[str, Any], answer: dict[str, Any]) -> bool:
    """Whether ``answer`` ends the wait ``doc`` asked for (``wait_for`` parties, or ranks)."""
    if not answer.get("ok"):
        return True
    if doc.get("op") == "query":
        return "infos" in answer
    if doc.get("op") == "count":
        return int(answer.get("count", 0)) >= int(doc.get("wait_for", 0))
    return True


def _request(endpoint: str, doc: dict[str, Any], timeout: float) -> dict[str, Any]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(json.dumps(doc).encode())
        if not sock.poll(int(timeout * 1000)):
            raise BootstrapError(f"bootstrap server {endpoint} did not answer in {timeout}s")
        answer = json.loads(sock.recv())
    finally:
        sock.close(linger=0)
    if not isinstance(answer, dict) or not answer.get("ok"):
        raise BootstrapError(f"bootstrap server refused: {answer}")
    return answer


def register_rank(endpoint: str, info: RankInfo, timeout: float = 10.0) -> None:
    """Tell the bootstrap server about this rank.

    Raises:
        BootstrapError: no answer within ``timeout``, or refused.
    """
    _request(endpoint, {"op": "register", "info": info.to_json()}, timeout)


def query_ranks(endpoint: str, role: str, count: int, timeout: float = 60.0) -> list[RankInfo]:
    """Wait until ``count`` ranks of ``role`` have registered; return them by rank.

    Raises:
        BootstrapError: they did not all register within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        request = {"op": "query", "role": role, "count": count, "wait_s": _wait_s(deadline)}
        answer = _request(endpoint, request, _request_timeout(deadline))
        infos = answer.get("infos")
        if isinstance(infos, list):
            return [RankInfo.from_json(doc) for doc in infos]
        if time.monotonic() >= deadline:
            raise BootstrapError(f"{count} {role} ranks did not register within {timeout}s")


def arrive(endpoint: str, barrier: str, party: str, timeout: float = 10.0) -> None:
    """Record that ``party`` reached ``barrier`` (idempotent).

    Raises:
        BootstrapError: no answer within ``timeout``.
    """
    _request(endpoint, {"op": "arrive", "barrier": barrier, "party": party}, timeout)


def wait_barrier(endpoint: str, barrier: str, count: int, timeout: float = 60.0) -> None:
    """Block until ``count`` parties reached ``barrier``.

    Raises:
        BootstrapError: they did not within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        request = {
            "op": "count",
            "barrier": barrier,
            "wait_for": count,
            "wait_s": _wait_s(deadline),
        }
        answer = _request(endpoint, request, _request_timeout(deadline))
        if int(answer.get("count", 0)) >= count:
            return
        if time.monotonic() >= deadline:
            raise BootstrapError(f"barrier {barrier!r} did not reach {count} within {timeout}s")


def _wait_s(deadline: float) -> float:
    """How long the server may hold a request: the time left, within its bound."""
    return min(max(deadline - time.monotonic(), 0.0), MAX_WAIT_S)


def _request_timeout(deadline: float) -> float:
    """Time left before ``deadline`` plus what a loopback server needs to answer."""
    return max(deadline - time.monotonic(), 0.0) + _MIN_ANSWER_S
