"""Bootstrap: how prefill and decode ranks in separate processes find each other.

A :class:`BootstrapServer` (a ZMQ ROUTER socket on loopback, served by a thread) collects
one :class:`RankInfo` per rank — its control endpoint, engine session id and metadata, and on
decode the staging ring's base address and size — and answers queries for all ranks of a
role once every one of them has registered. Requests and answers are small JSON documents.

Every request is validated in full before it touches the server's state: strict JSON (no
``NaN``/``Infinity``, no float that overflows, bounded nesting), each field of the type it
must have and within its bounds. A bad request gets an error answer
(``{"ok": false, "error": "..."}``) and changes nothing; the server thread survives any
request, and its log lines about bad requests are rate-limited. A frame over
:data:`MAX_REQUEST_BYTES` is dropped by ZMQ before it is read (``ZMQ_MAXMSGSIZE``).

Waiting is done by the server: :func:`query_ranks` and :func:`wait_barrier` send one request
with ``wait_s``, which the server answers as soon as it is satisfied (or when ``wait_s`` ran
out), so no rank polls with a new connection every few milliseconds, taking CPU from the
ranks still transferring. At most :data:`MAX_WAITERS` requests are held at once, and at most
:data:`MAX_WAITERS_PER_PEER` of one peer address (so one process cannot take every slot from
the ranks of other hosts); they are re-checked only after a registration or an arrival changed
something, with a count comparison each, and their deadlines sit in a heap. A request refused
for want of a slot is answered ``busy``, and :func:`query_ranks` and :func:`wait_barrier` try
again with a bounded backoff (:data:`RETRY_FIRST_S` doubling up to :data:`RETRY_MAX_S`) until
their own timeout.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import zmq

from .._control.security import (
    FROM_ENV,
    CurveKeys,
    check_insecure_bind,
    load_cluster_secret,
    resolve_secret,
    zap_handler,
)
from .._control.transport import LOG_BURST, LOG_INTERVAL_S, LogThrottle, recv_frames
from .._run._rank_info import (
    MAX_NAME_CHARS,
    MAX_POOL_POINTERS,
    MAX_RANKS,
    ROLES,
    RankInfo,
    curve_key_text,
    int_field,
    show,
    str_field,
)

__all__ = [
    "curve_key_text",
    "MAX_ANSWER_BYTES",
    "MAX_NAME_CHARS",
    "MAX_POOL_POINTERS",
    "MAX_RANKS",
    "MAX_REQUEST_BYTES",
    "MAX_WAITERS",
    "MAX_WAITERS_PER_PEER",
    "MAX_WAIT_S",
    "RETRY_FIRST_S",
    "RETRY_MAX_S",
    "BootstrapBusy",
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
"""Largest request the server reads (the ``ZMQ_MAXMSGSIZE`` of its socket), with wide margin
over a registration's engine metadata. ZMQ drops a larger frame while reading its header and
disconnects its sender, whose request then times out."""
MAX_ANSWER_BYTES: Final = 64 << 20
"""Largest answer, 64 MiB: the ``ZMQ_MAXMSGSIZE`` of the client sockets. A query's answer
holds every rank info it asks for; the server answers an error instead of a larger one."""
MAX_WAIT_S: Final = 300.0
"""Longest ``wait_s`` the server holds a request for."""
MAX_WAITERS: Final = 1024
"""Most requests the server holds at once (a cluster holds at most one per rank). Past it, a
request that would wait gets a ``busy`` answer at once, and the client retries."""
MAX_WAITERS_PER_PEER: Final = 256
"""Most requests held at once for one peer address (ZMQ's ``Peer-Address``, the sender's
IP): a quarter of :data:`MAX_WAITERS`, so that one host cannot hold every slot; the ranks of
one host hold one each."""
RETRY_FIRST_S: Final = 0.05
"""First pause of a client before it asks again after a ``busy`` answer."""
RETRY_MAX_S: Final = 2.0
"""Longest pause between two tries (the pause doubles from :data:`RETRY_FIRST_S`)."""
_OPS: Final = ("register", "query", "arrive", "count")
BOOTSTRAP_SERVER_LABEL: Final = "bootstrap-server"
BOOTSTRAP_CLIENT_LABEL: Final = "bootstrap-client"
"""Labels of the CURVE key pairs every holder of the cluster secret derives for the bootstrap."""
_MIN_ANSWER_S: Final = 1.0
_SERVER_POLL_MS: Final = 20
_SERVE_BATCH: Final = 64
"""Most requests served between two checks of the held requests' deadlines."""
_ENVELOPE_FRAMES: Final = 3
"""A REQ client's request arrives at the ROUTER as ``[identity, b"", body]``."""
_SHOW_CHARS: Final = 40
_MAX_ERROR_CHARS: Final = 200


