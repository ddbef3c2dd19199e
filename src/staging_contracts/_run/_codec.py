"""The one codec of rank⇄driver traffic: typed messages, one JSON document each.

A :class:`Message` is a frozen dataclass known by its class name (unique across the package:
a second class of the same name is refused). The demo and soak ranks talk to their driver
with the messages of :mod:`staging_contracts._cluster._messages` over ZMQ; the harness's rank
processes talk to their parent with those of :mod:`staging_contracts.testing._rank_steps`
over a pipe. Both go through :func:`encode` and :func:`decode`.

**Document.** ``kind`` (the class's name), the sender's ``role``, ``rank`` and ``pid`` for an
event (``None`` for a command), and ``body``: the dataclass's fields, a field whose type has
``to_json``/``from_json`` (such as :class:`~staging_contracts._run._rank_info.RankInfo`)
through them, an enum by its value, a set as a list (in one order), ``dict`` keys (``str``,
``int`` or an ``int`` enum) as text. Every field of every message is of a type it reads back
(``tests/test_rank_messages.py`` walks them).
:func:`decode` reads it back against the field types, or raises
:class:`~staging_contracts._control.wire.MalformedMessage`. :func:`bind_pull` makes the
loopback socket that takes them (a driver's inbox, a soak rank's commands).

**Threads:** the codec is pure (any thread); a socket belongs to the thread that uses it.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import types
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

import zmq

from .._control.wire import MalformedMessage

logger = logging.getLogger(__name__)


class Message:
    """A command or an event; every subclass is a frozen dataclass, known by its name.

    Raises:
        TypeError: at class creation, when another message class already has the name.
    """

    KINDS: ClassVar[dict[str, type[Message]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        known = Message.KINDS.get(cls.__name__)
        # ``@dataclass(slots=True)`` makes the class again, under the same name and place
        if known is not None and (known.__module__, known.__qualname__) != (
            cls.__module__,
            cls.__qualname__,
        ):
            raise TypeError(
                f"message kind {cls.__name__!r} is already {known.__module__}.{known.__qualname__}"
            )
        Message.KINDS[cls.__name__] = cls


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
    """One message as bytes (one ZMQ frame, or one pipe message); with ``role`` and
    ``rank``, an event of process ``pid`` (this one's unless given)."""
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


@dataclass(frozen=True, slots=True)
class RankEvent:
    """An event a rank sent, with its sender (every part known)."""

    message: Message
    role: str
    rank: int
    pid: int
    """The sending process: a respawned rank has the same ``role`` and ``rank``, not this."""

    @property
    def key(self) -> tuple[str, int]:
        """``(role, rank)``."""
        return self.role, self.rank


def rank_event(raw: bytes) -> RankEvent | None:
    """``raw`` decoded as an event a rank sent, or ``None`` when it is malformed or names no
    sender: a warning is logged and the event dropped, so that a driver's inbox keeps serving.

    **Called by** a driver's inbox loop (the demo's runner, the soak), on its thread.
    """
    try:
        got = decode(raw)
    except MalformedMessage as exc:
        logger.warning("malformed event from a rank dropped: %s", exc)
        return None
    if got.role is None or got.rank is None or got.pid is None:
        logger.warning("event without a sender dropped: %s", type(got.message).__name__)
        return None
    return RankEvent(got.message, got.role, got.rank, got.pid)


def _plain(value: object) -> object:
    """``value`` as JSON-ready values."""
    to_json = getattr(value, "to_json", None)
    if callable(to_json):
        return to_json()
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, set | frozenset):
        return sorted((_plain(v) for v in value), key=json.dumps)  # any items: one order
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
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
    if origin in (list, set, frozenset):
        if not isinstance(value, list):
            raise ValueError(f"{value!r:.60} is not a list")
        return origin(_build(args[0], v) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{value!r:.60} is not an object")
        return {_key(args[0], k): _build(args[1], v) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            if type(value) not in (int, float, str):
                raise ValueError
            return hint(value)
        except ValueError:
            raise ValueError(f"{value!r:.60} is not a {hint.__name__}") from None
    if isinstance(hint, type) and hasattr(hint, "from_json"):
        return hint.from_json(value)
    if is_dataclass(hint):
        return _dataclass(hint, value)
    if hint is float and type(value) in (int, float):
        return float(value)  # type: ignore[arg-type]  # an int or a float
    if hint in (bool, int, str) and type(value) is hint:
        return value
    raise ValueError(f"{value!r:.60} is not {getattr(hint, '__name__', hint)}")


def _key(hint: Any, text: str) -> Any:
    """A ``dict`` key read back from its text: a ``str`` as it is, anything else (an ``int``,
    an ``int`` enum) by its decimal value."""
    return text if hint is str else _build(hint, int(text))


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
