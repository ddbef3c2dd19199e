"""Rank⇄driver traffic, typed: the events a rank process sends its driver (a demo rank's
progress and final :class:`RankSummary`, a soak rank's rooms, counters and exit) and the
commands a soak driver sends its ranks, each a frozen dataclass, all on one codec.

**Codec.** :func:`encode` writes one JSON object per ZMQ message: ``kind`` (the class's name),
the sender's ``role``, ``rank`` and ``pid`` for an event (``None`` for a command), and ``body``
(the dataclass's fields; a field whose type has ``to_json``/``from_json``, such as
:class:`~.bootstrap.RankInfo`, goes through them; ``dict`` keys as text). :func:`decode` reads
it back against the field types, or raises :class:`~staging_contracts._control.wire.
MalformedMessage`. :func:`bind_pull` makes the loopback socket that takes them (a driver's
inbox, a soak rank's commands).

**Threads:** the codec is pure (any thread); a socket belongs to the thread that uses it.
"""

from __future__ import annotations

import json
import os
import types
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

import zmq

from .._control.wire import MalformedMessage
from ..metrics._snapshot import MetricsSnapshot
from .bootstrap import RankInfo


class Message:
    """A command or an event; every subclass is a frozen dataclass, known by its name."""

    KINDS: ClassVar[dict[str, type[Message]]] = {}

    def __init_subclass__(cls) -> None:
        Message.KINDS[cls.__name__] = cls


# ---------------------------------------------------------------- a demo rank's events


@dataclass(frozen=True, slots=True)
class Ready(Message):
    """A demo rank met its peers and starts its requests."""


@dataclass(frozen=True, slots=True)
class RequestDone(Message):
    """A demo rank saw request ``index`` end."""

    index: int
    ok: bool


@dataclass(frozen=True, slots=True)
class RankMemory:
    """What one rank's process held at the ``done`` barrier, before verification (see
    :class:`~staging_contracts._cluster.rank.TransferMemory`): its peak RSS, counted from
    ``peak_rss_from`` (``"timed requests"``, or ``"process start"`` where the peak could not
    be reset), its RSS then (``None``: the kernel did not say) and, on CUDA, the allocator's
    peak since the timed requests began."""

    peak_rss_before_verify_bytes: int
    peak_rss_from: str
    rss_at_done_bytes: int | None = None
    cuda_max_allocated_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class RankSummary(Message):
    """A demo rank's final report: what it did (see :mod:`~staging_contracts._cluster.rank`
    for the clocks and the memory), or the error it stopped on and how far it got."""

    ok: bool = False
    stopped: bool = False
    """The driver stopped it (``SIGTERM``); :attr:`phase` and :attr:`rooms` say how far."""
    error: str | None = None
    trace: str | None = None
    phase: str = ""
    rooms: dict[int, bool] = field(default_factory=dict)
    """Requests it saw end before it stopped, and whether each succeeded."""
    mode: str = "staged"
    start: float | None = None
    end: float | None = None
    verified: bool = False
    problems: tuple[str, ...] = ()
    succeeded: tuple[int, ...] = ()
    failed: dict[int, str | None] = field(default_factory=dict)
    room_first_request_s: dict[int, float] = field(default_factory=dict)
    room_done_s: dict[int, float] = field(default_factory=dict)
    ring_peak: int | None = None
    ring_size: int | None = None
    ring_live_after: int = 0
    control_messages: int = 0
    malformed: int = 0
    chunks: int = 0
    registered_after: int = 0
    bytes_written: int = 0
    requests_sent: int = 0
    write_calls: int = 0
    transfers: int = 0
    peak_rss_bytes: int | None = None
    memory: RankMemory | None = None


# ---------------------------------------------------------------- a soak rank's events


@dataclass(frozen=True, slots=True)
class Serving(Message):
    """A soak rank is up: what it publishes and where it takes commands."""

    info: RankInfo
    commands: str


@dataclass(frozen=True, slots=True)
class PeersTaken(Message):
    """A soak rank took a :class:`Peers` command (``count`` ranks): it can open rooms."""

    count: int


@dataclass(frozen=True, slots=True)
class RoomEnded(Message):
    """One room on one soak rank: ``state`` ``ok``, ``failed`` or ``hung``, at ``t``
    (``time.monotonic()``, the same clock in every process of the host)."""

    room: int
    index: int
    state: str
    t: float
    reason: str = ""
    verified: bool = False
    problems: tuple[str, ...] = ()
    release_error: str | None = None


@dataclass(frozen=True, slots=True)
class RankStatus(Message):
    """A soak rank's counters, the answer to :class:`AskStatus` ``id`` (side counters:
    ``None`` on the other side)."""

    id: int
    listener_alive: bool
    listener_received: int = 0
    listener_malformed: int = 0
    listener_errors: int = 0
    staging_malformed: int = 0
    staging_dropped: int = 0
    unauthorized: int = 0
    control_sent: int = 0
    control_dropped: int = 0
    room_threads: int = 0
    waiting_rooms: int = 0
    rss: tuple[tuple[float, int], ...] = ()
    open_rooms: int = 0
    ring_live_count: int | None = None
    ring_live_bytes: int | None = None
    ring_size: int | None = None
    fenced_rooms: int | None = None
    bytes_written: int | None = None
    answers_held: int | None = None
    answers_dropped: int | None = None
    early_meta: int | None = None
    early_meta_held: int | None = None
    early_meta_dropped: int | None = None

    def holds(self) -> bool:
        """Whether anything is held: ring, fences, open rooms, rooms waiting for peers, or
        a dead listener."""
        held = (self.ring_live_count, self.ring_live_bytes, self.fenced_rooms)
        return any(held) or bool(self.open_rooms or self.waiting_rooms) or not self.listener_alive


