"""Typed codecs for the staging control messages (pyzmq multipart frames).

Four messages cross between prefill and decode on ZMQ PUSH → PULL sockets. Each is a frozen
record whose constructor validates every field, so an invalid message can be neither built
locally nor decoded from the wire. The frames are byte-identical to what the reference staging
path (sglang's PD disaggregation) sends: frame 0 is the type name, integers are ASCII decimal,
session ids are ASCII, optional frames come last and only when set. ``CHUNK_READY`` has two
optional frames of ours after the writer rank, its region ``epoch`` and integrity ``tag``
(version 1 of the integrity scheme, see :mod:`~staging_contracts._control.integrity`); the
reference sends neither and ignores them, and a message without them is accepted. One leniency: the
reference's decode sends ``WATERMARK`` with an empty session frame
(``[b"WATERMARK", b"3", b"4096", b""]``), which decodes as "no session", the same as an absent
frame; an empty session is refused in every other message.

``decode_message`` turns received frames into one of the records and raises
``MalformedMessage`` (and nothing else) for any other input, so a bad peer costs a log line
and a counter, never the listener thread.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Final, Self, TypeAlias

__all__ = [
    "ALLOC_OVERSIZED",
    "MAX_MESSAGE_BYTES",
    "MAX_SESSION_BYTES",
    "MESSAGE_TYPES",
    "MAX_TAG_BYTES",
    "NOTIFICATION_SEPARATOR",
    "NO_ANSWER_YET",
    "ChunkReady",
    "MalformedMessage",
    "Message",
    "StagingReq",
    "StagingRsp",
    "WatermarkUpdate",
    "decode_message",
    "decode_notification",
]

ALLOC_OVERSIZED: Final = -2
"""``STAGING_RSP`` offset meaning the chunk can never fit the ring (then ``round = 0``,
``end = -1``): a permanent failure of that room only."""

NO_ANSWER_YET: Final = -1
"""Prefill-local offset meaning "no ``STAGING_RSP`` yet". It never goes on the wire: a
``StagingRsp`` with this offset can be neither built nor decoded."""

MAX_MESSAGE_BYTES: Final = 4096
"""Upper bound on the total size of a message's frames (a valid one is under 450 bytes)."""

MAX_SESSION_BYTES: Final = 256
"""Longest session id, in bytes of printable ASCII."""

NOTIFICATION_SEPARATOR: Final = b"\x00"
"""Separates the fields of a NIXL arrival notification; it cannot occur inside any field."""

_I64_MIN: Final = -(2**63)
_I64_MAX: Final = 2**63 - 1
_INT_RE: Final = re.compile(rb"-?[0-9]{1,20}")
_LONG_INT_RE: Final = re.compile(rb"-?[0-9]{21,}")
_SESSION_STR_RE: Final = re.compile(r"[\x20-\x7e]{1,256}")
_TAG_RE: Final = re.compile(r"(?:[0-9a-f]{16}|-)(?::[0-9a-f]{32})?")
MAX_TAG_BYTES: Final = 49
"""Longest ``CHUNK_READY`` tag: a 16-hex-digit digest, ``:``, a 32-hex-digit MAC."""
_TAG_RULE: Final = (
    "must be a 16-hex-digit digest or '-', then optionally ':' and a 32-hex-digit MAC "
    "(lowercase), not '-' alone"
)
_TEXT_FIELDS: Final = frozenset({"session_id", "tag"})
_SHOW_BYTES: Final = 40
_SESSION_RULE: Final = f"must be 1-{MAX_SESSION_BYTES} characters of printable ASCII"


class MalformedMessage(ValueError):
    """A received message is not one of the four staging messages, exactly as specified.

    The text is built from the fields, e.g.
    ``STAGING_REQ frame 2 ('chunk_idx'): not an ASCII decimal integer: b'+5'``.

    Attributes:
        reason: why the message was rejected (a lowercase fragment).
        frame_index: the offending frame (for a missing frame, the index it should have had),
            or ``None`` when no single frame is at fault.
        field: the name of the field that frame carries (``'type'`` for frame 0), or ``None``.
        message_type: the message type, when frame 0 named a known one.
    """

    reason: str
    frame_index: int | None
    field: str | None
    message_type: str | None

    def __init__(
        self,
        reason: str,
        frame_index: int | None = None,
        field: str | None = None,
        message_type: str | None = None,
    ) -> None:
        super().__init__(reason, frame_index, field, message_type)
        self.reason = reason
        self.frame_index = frame_index
        self.field = field
        self.message_type = message_type

    def __str__(self) -> str:
        prefix = f"{self.message_type} " if self.message_type is not None else ""
        if self.frame_index is None:
            return f"{prefix.rstrip()}: {self.reason}" if prefix else self.reason
        where = f"frame {self.frame_index}"
        if self.field is not None:
            where += f" ({self.field!r})"
        return f"{prefix}{where}: {self.reason}"


