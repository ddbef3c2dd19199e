"""Per-request and peer control messages (beside the four staging messages of `wire`).

* ``ROOM_META`` (decode → prefill): decode rank ``decode_rank`` has registered ``room`` for
  ``num_pages`` pages on a grid of ``chunk_pages`` pages; the prefill may start writing.
* ``ROOM_FAILED`` (either direction): the sender gave ``room`` up; the receiver fails it too,
  so one failed request never waits for a timeout on the other side.

Frames are ASCII like the staging messages; decoding raises ``MalformedMessage``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Final

from .wire import MalformedMessage

__all__ = ["RoomFailed", "RoomMeta"]

_UINT: Final = re.compile(rb"[0-9]{1,18}")
MAX_REASON_BYTES: Final = 512


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
        reason = self.reason.encode("ascii", "replace")[:MAX_REASON_BYTES]
        return [self.KIND, b"%d" % self.room, reason]

    @classmethod
    def from_frames(cls, frames: Sequence[object]) -> RoomFailed:
        """Decode frames.

        Raises:
            MalformedMessage: wrong type, frame count, integer syntax or an oversized reason.
        """
        raw = _frames(frames, cls.KIND, 3)
        name = cls.KIND.decode()
        room = _uint(raw, 1, "room", name)
        if len(raw[2]) > MAX_REASON_BYTES:
            raise MalformedMessage("reason too long", 2, "reason", name)
        return cls(room, raw[2].decode("ascii", "replace"))