@dataclass(frozen=True, slots=True)
class RankError(Message):
    """A command that raised (the rank lives on)."""

    error: str
    command: str = ""


@dataclass(frozen=True, slots=True)
class ListenerDown(Message):
    """The rank's control listener thread ended."""


@dataclass(frozen=True, slots=True)
class Exit(Message):
    """A soak rank is on its way out."""

    ok: bool
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Metrics(Message):
    """A rank's counters for the driver's Prometheus relay (``--metrics-port``)."""

    snapshot: MetricsSnapshot


# ---------------------------------------------------------------- a soak driver's commands


@dataclass(frozen=True, slots=True)
class Peers(Message):
    """The current ranks of the other side (every prefill instance's, in order)."""

    ranks: tuple[RankInfo, ...]


@dataclass(frozen=True, slots=True)
class OpenRoom(Message):
    """Open ``room`` for workload request ``index``, from prefill ``instance``."""

    room: int
    index: int
    instance: int = 0


@dataclass(frozen=True, slots=True)
class AskStatus(Message):
    """Answer with a :class:`RankStatus` of this ``id``."""

    id: int


@dataclass(frozen=True, slots=True)
class Trust(Message):
    """Trust the participant at ``endpoint`` by its CURVE public ``key`` (Z85)."""

    endpoint: str
    key: str


@dataclass(frozen=True, slots=True)
class Stop(Message):
    """Close the backend and exit."""


# ---------------------------------------------------------------- the codec


@dataclass(frozen=True, slots=True)
class Received:
    """A decoded message and who sent it (``role``, ``rank``, ``pid``: ``None`` for a
    command)."""

    message: Message
    role: str | None = None
    rank: int | None = None
    pid: int | None = None


def encode(
    message: Message, role: str | None = None, rank: int | None = None, pid: int | None = None
) -> bytes:
    """One message as the bytes of one ZMQ frame; with ``role`` and ``rank``, an event of
    process ``pid`` (this one's unless given)."""
    pid = (pid or os.getpid()) if role is not None else None
    kind = type(message).__name__
    doc = {"kind": kind, "role": role, "rank": rank, "pid": pid, "body": _plain(message)}
    return json.dumps(doc).encode()


def decode(raw: bytes) -> Received:
    """Read back what :func:`encode` wrote.

    Raises:
        MalformedMessage: not JSON, an unknown kind, or a field missing or of the wrong type.
    """
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise MalformedMessage(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("kind") not in Message.KINDS:
        raise MalformedMessage(f"not a rank message: {raw[:80]!r}")
    kind = Message.KINDS[doc["kind"]]
    try:
        message = _build(kind, doc.get("body"))
        role = _build(str | None, doc.get("role"))
        rank, pid = _build(int | None, doc.get("rank")), _build(int | None, doc.get("pid"))
    except (ValueError, TypeError) as exc:
        raise MalformedMessage(str(exc), message_type=kind.__name__) from None
    if (role is None) != (rank is None):
        raise MalformedMessage("a sender needs both role and rank", message_type=kind.__name__)
    return Received(message, role, rank, pid)


def _plain(value: object) -> object:
    """``value`` as JSON-ready values."""
    to_json = getattr(value, "to_json", None)
    if callable(to_json):
        return to_json()
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _build(hint: Any, value: object) -> Any:
    """``value`` (decoded JSON) as an instance of type ``hint``.

    Raises:
        ValueError: it is not one.
    """
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _build(arg, value)
            except ValueError:
                continue
        raise ValueError(f"{value!r:.60} is not {hint}")
    if origin is tuple:
        if not isinstance(value, list):
            raise ValueError(f"{value!r:.60} is not a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v) for v in value)
        if len(args) != len(value):
            raise ValueError(f"{value!r:.60} does not have {len(args)} items")
        return tuple(_build(a, v) for a, v in zip(args, value, strict=True))
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{value!r:.60} is not an object")
        key = int if args[0] is int else str
        return {key(k): _build(args[1], v) for k, v in value.items()}
    if isinstance(hint, type) and hasattr(hint, "from_json"):
        return hint.from_json(value)
    if is_dataclass(hint):
        return _dataclass(hint, value)
    if hint is float and type(value) in (int, float):
        return float(value)  # type: ignore[arg-type]  # an int or a float
    if hint in (bool, int, str) and type(value) is hint:
        return value
    raise ValueError(f"{value!r:.60} is not {getattr(hint, '__name__', hint)}")


def _dataclass(cls: Any, value: object) -> Any:
    if not isinstance(value, dict):
        raise ValueError(f"{cls.__name__}: {value!r:.60} is not an object")
    hints = get_type_hints(cls)
    given: dict[str, object] = {}
    for f in fields(cls):
        if f.name in value:
            given[f.name] = _build(hints[f.name], value[f.name])
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ValueError(f"{cls.__name__}: field {f.name!r} missing")
    return cls(**given)


# ---------------------------------------------------------------- the socket


def bind_pull(ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[zmq.Socket[bytes], str]:
    """A PULL socket bound on loopback (a free port, no linger), and its endpoint: where a
    driver takes its ranks' events, or a soak rank its driver's commands."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    return sock, raw.decode() if isinstance(raw, bytes) else str(raw)