class BootstrapError(RuntimeError):
    """The bootstrap server did not answer, or refused a request."""


class BootstrapBusy(BootstrapError):
    """The bootstrap server could not hold the request now (no waiter slot): ask again."""


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:_SHOW_CHARS]}")
    return value


@dataclass(frozen=True, slots=True)
class _Request:
    """A request, validated: nothing about it can fail later."""

    op: str
    key: str
    """The role (register, query) or the barrier (arrive, count)."""
    want: int
    """Ranks a query waits for, or parties a count waits for."""
    wait_s: float
    info: RankInfo | None = None
    party: str = ""
    replace: bool = False
    """A registration that may replace another participant's entry (after a restart)."""


def _parse_request(raw: bytes) -> _Request:
    """Parse and validate one request body.

    Raises:
        ValueError: the request is malformed (the text says why, briefly).
    """
    if len(raw) > MAX_REQUEST_BYTES:  # ZMQ drops these already; a second line of defence
        raise ValueError(f"request too large ({len(raw)} bytes, at most {MAX_REQUEST_BYTES})")
    try:
        doc = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("request is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, overlong integers
        raise ValueError(f"request is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("request must be an object")
    wait_s = doc.get("wait_s", 0)
    if type(wait_s) not in (int, float) or not 0 <= wait_s <= MAX_WAIT_S:
        raise ValueError(f"wait_s must be a number in [0, {MAX_WAIT_S}]")
    op = doc.get("op")
    if op == "register":
        info = RankInfo.from_json(doc.get("info"))
        replace = doc.get("replace", False)
        if type(replace) is not bool:
            raise ValueError(f"replace must be true or false, got {show(replace)}")
        return _Request("register", info.role, 0, float(wait_s), info=info, replace=replace)
    if op == "query":
        role = str_field(doc, "role")
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {show(role)}")
        count = int_field(doc, "count", 1, MAX_RANKS, None)
        return _Request("query", role, count, float(wait_s))
    if op == "arrive":
        barrier, party = str_field(doc, "barrier"), str_field(doc, "party")
        return _Request("arrive", barrier, 0, float(wait_s), party=party)
    if op == "count":
        barrier = str_field(doc, "barrier")
        wait_for = int_field(doc, "wait_for", 0, MAX_RANKS, 0)
        return _Request("count", barrier, wait_for, float(wait_s))
    raise ValueError(f"unknown op {show(op)} (expected one of {', '.join(_OPS)})")


@dataclass(slots=True)
class _Waiter:
    """A request the server answers once it is satisfied, or at ``deadline``."""

    identity: bytes
    request: _Request
    deadline: float
    peer: str = ""
    """The sender's address (its share of the slots)."""


def _error(text: str) -> dict[str, Any]:
    if len(text) > _MAX_ERROR_CHARS:
        text = text[: _MAX_ERROR_CHARS - 3] + "..."
    return {"ok": False, "error": text}


class BootstrapServer:
    """Collects rank infos and answers queries, on a thread of its own.

    **Thread-safety:** ``start``/``stop`` from the owner's thread; requests are served on
    the server thread; ``infos``, ``alive``, ``waiting`` and the counters may be read from any
    thread.

    Args:
        host: address to bind (loopback by default).
        log_burst: log lines per interval about bad requests (then a summary).
        log_interval_s: the interval of that rate limit.
        secret: the cluster secret; :data:`FROM_ENV` (the default) reads it from the
            environment, ``None`` runs unauthenticated.
        allow_insecure: bind a non-loopback ``host`` even without a secret.
        max_waiters: most requests held at once.
        max_waiters_per_peer: most requests held at once for one peer address.

    Raises:
        ValueError: a bound on waiters is below 1.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        log_burst: int = LOG_BURST,
        log_interval_s: float = LOG_INTERVAL_S,
        secret: bytes | str | None = FROM_ENV,
        allow_insecure: bool = False,
        max_waiters: int = MAX_WAITERS,
        max_waiters_per_peer: int = MAX_WAITERS_PER_PEER,
    ) -> None:
        if max_waiters < 1 or max_waiters_per_peer < 1:
            raise ValueError(
                f"max_waiters={max_waiters} and max_waiters_per_peer={max_waiters_per_peer} "
                "must be >= 1"
            )
        self.max_waiters = max_waiters
        self.max_waiters_per_peer = max_waiters_per_peer
        self._per_peer: dict[str, int] = {}
        """Peer address -> requests of it held now."""
        cluster_secret = resolve_secret(secret)
        if cluster_secret is None:
            check_insecure_bind(host, allow_insecure=allow_insecure)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._domain = f"staging-contracts-bootstrap-{id(self):x}"
        self.authenticated = cluster_secret is not None
        """Whether only holders of the cluster secret can reach the server (CURVE)."""
        if cluster_secret is not None:
            client = CurveKeys.derive(cluster_secret, BOOTSTRAP_CLIENT_LABEL).public
            CurveKeys.derive(cluster_secret, BOOTSTRAP_SERVER_LABEL).serve(
                self._socket, self._domain
            )
            zap_handler(self._ctx).register(self._domain, lambda key: key == client)
        try:
            self._socket.bind(f"tcp://{host}:*")
        except zmq.ZMQError:
            self._socket.close(linger=0)
            raise
        last = self._socket.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint: str = last.decode() if isinstance(last, bytes) else str(last)
        """Where ranks send their requests."""
        self._rejected_log = LogThrottle(
            logger, "bootstrap: rejected requests", burst=log_burst, interval_s=log_interval_s
        )
        self._failed_log = LogThrottle(
            logger, "bootstrap: failed requests", burst=log_burst, interval_s=log_interval_s
        )
        self._lock = threading.Lock()
        self._ranks: dict[str, dict[int, RankInfo]] = {}
        self._barriers: dict[str, set[str]] = {}
        self._waiters: dict[int, _Waiter] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._sequence = itertools.count()
        self._changed = False
        self.requests_served = 0
        """Requests received so far (each wait is one request, however long it waits)."""
        self.requests_refused = 0
        """Requests answered with an error (malformed, out of bounds, server busy, or a bug)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bootstrap-server", daemon=True)

    def start(self) -> None:
        """Start serving."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving, refuse the held requests and close the socket; safe to call twice.

        Raises:
            TimeoutError: the thread did not stop within ``timeout``.
        """
        self._stop.set()
        if self.authenticated:
            zap_handler(self._ctx).unregister(self._domain)
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"bootstrap server did not stop in {timeout}s")
        elif not self._socket.closed:
            self._socket.close(linger=0)

    @property
    def denied(self) -> int:
        """Connections refused for not holding the cluster secret (0 without one)."""
        return zap_handler(self._ctx).denied(self._domain) if self.authenticated else 0

    @property
    def alive(self) -> bool:
        """True while the server thread runs."""
        return self._thread.is_alive()

    @property
    def waiting(self) -> int:
        """Requests held now (at most ``max_waiters``)."""
        return len(self._waiters)

    def infos(self, role: str) -> list[RankInfo]:
        """The ranks of a role registered so far, by rank."""
        with self._lock:
            found = list(self._ranks.get(role, {}).values())
        return sorted(found, key=lambda info: info.tp_rank)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(self._poll_ms()):
                    self._serve_batch()
                self._guarded(self._answer_waiters)  # after any change, and for waits that ran out
                self._rejected_log.tick()
                self._failed_log.tick()
        finally:
            self._guarded(self._refuse_waiters)
            self._rejected_log.flush()
            self._failed_log.flush()
            self._socket.close(linger=0)

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a bug outside any one request: log it, keep serving
            if self._failed_log.admit():
                logger.exception("bootstrap: internal error; the server keeps serving")

    def _poll_ms(self) -> int:
        if not self._deadlines:
            return _SERVER_POLL_MS
        soonest = self._deadlines[0][0] - time.monotonic()
        return max(0, min(_SERVER_POLL_MS, int(soonest * 1000) + 1))

    def _serve_batch(self) -> None:
        for _ in range(_SERVE_BATCH):
            try:
                frames, extra, _, peer = recv_frames(
                    self._socket, max_frames=_ENVELOPE_FRAMES, flags=zmq.NOBLOCK, peer_address=True
                )
            except zmq.Again:
                return
            identity = frames[0]
            try:
                self._serve(frames, extra, peer or "")
            except Exception:  # a bug: answer it, log it, keep serving
                self.requests_refused += 1
                if self._failed_log.admit():
                    logger.exception("bootstrap: request failed; the server keeps serving")
                self._reply(identity, _error("internal error in the bootstrap server"))

    def _serve(self, frames: list[bytes], extra: int, peer: str = "") -> None:
        identity = frames[0]
        self.requests_served += 1
        if extra or len(frames) != _ENVELOPE_FRAMES or frames[1]:
            count = len(frames) + extra
            self._refuse(identity, f"expected a REQ request (2 frames: b'', body), got {count - 1}")
            return
        try:
            request = _parse_request(frames[2])
        except ValueError as exc:
            self._refuse(identity, str(exc))
            return
        conflict = self._conflict(request)
        if conflict is not None:
            self._refuse(identity, conflict)
            return
        self._apply(request)
        if request.wait_s > 0 and not self._satisfied(request):
            busy = self._busy(peer)
            if busy is not None:
                self._refuse(identity, busy, busy=True)
                return
            sequence = next(self._sequence)
            deadline = time.monotonic() + request.wait_s
            self._waiters[sequence] = _Waiter(identity, request, deadline, peer)
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            heapq.heappush(self._deadlines, (deadline, sequence))
        else:
            self._reply(identity, self._answer(request))

    def _busy(self, peer: str) -> str | None:
        """Why a request of ``peer`` cannot be held now (``None``: it can)."""
        if len(self._waiters) >= self.max_waiters:
            return f"server busy: {self.max_waiters} requests already wait; retry later"
        held = self._per_peer.get(peer, 0)
        if held >= self.max_waiters_per_peer:
            return (
                f"server busy: {held} requests of {peer or 'this peer'} already wait "
                f"(max_waiters_per_peer); retry later"
            )
        return None

    def _release(self, waiter: _Waiter) -> None:
        """A held request was answered: its slot returns to its peer."""
        left = self._per_peer.get(waiter.peer, 1) - 1
        if left > 0:
            self._per_peer[waiter.peer] = left
        else:
            self._per_peer.pop(waiter.peer, None)

    def _refuse(self, identity: bytes, why: str, *, busy: bool = False) -> None:
        self.requests_refused += 1
        answer = _error(why)
        if busy:
            answer["busy"] = True
        if self._rejected_log.admit():
            logger.warning("bootstrap request rejected: %s", answer["error"])
        self._reply(identity, answer)

    def _conflict(self, request: _Request) -> str | None:
        """Why a registration may not replace the entry it names (``None``: it may)."""
        info = request.info
        if request.op != "register" or info is None or request.replace:
            return None
        with self._lock:
            known = self._ranks.get(request.key, {}).get(info.tp_rank)
        if known is None or (known.endpoint, known.curve_key) == (info.endpoint, info.curve_key):
            return None
        return (
            f"{info.role} rank {info.tp_rank} is already registered by another participant "
            f"({known.endpoint}); a restarted rank registers again with replace=true"
        )

    def _apply(self, request: _Request) -> None:
        """Record a registration or an arrival (nothing for the reads)."""
        if request.op == "register" and request.info is not None:
            with self._lock:
                self._ranks.setdefault(request.key, {})[request.info.tp_rank] = request.info
            self._changed = True
        elif request.op == "arrive":
            self._barriers.setdefault(request.key, set()).add(request.party)
            self._changed = True

    def _satisfied(self, request: _Request) -> bool:
        """Whether ``request`` need not wait."""
        if request.op == "query":
            return len(self._ranks.get(request.key, ())) >= request.want
        if request.op == "count":
            return len(self._barriers.get(request.key, ())) >= request.want
        return True

    def _answer(self, request: _Request) -> dict[str, Any]:
        if request.op == "query":
            found = self.infos(request.key)
            if len(found) < request.want:
                return {"ok": True, "pending": request.want - len(found)}
            return {"ok": True, "infos": [info.to_json() for info in found[: request.want]]}
        if request.op == "count":
            return {"ok": True, "count": len(self._barriers.get(request.key, ()))}
        return {"ok": True}

    def _answer_waiters(self) -> None:
        """Answer the held requests now satisfied (only after a change) or out of time."""
        bodies: dict[tuple[str, str, int], bytes] = {}  # one answer per distinct request
        if self._changed:
            self._changed = False
            for sequence, waiter in list(self._waiters.items()):
                if self._satisfied(waiter.request):
                    del self._waiters[sequence]
                    self._reply_waiter(waiter, bodies)
        now = time.monotonic()
        heap = self._deadlines
        while heap and (heap[0][0] <= now or heap[0][1] not in self._waiters):
            _, sequence = heapq.heappop(heap)
            expired = self._waiters.pop(sequence, None)
            if expired is not None:
                self._reply_waiter(expired, bodies)
        if len(heap) > 2 * len(self._waiters) + 64:  # drop entries of answered requests
            self._deadlines = [(w.deadline, seq) for seq, w in self._waiters.items()]
            heapq.heapify(self._deadlines)

    def _reply_waiter(self, waiter: _Waiter, bodies: dict[tuple[str, str, int], bytes]) -> None:
        self._release(waiter)
        request = waiter.request
        key = (request.op, request.key, request.want)
        body = bodies.get(key)
        if body is None:
            body = bodies[key] = self._encode(self._answer(request))
        self._send(waiter.identity, body)

    def _refuse_waiters(self) -> None:
        """On stop: tell every held request that no answer will come."""
        body = self._encode(_error("bootstrap server stopped"))
        for waiter in self._waiters.values():
            self._send(waiter.identity, body)
        self._waiters.clear()
        self._deadlines.clear()
        self._per_peer.clear()

    def _encode(self, answer: dict[str, Any]) -> bytes:
        body = json.dumps(answer).encode()
        if len(body) > MAX_ANSWER_BYTES:
            self.requests_refused += 1
            body = json.dumps(
                _error(f"answer too large ({len(body)} bytes, at most {MAX_ANSWER_BYTES})")
            ).encode()
        return body

    def _reply(self, identity: bytes, answer: dict[str, Any]) -> None:
        self._send(identity, self._encode(answer))

    def _send(self, identity: bytes, body: bytes) -> None:
        try:
            self._socket.send_multipart([identity, b"", body], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client left: nobody to answer
            logger.info("bootstrap: answer not delivered: %s", exc)


def _request(endpoint: str, doc: dict[str, Any], timeout: float) -> dict[str, Any]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_ANSWER_BYTES)
    cluster_secret = load_cluster_secret()
    if cluster_secret is not None:
        server = CurveKeys.derive(cluster_secret, BOOTSTRAP_SERVER_LABEL).public
        CurveKeys.derive(cluster_secret, BOOTSTRAP_CLIENT_LABEL).connect_to(sock, server)
    try:
        sock.connect(endpoint)
        sock.send(json.dumps(doc).encode())
        if not sock.poll(int(timeout * 1000)):
            raise BootstrapError(f"bootstrap server {endpoint} did not answer in {timeout}s")
        raw = sock.recv()
    finally:
        sock.close(linger=0)
    try:
        answer = json.loads(raw)
    except ValueError:
        raise BootstrapError(f"bootstrap server {endpoint} sent a malformed answer") from None
    if isinstance(answer, dict) and answer.get("busy") is True:
        raise BootstrapBusy(f"bootstrap server refused: {answer}")
    if not isinstance(answer, dict) or not answer.get("ok"):
        raise BootstrapError(f"bootstrap server refused: {answer}")
    return answer


def _wait_until(
    endpoint: str,
    doc: dict[str, Any],
    timeout: float,
    done: Callable[[dict[str, Any]], bool],
    failure: str,
) -> dict[str, Any]:
    """Ask ``doc`` (with the ``wait_s`` left) until an answer is ``done``; a ``busy`` answer
    is asked again after a pause (from :data:`RETRY_FIRST_S`, doubled each time up to
    :data:`RETRY_MAX_S`, never past the deadline).

    Raises:
        BootstrapError: no answer was ``done`` within ``timeout`` (``failure``, then why;
            :class:`BootstrapBusy` if the server was still busy then).
    """
    deadline = time.monotonic() + timeout
    pause = RETRY_FIRST_S
    while True:
        left = max(deadline - time.monotonic(), 0.0)
        try:
            answer = _request(
                endpoint, {**doc, "wait_s": min(left, MAX_WAIT_S)}, left + _MIN_ANSWER_S
            )
        except BootstrapBusy:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            # A little jitter, so that ranks refused together do not all come back together.
            time.sleep(min(left, pause * random.uniform(0.5, 1.0)))
            pause = min(pause * 2, RETRY_MAX_S)
            continue
        if done(answer):
            return answer
        if time.monotonic() >= deadline:
            busy = " (the server was busy: no waiter slot)" if pause > RETRY_FIRST_S else ""
            raise BootstrapError(f"{failure} within {timeout}s{busy}")


def register_rank(
    endpoint: str, info: RankInfo, timeout: float = 10.0, *, replace: bool = False
) -> None:
    """Tell the bootstrap server about this rank.

    Registering the same entry again is harmless; an entry of another participant (another
    endpoint or key) is replaced only with ``replace=True`` (a rank restarted after a crash).

    Raises:
        BootstrapError: no answer within ``timeout``, or refused (e.g. the rank is registered
            by another participant and ``replace`` is false).
    """
    _request(endpoint, {"op": "register", "info": info.to_json(), "replace": replace}, timeout)


def query_ranks(endpoint: str, role: str, count: int, timeout: float = 60.0) -> list[RankInfo]:
    """Wait until ``count`` ranks of ``role`` have registered; return them by rank.

    A ``busy`` answer (the server holds as many requests as it may) is retried with a bounded
    backoff until ``timeout``.

    Raises:
        BootstrapError: they did not all register within ``timeout`` (:class:`BootstrapBusy`
            if the server was still busy then).
    """
    answer = _wait_until(
        endpoint,
        {"op": "query", "role": role, "count": count},
        timeout,
        lambda answer: isinstance(answer.get("infos"), list),
        f"{count} {role} ranks did not register",
    )
    return [RankInfo.from_json(doc) for doc in answer["infos"]]


def arrive(endpoint: str, barrier: str, party: str, timeout: float = 10.0) -> None:
    """Record that ``party`` reached ``barrier`` (idempotent).

    Raises:
        BootstrapError: no answer within ``timeout``.
    """
    _request(endpoint, {"op": "arrive", "barrier": barrier, "party": party}, timeout)


def wait_barrier(endpoint: str, barrier: str, count: int, timeout: float = 60.0) -> None:
    """Block until ``count`` parties reached ``barrier``.

    A ``busy`` answer is retried with a bounded backoff until ``timeout``.

    Raises:
        BootstrapError: they did not within ``timeout`` (:class:`BootstrapBusy` if the server
            was still busy then).
    """
    _wait_until(
        endpoint,
        {"op": "count", "barrier": barrier, "wait_for": count},
        timeout,
        lambda answer: int(answer.get("count", 0)) >= count,
        f"barrier {barrier!r} did not reach {count}",
    )