class _FieldError(ValueError):
    """A record field holds an invalid value (raised by the constructors)."""

    def __init__(self, record: str, field: str, reason: str) -> None:
        super().__init__(f"invalid {record}: {field!r} {reason}")
        self.field = field
        self.reason = reason


def _check_int(record: str, field: str, value: object, minimum: int) -> None:
    if type(value) is int and minimum <= value <= 9223372036854775807:  # fast path
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise _FieldError(record, field, f"must be an int, got {type(value).__name__}")
    if value < _I64_MIN or value > _I64_MAX:
        raise _FieldError(record, field, f"must fit a signed 64-bit integer, got {value}")
    if value < minimum:
        raise _FieldError(record, field, f"must be >= {minimum}, got {value}")


def _check_optional_rank(record: str, field: str, value: object) -> None:
    if value is not None:
        _check_int(record, field, value, 0)


def _check_session(record: str, field: str, value: object) -> None:
    if type(value) is not str:
        raise _FieldError(record, field, f"must be a str, got {type(value).__name__}")
    if _SESSION_STR_RE.fullmatch(value) is None:
        raise _FieldError(record, field, f"{_SESSION_RULE}, got {_show(value)}")


def _check_optional_tag(record: str, field: str, value: object) -> None:
    if value is None:
        return
    if type(value) is not str:
        raise _FieldError(record, field, f"must be a str, got {type(value).__name__}")
    if value == "-" or _TAG_RE.fullmatch(value) is None:
        raise _FieldError(record, field, f"{_TAG_RULE}, got {_show(value)}")


def _show(value: bytes | str) -> str:
    """Render a value for an error message, cut to a readable length."""
    if len(value) > _SHOW_BYTES:
        return f"{value[:_SHOW_BYTES]!r}... ({len(value)} long)"
    return repr(value)


class _Record:
    """What the four message records share: the type name and decoding by class."""

    __slots__ = ()

    WIRE_TYPE: ClassVar[bytes]
    """Frame 0 of this message."""

    @classmethod
    def from_frames(cls, frames: Sequence[object]) -> Self:
        """Decode frames that must hold this message type.

        Args:
            frames: the received frames (see ``decode_message``).

        Returns:
            The decoded message.

        Raises:
            MalformedMessage: the frames are not a valid message of this type.
        """
        message = decode_message(frames)
        if not isinstance(message, cls):
            raise MalformedMessage(
                f"expected {cls.WIRE_TYPE.decode()}, got {message.WIRE_TYPE.decode()}", 0, "type"
            )
        return message


@dataclass(frozen=True, slots=True)
class StagingReq(_Record):
    """Ask the decode rank for a staging region for one chunk (prefill → decode).

    **Side:** sent by prefill right after the batch is formed (prefetch), received by decode's
    listener thread. Frames: ``STAGING_REQ``, room, chunk_idx, num_pages, session_id and, when
    set, the requester's ``pp_rank``.

    Raises:
        ValueError: a field is out of range or of the wrong type (the message names it).
    """

    WIRE_TYPE: ClassVar[bytes] = b"STAGING_REQ"

    room: int
    """The request's bootstrap room, ``>= 0``."""
    chunk_idx: int
    """Index of the chunk within the request, ``>= 0``."""
    num_pages: int
    """Pages in the chunk, ``>= 1``."""
    session_id: str
    """The decode session (Mooncake session id, NIXL agent name): 1-256 printable ASCII."""
    pp_rank: int | None = None
    """The requester's pipeline-parallel rank (``>= 0``), or ``None`` to answer every rank."""

    def __post_init__(self) -> None:
        _check_int("StagingReq", "room", self.room, 0)
        _check_int("StagingReq", "chunk_idx", self.chunk_idx, 0)
        _check_int("StagingReq", "num_pages", self.num_pages, 1)
        _check_session("StagingReq", "session_id", self.session_id)
        _check_optional_rank("StagingReq", "pp_rank", self.pp_rank)

    def to_frames(self) -> list[bytes]:
        """Encode as multipart frames.

        Returns:
            A new list of frames, owned by the caller, ready for ``send_multipart``.
        """
        frames = [
            b"STAGING_REQ",
            b"%d" % self.room,
            b"%d" % self.chunk_idx,
            b"%d" % self.num_pages,
            self.session_id.encode("ascii"),
        ]
        if self.pp_rank is not None:
            frames.append(b"%d" % self.pp_rank)
        return frames


