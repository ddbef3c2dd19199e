"""Per-request and peer control messages (beside the four staging messages of `wire`).

* ``ROOM_META`` (decode → prefill): decode rank ``decode_rank`` has registered ``room`` for
  ``num_pages`` pages on a grid of ``chunk_pages`` pages; the prefill may start writing.
* ``ROOM_FAILED`` (either direction): the sender gave ``room`` up; the receiver fails it too,
  so one failed request never waits for a timeout on the other side. Sent once, never
  re-sent: it names only the room id and nothing answers it, so a copy that arrives after
  the receiver ended the room and registered the id again would fail that new opening, and
  no ordering rules this out (the new registration travels the other way, on the other
  side's socket). A lost one is recovered otherwise: decode fails the room at its own bound
  (``room_timeout_s`` / ``stall_timeout_s``); prefill through decode's ``ROOM_FENCE``
  (re-sent until ``ROOM_FENCED``) when decode held regions of it, else the refusal of its
  next ``STAGING_REQ`` or its deadline.
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

__all__ = ["Ping", "Pong", "RoomFailed", "RoomFence", "RoomFenced", "RoomMeta"]

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


def _frames(frames: Sequence[object], kind: bytes, count: int) -> list[bytes]:
    raw = [bytes(f) if isinstance(f, bytes | bytearray | memoryview) else None for f in frames]
    name = kind.decode()
    if not raw or raw[0] != kind:
        raise MalformedMessage(f"expected {name}", 0, "type")
    if len(raw) != count:
        raise MalformedMessage(f"{name} takes {count} frames, got {len(raw)}", None, None, name)
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

    def to_frames(self) -> list[bytes]:
        """Encode as multipart frames."""
        return [
            self.KIND,
            b"%d" % self.room,
            b"%d" % self.decode_rank,
            b"%d" % self.num_pages,
            b"%d" % self.chunk_pages,
        ]

    @classmethod
    def from_frames(cls, frames: Sequence[object]) -> RoomMeta:
        """Decode frames.

        Raises:
            MalformedMessage: wrong type, frame count or integer syntax; zero page counts.
        """
        raw = _frames(frames, cls.KIND, 5)
        name = cls.KIND.decode()
        room = _uint(raw, 1, "room", name)
        rank = _uint(raw, 2, "decode_rank", name)
        pages = _uint(raw, 3, "num_pages", name)
        grid = _uint(raw, 4, "chunk_pages", name)
        if pages < 1 or grid < 1:
            raise MalformedMessage("page counts must be >= 1", None, None, name)
        return cls(room, rank, pages, grid)


@dataclass(frozen=True, slots=True)
class RoomFailed:
    """The sender gave a room up (either direction)."""

    KIND: ClassVar[bytes] = b"ROOM_FAILED"

    room: int
    reason: str

    def to_frames(self) -> list[bytes]:
        """Encode as multipart frames (the reason is cut to ``MAX_REASON_BYTES`` ASCII)."""
        return [self.KIND, b"%d" % self.room, _encode_reason(self.reason)]

    @classmethod
    def from_frames(cls, frames: Sequence[object]) -> RoomFailed:
        """Decode frames.

        Raises:
            MalformedMessage: wrong type, frame count, integer syntax or an oversized reason.
        """
        raw = _frames(frames, cls.KIND, 3)
        name = cls.KIND.decode()
        return cls(_uint(raw, 1, "room", name), _reason(raw, 2, name))


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
