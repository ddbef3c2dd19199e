"""Per-request and peer control messages (beside the four staging messages of `wire`).

* ``ROOM_META`` (decode → prefill): decode rank ``decode_rank`` has registered ``room`` for
  ``num_pages`` pages on a grid of ``chunk_pages`` pages; the prefill may start writing.
  ``opening`` (a trailing frame, optional on the wire) names this registration of the room
  id: a random non-zero 64-bit number the decode rank draws each time it registers the room,
  so both sides can tell one opening of a room id from the next.
* ``ROOM_FAILED`` (either direction): the sender gave ``room`` up; the receiver fails it too,
  so one failed request never waits for a timeout on the other side. It carries the
  ``opening`` it ends (the decode rank's, from ``ROOM_META``) and the sender's ``reply_to``
  (two trailing frames, optional on the wire: a frame without them is an old sender's and
  names no opening). It is re-sent with a bounded backoff until the receiver answers
  ``ROOM_FAILED_ACK``, the receiver is declared dead, or its copies are spent; a receiver
  ignores (and counts) a copy whose opening is not the room's current one, so a late copy
  never fails a later opening of the same room id.
* ``ROOM_FAILED_ACK`` (either direction): the receiver of ``ROOM_FAILED`` for ``opening``
  of ``room`` heard it (whether it failed the room or found the opening stale); sent to the
  ``reply_to`` of the ``ROOM_FAILED``, naming the acknowledging listener ``endpoint``.
* ``ROOM_FENCE`` (decode → prefill): decode session ``session_id`` failed ``room`` and keeps
  its ring regions until each writer confirms that it will not write into them again; the
  writer answers ``ROOM_FENCED`` at ``reply_to``.
* ``ROOM_FENCED`` (prefill → decode): writer ``writer_rank`` has no write of ``room`` into
  session ``session_id`` in flight and will start none.
* ``PING`` / ``PONG`` (either direction): liveness. A peer that watches another sends it
  ``PING`` with its own endpoint; the other answers ``PONG`` with its own.

Frames are ASCII like the staging messages; decoding raises ``MalformedMessage``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Final

from .wire import MalformedMessage

__all__ = ["Ping", "Pong", "RoomFailed", "RoomFailedAck", "RoomFence", "RoomFenced", "RoomMeta"]

_UINT: Final = re.compile(rb"[0-9]{1,18}")
_TEXT: Final = re.compile(rb"[\x21-\x7e]{1,256}")
"""A session id or endpoint: 1 to 256 printable ASCII characters, no spaces."""
MAX_REASON_BYTES: Final = 512


def _text(frames: Sequence[bytes], index: int, field: str, kind: str) -> str:
    if not _TEXT.fullmatch(frames[index]):
        raise MalformedMessage("not 1 to 256 printable ASCII characters", index, field, kind)
    return frames[index].decode("ascii")


def _reason(frames: Sequence[bytes], index: int, kind: str) -> str:
    if len(frames[index]) > MAX_REASON_BYTES:
        raise MalformedMessage("reason too long", index, "reason", kind)
    return frames[index].decode("ascii", "replace")


def _encode_reason(reason: str) -> bytes:
    return reason.encode("ascii", "replace")[:MAX_REASON_BYTES]


def _uint(frames: Sequence[bytes], index: int, field: str, kind: str) -> int:
    if not _UINT.fullmatch(frames[index]):
        raise MalformedMessage("not a non-negative ASCII decimal integer", index, field, kind)
    return int(frames[index])


def _opening(frames: Sequence[bytes], index: int, kind: str) -> int:
    """An opening id: a non-zero decimal below 2**64."""
    frame = frames[index]
    if not (0 < len(frame) <= 20 and frame.isdigit()) or not 0 < int(frame) < 2**64:
        raise MalformedMessage("not an opening id (1 to 2**64 - 1)", index, "opening", kind)
    return int(frame)


def _frames(frames: Sequence[object], kind: bytes, count: int, *more: int) -> list[bytes]:
    """The frames as bytes, checked for type and count (``count``, or one of ``more``)."""
    raw = [bytes(f) if isinstance(f, bytes | bytearray | memoryview) else None for f in frames]
    name = kind.decode()
    if not raw or raw[0] != kind:
        raise MalformedMessage(f"expected {name}", 0, "type")
    if len(raw) != count and len(raw) not in more:
        counts = " or ".join(str(c) for c in (count, *more))
        raise MalformedMessage(f"{name} takes {counts} frames, got {len(raw)}", None, None, name)
    checked: list[bytes] = []
    for index, frame in enumerate(raw):
        if frame is None:
            raise MalformedMessage("frame is not bytes", index, None, name)
        checked.append(frame)
    return checked


@dataclass(frozen=True, slots=True)
class RoomMeta:
    """Decode has registered a room and is ready for its chunks (decode → prefill)."""

    KIND: ClassVar[bytes] = b"ROOM_META"

    room: int
    decode_rank: int
    num_pages: int
    chunk_pages: int
    opening: int = 0
    """This registration of the room id on the decode rank (``0``: an old sender's, none)."""

    def to_frames(self) -> list[bytes]:
        """Encode as multipart frames (``opening`` trails, when there is one)."""
        frames = [
            self.KIND,
            b"%d" % self.room,
            b"%d" % self.decode_rank,
            b"%d" % self.num_pages,
            b"%d" % self.chunk_pages,
        ]
        if self.opening:
            frames.append(b"%d" % self.opening)
        return frames

    @classmethod
    def from_frames(cls, frames: Sequence[object]) -> RoomMeta:
        """Decode frames.

        Raises:
            MalformedMessage: wrong type, frame count or integer syntax; zero page counts.
        """
        raw = _frames(frames, cls.KIND, 5, 6)
        name = cls.KIND.decode()
        room = _uint(raw, 1, "room", name)
        rank = _uint(raw, 2, "decode_rank", name)
        pages = _uint(raw, 3, "num_pages", name)
        grid = _uint(raw, 4, "chunk_pages", name)
        if pages < 1 or grid < 1:
            raise MalformedMessage("page counts must be >= 1", None, None, name)
        opening = _opening(raw, 5, name) if len(raw) == 6 else 0
        return cls(room, rank, pages, grid, opening)


@dataclass(frozen=True, slots=True)
class RoomFailed:
    """The sender gave a room up (either direction)."""

    KIND: ClassVar[bytes] = b"ROOM_FAILED"

    room: int
    reason: str
    opening: int = 0
    """The decode rank's opening of the room that ends (``0``: an old sender's, none)."""
    reply_to: str = ""
    """The sender's control listener, where ``ROOM_FAILED_ACK`` goes (with ``opening``)."""

    def to_frames(self) -> list[bytes]:
        """Encode as multipart frames (the reason is cut to ``MAX_REASON_BYTES`` ASCII;
        ``opening`` and ``reply_to`` trail when there is an opening).

        Raises:
            ValueError: an opening without a ``reply_to``.
        """
        frames = [self.KIND, b"%d" % self.room, _encode_reason(self.reason)]
        if self.opening:
            if not self.reply_to:
                raise ValueError(f"room {self.room}: ROOM_FAILED with an opening needs reply_to")
            frames += [b"%d" % self.opening, self.reply_to.encode("ascii")]
        return frames

    @classmethod
    def from_frames(cls, frames: Sequence[object]) -> RoomFailed:
        """Decode frames (3: an old sender's, no opening; 5: with opening and reply_to).

        Raises:
            MalformedMessage: wrong type, frame count, integer, opening or text syntax; an
                oversized reason.
        """
        raw = _frames(frames, cls.KIND, 3, 5)
        name = cls.KIND.decode()
        room, reason = _uint(raw, 1, "room", name), _reason(raw, 2, name)
        if len(raw) == 3:
            return cls(room, reason)
        return cls(room, reason, _opening(raw, 3, name), _text(raw, 4, "reply_to", name))


@dataclass(frozen=True, slots=True)
class RoomFailedAck:
    """The receiver of ``ROOM_FAILED`` for ``opening`` heard it: stop re-sending it."""

    KIND: ClassVar[bytes] = b"ROOM_FAILED_ACK"

    room: int
    opening: int
    endpoint: str
    """The acknowledging peer's control listener (the one the ``ROOM_FAILED`` went to)."""

    def to_frames(self) -> list[bytes]:
        """Encode as multipart frames."""
        return [
            self.KIND,
            b"%d" % self.room,
            b"%d" % self.opening,
            self.endpoint.encode("ascii"),
        ]

    @classmethod
    def from_frames(cls, frames: Sequence[object]) -> RoomFailedAck:
        """Decode frames.

        Raises:
            MalformedMessage: wrong type, frame count, integer, opening or text syntax.
        """
        raw = _frames(frames, cls.KIND, 4)
        name = cls.KIND.decode()
        return cls(
            _uint(raw, 1, "room", name), _opening(raw, 2, name), _text(raw, 3, "endpoint", name)
        )


@dataclass(frozen=True, slots=True)
class RoomFence:
    """Decode failed a room and holds its regions until every writer confirms (decode → prefill).

    A writer that receives it never writes into the room's regions of ``session_id`` again,
    and answers :class:`RoomFenced` at ``reply_to`` once no such write is in flight.
    """

    KIND: ClassVar[bytes] = b"ROOM_FENCE"

    room: int
    session_id: str
    """The decode rank's engine session (the ring the writer must stop writing into)."""
    reply_to: str
    """The decode rank's control listener, where ``ROOM_FENCED`` goes."""
    reason: str

    def to_frames(self) -> list[bytes]:
        """Encode as multipart frames (the reason is cut to ``MAX_REASON_BYTES`` ASCII)."""
        return [
            self.KIND,
            b"%d" % self.room,
            self.session_id.encode("ascii"),
            self.reply_to.encode("ascii"),
            _encode_reason(self.reason),
        ]

    @classmethod
    def from_frames(cls, frames: Sequence[object]) -> RoomFence:
        """Decode frames.

        Raises:
            MalformedMessage: wrong type, frame count, integer or text syntax; an oversized
                reason.
        """
        raw = _frames(frames, cls.KIND, 5)
        name = cls.KIND.decode()
        return cls(
            _uint(raw, 1, "room", name),
            _text(raw, 2, "session_id", name),
            _text(raw, 3, "reply_to", name),
            _reason(raw, 4, name),
        )


@dataclass(frozen=True, slots=True)
class RoomFenced:
    """A writer will not write into a failed room's regions again (prefill → decode)."""

    KIND: ClassVar[bytes] = b"ROOM_FENCED"

    room: int
    session_id: str
    """The decode session the fence was asked for."""
    writer_rank: int
    """The prefill writer's attention-TP rank."""

    def to_frames(self) -> list[bytes]:
        """Encode as multipart frames."""
        return [
            self.KIND,
            b"%d" % self.room,
            self.session_id.encode("ascii"),
            b"%d" % self.writer_rank,
        ]

    @classmethod
    def from_frames(cls, frames: Sequence[object]) -> RoomFenced:
        """Decode frames.

        Raises:
            MalformedMessage: wrong type, frame count, integer or text syntax.
        """
        raw = _frames(frames, cls.KIND, 4)
        name = cls.KIND.decode()
        return cls(
            _uint(raw, 1, "room", name),
            _text(raw, 2, "session_id", name),
            _uint(raw, 3, "writer_rank", name),
        )


@dataclass(frozen=True, slots=True)
class Ping:
    """Are you alive? Answer ``PONG`` at ``reply_to`` (either direction)."""

    KIND: ClassVar[bytes] = b"PING"

    reply_to: str
    """The sender's control listener."""

    def to_frames(self) -> list[bytes]:
        """Encode as multipart frames."""
        return [self.KIND, self.reply_to.encode("ascii")]

    @classmethod
    def from_frames(cls, frames: Sequence[object]) -> Ping:
        """Decode frames.

        Raises:
            MalformedMessage: wrong type, frame count or endpoint syntax.
        """
        raw = _frames(frames, cls.KIND, 2)
        return cls(_text(raw, 1, "reply_to", cls.KIND.decode()))


@dataclass(frozen=True, slots=True)
class Pong:
    """Alive: the answer to ``PING`` (either direction)."""

    KIND: ClassVar[bytes] = b"PONG"

    endpoint: str
    """The answering peer's control listener (the one the ``PING`` was sent to)."""

    def to_frames(self) -> list[bytes]:
        """Encode as multipart frames."""
        return [self.KIND, self.endpoint.encode("ascii")]

    @classmethod
    def from_frames(cls, frames: Sequence[object]) -> Pong:
        """Decode frames.

        Raises:
            MalformedMessage: wrong type, frame count or endpoint syntax.
        """
        raw = _frames(frames, cls.KIND, 2)
        return cls(_text(raw, 1, "endpoint", cls.KIND.decode()))