@dataclass(frozen=True, slots=True)
class StagingRsp(_Record):
    """Tell a prefill rank where its chunk goes in the decode ring (decode → prefill).

    **Side:** sent by decode's listener thread to every prefill rank of the room, received by
    prefill's bootstrap thread. Frames: ``STAGING_RSP``, room, chunk_idx, offset, round, end,
    session_id. Either ``offset >= 0`` and ``end > offset``, or exactly
    ``offset = ALLOC_OVERSIZED, round = 0, end = -1`` (see ``oversized``).
    ``NO_ANSWER_YET`` (-1) is prefill-local and rejected here.

    Raises:
        ValueError: a field is out of range or of the wrong type (the message names it).
    """

    WIRE_TYPE: ClassVar[bytes] = b"STAGING_RSP"

    room: int
    """The request's bootstrap room, ``>= 0``."""
    chunk_idx: int
    """Index of the chunk within the request, ``>= 0``."""
    offset: int
    """Byte offset of the region in the ring, or ``ALLOC_OVERSIZED``."""
    round: int
    """The ring round the region belongs to, ``>= 0`` (``0`` when oversized)."""
    end: int
    """One past the region's last byte, ``> offset`` (``-1`` when oversized)."""
    session_id: str
    """The decode session the request named, echoed back: 1-256 printable ASCII."""

    def __post_init__(self) -> None:
        _check_int("StagingRsp", "room", self.room, 0)
        _check_int("StagingRsp", "chunk_idx", self.chunk_idx, 0)
        _check_int("StagingRsp", "offset", self.offset, _I64_MIN)
        _check_int("StagingRsp", "round", self.round, 0)
        _check_int("StagingRsp", "end", self.end, _I64_MIN)
        _check_session("StagingRsp", "session_id", self.session_id)
        offset, end = self.offset, self.end
        if offset >= 0:
            if end <= offset:
                raise _FieldError("StagingRsp", "end", f"must be > offset ({offset}), got {end}")
        elif offset == ALLOC_OVERSIZED:
            if self.round != 0:
                raise _FieldError(
                    "StagingRsp", "round", f"must be 0 with offset -2, got {self.round}"
                )
            if end != -1:
                raise _FieldError("StagingRsp", "end", f"must be -1 with offset -2, got {end}")
        elif offset == NO_ANSWER_YET:
            raise _FieldError(
                "StagingRsp", "offset", "must not be -1 (prefill-local 'no answer yet')"
            )
        else:
            raise _FieldError("StagingRsp", "offset", f"must be >= 0 or -2, got {offset}")

    @classmethod
    def oversized(cls, room: int, chunk_idx: int, session_id: str) -> Self:
        """Build the answer for a chunk that can never fit the ring.

        Args:
            room: the request's bootstrap room.
            chunk_idx: the chunk that does not fit.
            session_id: the decode session the request named.

        Returns:
            ``StagingRsp(room, chunk_idx, ALLOC_OVERSIZED, 0, -1, session_id)``.
        """
        return cls(room, chunk_idx, ALLOC_OVERSIZED, 0, -1, session_id)

    @property
    def is_oversized(self) -> bool:
        """Whether this answer is the permanent ``ALLOC_OVERSIZED`` failure."""
        return self.offset == ALLOC_OVERSIZED

    def to_frames(self) -> list[bytes]:
        """Encode as multipart frames.

        Returns:
            A new list of frames, owned by the caller, ready for ``send_multipart``.
        """
        return [
            b"STAGING_RSP",
            b"%d" % self.room,
            b"%d" % self.chunk_idx,
            b"%d" % self.offset,
            b"%d" % self.round,
            b"%d" % self.end,
            self.session_id.encode("ascii"),
        ]


@dataclass(frozen=True, slots=True)
class WatermarkUpdate(_Record):
    """Report how far the decode ring has been consumed (decode → prefill).

    **Side:** broadcast by decode after a region is freed (and sent at once to a new
    subscriber), received by prefill's bootstrap thread. Frames: ``WATERMARK``, round, tail
    and, when ``session_id`` is not empty, session_id. Decoding also accepts an empty session
    frame (the reference's decode sends one) as "no session": ``session_id == ""``.

    Raises:
        ValueError: a field is out of range or of the wrong type (the message names it).
    """

    WIRE_TYPE: ClassVar[bytes] = b"WATERMARK"

    round: int
    """Round of the oldest live region (or the fresh round), ``>= 0``."""
    tail: int
    """Offset of the oldest live region in that round, ``>= 0``."""
    session_id: str = ""
    """The decode session it describes; ``""`` means absent (no frame is sent)."""

    def __post_init__(self) -> None:
        _check_int("WatermarkUpdate", "round", self.round, 0)
        _check_int("WatermarkUpdate", "tail", self.tail, 0)
        if self.session_id != "":
            _check_session("WatermarkUpdate", "session_id", self.session_id)

    def to_frames(self) -> list[bytes]:
        """Encode as multipart frames.

        Returns:
            A new list of frames, owned by the caller, ready for ``send_multipart``.
        """
        frames = [b"WATERMARK", b"%d" % self.round, b"%d" % self.tail]
        if self.session_id:
            frames.append(self.session_id.encode("ascii"))
        return frames


@dataclass(frozen=True, slots=True)
class ChunkReady(_Record):
    """Signal that a writer's bulk write of a chunk has landed (prefill → decode).

    **Side:** sent by a prefill transfer worker after its write completes, received by
    decode's listener thread. On Mooncake it travels as frames (``CHUNK_READY``, room,
    chunk_idx, page_start, num_pages, session_id and, when set, writer_rank, epoch and tag,
    each optional one only after the one before it); on NIXL as the bulk write's notification
    payload (``to_notification``). The reference sends at most the writer rank.

    Raises:
        ValueError: a field is out of range or of the wrong type (the message names it), or
            an optional field is set without the one before it.
    """

    WIRE_TYPE: ClassVar[bytes] = b"CHUNK_READY"

    room: int
    """The request's bootstrap room, ``>= 0``."""
    chunk_idx: int
    """Index of the chunk within the request, ``>= 0``."""
    page_start: int
    """Index of the chunk's first page in the request, ``>= 0``."""
    num_pages: int
    """Pages in the chunk, ``>= 1``."""
    session_id: str
    """The decode session written to: 1-256 printable ASCII."""
    writer_rank: int | None = None
    """The writer's unique prefill rank (``>= 0``), or ``None``."""
    epoch: int | None = None
    """The region's epoch as the writer was answered: its ring round (``>= 0``; every later
    region that covers any of its bytes has a higher round), or ``None`` (the reference)."""
    tag: str | None = None
    """The integrity tag of the staged bytes (see
    :mod:`~staging_contracts._control.integrity`): a 16-hex-digit digest (``-`` when the
    writer computed none), then ``:`` and a 32-hex-digit MAC when a cluster secret is set;
    ``None`` (the reference)."""

    def __post_init__(self) -> None:
        _check_int("ChunkReady", "room", self.room, 0)
        _check_int("ChunkReady", "chunk_idx", self.chunk_idx, 0)
        _check_int("ChunkReady", "page_start", self.page_start, 0)
        _check_int("ChunkReady", "num_pages", self.num_pages, 1)
        _check_session("ChunkReady", "session_id", self.session_id)
        _check_optional_rank("ChunkReady", "writer_rank", self.writer_rank)
        _check_optional_rank("ChunkReady", "epoch", self.epoch)
        _check_optional_tag("ChunkReady", "tag", self.tag)
        if self.epoch is not None and self.writer_rank is None:
            raise _FieldError("ChunkReady", "epoch", "needs a writer_rank (frames are ordered)")
        if self.tag is not None and self.epoch is None:
            raise _FieldError("ChunkReady", "tag", "needs an epoch (frames are ordered)")

    def to_frames(self) -> list[bytes]:
        """Encode as multipart frames (Mooncake).

        Returns:
            A new list of frames, owned by the caller, ready for ``send_multipart``.
        """
        frames = [
            b"CHUNK_READY",
            b"%d" % self.room,
            b"%d" % self.chunk_idx,
            b"%d" % self.page_start,
            b"%d" % self.num_pages,
            self.session_id.encode("ascii"),
        ]
        if self.writer_rank is not None:
            frames.append(b"%d" % self.writer_rank)
            if self.epoch is not None:
                frames.append(b"%d" % self.epoch)
                if self.tag is not None:
                    frames.append(self.tag.encode("ascii"))
        return frames

    def to_notification(self) -> bytes:
        """Encode as one NIXL notification payload: the frames joined by ``b"\\x00"``.

        Returns:
            The payload, starting with ``b"CHUNK_READY"``.
        """
        return NOTIFICATION_SEPARATOR.join(self.to_frames())


Message: TypeAlias = StagingReq | StagingRsp | WatermarkUpdate | ChunkReady
"""Any of the four staging messages."""


MESSAGE_TYPES: Final = frozenset(
    {StagingReq.WIRE_TYPE, StagingRsp.WIRE_TYPE, WatermarkUpdate.WIRE_TYPE, ChunkReady.WIRE_TYPE}
)
"""The four frame-0 type names, for listeners that share a socket with other traffic."""


class _Codec:
    """How one message type lays out its frames, derived from its record's fields."""

    __slots__ = (
        "build",
        "counts",
        "empty_session",
        "fields",
        "index",
        "is_int",
        "max_frames",
        "min_frames",
        "name",
    )

    def __init__(self, cls: type[Message]) -> None:
        fields = dataclasses.fields(cls)
        optional = sum(field.default is not dataclasses.MISSING for field in fields)
        self.build: Callable[..., Message] = cls
        self.name = cls.WIRE_TYPE.decode("ascii")
        self.fields = tuple(field.name for field in fields)
        self.is_int = tuple(name not in _TEXT_FIELDS for name in self.fields)
        self.index = {name: i + 1 for i, name in enumerate(self.fields)}
        self.max_frames = len(fields) + 1
        self.min_frames = self.max_frames - optional
        joiner = " to " if optional > 1 else " or "
        alternative = f"{self.min_frames}{joiner}" if optional else ""
        self.counts = f"{self.name} takes {alternative}{self.max_frames} frames"
        # Only an optional session may be empty on the wire (WATERMARK): "" is its "absent".
        self.empty_session = any(
            field.name == "session_id" and field.default == "" for field in fields
        )


_CODECS: Final = {
    cls.WIRE_TYPE: _Codec(cls) for cls in (StagingReq, StagingRsp, WatermarkUpdate, ChunkReady)
}


def _frame_bytes(
    frame: object, index: int | None, field: str | None, message_type: str | None
) -> bytes:
    """The bytes of one frame: ``bytes``, ``bytearray``, ``memoryview`` or a pyzmq ``Frame``."""
    if type(frame) is bytes:
        return frame
    data: object
    try:
        if isinstance(frame, bytes | bytearray | memoryview):
            view = memoryview(frame)
            size = view.nbytes
            data = view.tobytes() if size <= MAX_MESSAGE_BYTES else None
        else:
            data = getattr(frame, "bytes", None)
            size = len(data) if type(data) is bytes else 0
    except Exception as exc:  # a released buffer, a broken `.bytes` property: reported
        raise MalformedMessage(
            f"unreadable {type(frame).__name__} frame: {exc}", index, field, message_type
        ) from exc
    if size > MAX_MESSAGE_BYTES:
        raise MalformedMessage(
            f"message too large: {size} bytes (at most {MAX_MESSAGE_BYTES})",
            index,
            field,
            message_type,
        )
    if type(data) is not bytes:
        raise MalformedMessage(
            f"not a bytes-like frame: {type(frame).__name__}", index, field, message_type
        )
    return data


def _bad_int(raw: bytes) -> str:
    if _LONG_INT_RE.fullmatch(raw) is not None:
        return f"integer of more than 20 digits: {_show(raw)}"
    return f"not an ASCII decimal integer: {_show(raw)}"


def _decode_body(codec: _Codec, frames: Sequence[object], count: int, size: int) -> Message:
    """Decode the frames after the type; ``size`` is what frame 0 already used."""
    name = codec.name
    if count < codec.min_frames:
        raise MalformedMessage(
            f"missing ({codec.counts}, got {count})", count, codec.fields[count - 1], name
        )
    if count > codec.max_frames:
        raise MalformedMessage(
            f"unexpected extra frame ({codec.counts}, got {count})", codec.max_frames, None, name
        )
    fields = codec.fields
    is_int = codec.is_int
    values: list[int | str] = []
    for index in range(1, count):
        field = fields[index - 1]
        raw = frames[index]
        if type(raw) is not bytes:
            raw = _frame_bytes(raw, index, field, name)
        size += len(raw)
        if size > MAX_MESSAGE_BYTES:
            raise MalformedMessage(
                f"message too large: more than {MAX_MESSAGE_BYTES} bytes", None, None, name
            )
        if is_int[index - 1]:
            # bytes.isdigit() is ASCII-only; the regex also admits the minus sign
            if not (raw.isdigit() and len(raw) <= 20) and _INT_RE.fullmatch(raw) is None:
                raise MalformedMessage(_bad_int(raw), index, field, name)
            values.append(int(raw))
        else:  # the record checks length and printability of a non-empty session
            if not raw and not codec.empty_session:
                rule = _TAG_RULE if field == "tag" else _SESSION_RULE
                raise MalformedMessage(f"{rule}, got ''", index, field, name)
            try:
                values.append(raw.decode("ascii"))
            except UnicodeDecodeError:
                raise MalformedMessage(f"not ASCII: {_show(raw)}", index, field, name) from None
    try:
        return codec.build(*values)
    except _FieldError as exc:
        raise MalformedMessage(exc.reason, codec.index[exc.field], exc.field, name) from None


def decode_message(frames: Sequence[object]) -> Message:
    """Decode one received multipart message.

    **Called by:** a listener thread, once per received message (hot path). **Blocking:** no.
    **Thread-safety:** pure function. Integers may carry leading zeros (``b"007"`` is 7, as
    the reference's ``int()`` reads it), and a ``WATERMARK`` whose session frame is empty is
    one without a session (the reference's decode sends it so); everything else follows
    SPEC §1 byte for byte. Each frame's syntax is checked in order, then the values, so a
    message with several faults reports the first syntax fault, else the first value fault.

    Args:
        frames: the frames, each ``bytes``, ``bytearray``, ``memoryview`` or an object with a
            ``.bytes`` attribute holding ``bytes`` (pyzmq ``Frame``). Anything else is rejected.

    Returns:
        The decoded message, a new immutable record.

    Raises:
        MalformedMessage: for any input that is not exactly one of the four messages (and
            nothing else, whatever the input).
    """
    if (type(frames) is not list and type(frames) is not tuple) and (
        not isinstance(frames, Sequence) or isinstance(frames, str | bytes | bytearray | memoryview)
    ):
        raise MalformedMessage(f"expected a sequence of frames, got {type(frames).__name__}")
    count = len(frames)
    if count == 0:
        raise MalformedMessage("missing (the message has no frames)", 0, "type")
    head = _frame_bytes(frames[0], 0, "type", None)
    codec = _CODECS.get(head)
    if codec is None:
        raise MalformedMessage(f"unknown message type {_show(head)}", 0, "type")
    return _decode_body(codec, frames, count, len(head))


def decode_notification(payload: bytes | bytearray | memoryview) -> ChunkReady:
    """Decode a NIXL arrival notification payload (``ChunkReady.to_notification``).

    **Called by:** decode's notification poller, once per notification. **Blocking:** no.
    Validation is that of ``decode_message``; a "frame" in an error is a ``b"\\x00"``-separated
    field of the payload.

    Args:
        payload: the notification's bytes.

    Returns:
        The decoded arrival.

    Raises:
        MalformedMessage: the payload is not a valid ``CHUNK_READY`` notification.
    """
    data = _frame_bytes(payload, None, None, None)
    if len(data) > MAX_MESSAGE_BYTES:
        raise MalformedMessage(
            f"message too large: {len(data)} bytes (at most {MAX_MESSAGE_BYTES})"
        )
    parts = data.split(NOTIFICATION_SEPARATOR)
    head = parts[0]
    if head != ChunkReady.WIRE_TYPE:
        raise MalformedMessage(f"not a CHUNK_READY notification: {_show(head)}", 0, "type")
    message = _decode_body(_CODECS[head], parts, len(parts), len(head))
    if not isinstance(message, ChunkReady):  # pragma: no cover - the codec builds ChunkReady
        raise MalformedMessage("not a CHUNK_READY notification", 0, "type")
    return message
