"""The wire codecs: byte-exact frames, round trips, and strict rejection of everything else."""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import re
from collections import UserList
from collections.abc import Callable, Iterator

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from staging_contracts._control import wire
from staging_contracts._control.wire import (
    ALLOC_OVERSIZED,
    MAX_MESSAGE_BYTES,
    MESSAGE_TYPES,
    NO_ANSWER_YET,
    ChunkReady,
    MalformedMessage,
    Message,
    StagingReq,
    StagingRsp,
    WatermarkUpdate,
    decode_message,
    decode_notification,
)

I64_MAX = 2**63 - 1
FUZZ = settings(max_examples=300, deadline=None)

# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------

nonneg = st.integers(0, I64_MAX)
positive = st.integers(1, I64_MAX)
ranks = st.none() | nonneg
sessions = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=256
)


@st.composite
def staging_rsps(draw: st.DrawFn) -> StagingRsp:
    """A valid response: a region (offset >= 0, end > offset) or the oversized answer."""
    room, chunk_idx, session = draw(nonneg), draw(nonneg), draw(sessions)
    if draw(st.booleans()):
        return StagingRsp.oversized(room, chunk_idx, session)
    offset = draw(st.integers(0, I64_MAX - 1))
    end = draw(st.integers(offset + 1, I64_MAX))
    return StagingRsp(room, chunk_idx, offset, draw(nonneg), end, session)


staging_reqs = st.builds(StagingReq, nonneg, nonneg, positive, sessions, ranks)
watermarks = st.builds(WatermarkUpdate, nonneg, nonneg, st.just("") | sessions)
TAG = "0123456789abcdef:" + "0123456789abcdef" * 2
"""A tag with a digest and a MAC (the longest form)."""
tags = st.from_regex(r"\A(?:[0-9a-f]{16}|-:[0-9a-f]{32}|[0-9a-f]{16}:[0-9a-f]{32})\Z")


@st.composite
def chunk_readies(draw: st.DrawFn) -> ChunkReady:
    """A valid arrival: the optional writer rank, epoch and tag each only after the one
    before."""
    head = (draw(nonneg), draw(nonneg), draw(nonneg), draw(positive), draw(sessions))
    optional = draw(st.integers(0, 3))
    writer = draw(st.integers(0, I64_MAX)) if optional >= 1 else None
    epoch = draw(st.integers(0, I64_MAX)) if optional >= 2 else None
    tag = draw(tags) if optional >= 3 else None
    return ChunkReady(*head, writer, epoch, tag)


messages: st.SearchStrategy[Message] = st.one_of(
    staging_reqs, staging_rsps(), watermarks, chunk_readies()
)

# Frames that look plausible often enough to get past frame 0 and the frame count.
plausible_frames = st.one_of(
    st.binary(max_size=40),
    st.sampled_from(sorted(MESSAGE_TYPES)),
    st.integers(-(2**70), 2**70).map(lambda n: str(n).encode()),
    st.text(max_size=8).map(lambda s: s.encode()),
)


def as_view(raw: bytes) -> memoryview:
    """A memoryview over raw (a frame as a zero-copy receiver might hand it over)."""
    return memoryview(raw)


def assert_malformed_only(frames: list[object]) -> None:
    """Decodes frames; a success must be a valid message that round-trips."""
    message: Message | None = None
    with contextlib.suppress(MalformedMessage):
        message = decode_message(frames)
    if message is not None:
        assert decode_message(message.to_frames()) == message


def slug(pattern: object) -> str:
    """A test id from a message pattern: no spaces or backslashes, so a node id is one word."""
    return re.sub(r"[^A-Za-z0-9_]+", "-", str(pattern)).strip("-")[:72] or "empty"


# ---------------------------------------------------------------------------------------------
# Frame layout (first in the file: mutmut credits code run at import to the first test, so this
# one is what re-checks the codec tables built at import in a fresh process)
# ---------------------------------------------------------------------------------------------

LAYOUTS: list[tuple[list[bytes], Message, int, tuple[str, ...], str]] = [
    (
        [b"STAGING_REQ", b"7", b"1", b"4", b"sess", b"2"],
        StagingReq(7, 1, 4, "sess", pp_rank=2),
        5,
        ("room", "chunk_idx", "num_pages", "session_id", "pp_rank"),
        "STAGING_REQ takes 5 or 6 frames",
    ),
    (
        [b"STAGING_RSP", b"7", b"1", b"128", b"3", b"640", b"sess"],
        StagingRsp(7, 1, 128, 3, 640, "sess"),
        7,
        ("room", "chunk_idx", "offset", "round", "end", "session_id"),
        "STAGING_RSP takes 7 frames",
    ),
    (
        [b"WATERMARK", b"3", b"64", b"sess"],
        WatermarkUpdate(3, 64, "sess"),
        3,
        ("round", "tail", "session_id"),
        "WATERMARK takes 3 or 4 frames",
    ),
    (
        [b"CHUNK_READY", b"7", b"1", b"8", b"4", b"sess", b"3", b"5", TAG.encode()],
        ChunkReady(7, 1, 8, 4, "sess", 3, 5, TAG),
        6,
        (
            "room",
            "chunk_idx",
            "page_start",
            "num_pages",
            "session_id",
            "writer_rank",
            "epoch",
            "tag",
        ),
        "CHUNK_READY takes 6 to 9 frames",
    ),
]
"""Per message: all its frames, the record, the fewest frames, the field of each frame from 1
on, and how the errors state the frame count."""


WITHOUT_OPTIONAL: dict[str, Message] = {
    "STAGING_REQ": StagingReq(7, 1, 4, "sess"),
    "WATERMARK": WatermarkUpdate(3, 64),
    "CHUNK_READY": ChunkReady(7, 1, 8, 4, "sess"),
}
"""The records of LAYOUTS' frames with the optional last frame left out."""


def test_every_message_type_has_its_frame_layout() -> None:
    """Decodes each type's frames in field order, counts them, and names each frame's field."""
    for frames, record, fewest, fields, counts in LAYOUTS:
        name = frames[0].decode()
        assert decode_message(frames) == record
        assert len(frames) == len(fields) + 1
        if fewest < len(frames):
            assert decode_message(frames[:fewest]) == WITHOUT_OPTIONAL[name]
        with pytest.raises(MalformedMessage) as info:
            decode_message(frames[: fewest - 1])
        assert str(info.value) == (
            f"{name} frame {fewest - 1} ({fields[fewest - 2]!r}): missing "
            f"({counts}, got {fewest - 1})"
        )
        with pytest.raises(MalformedMessage) as info:
            decode_message([*frames, b"1"])
        assert str(info.value) == (
            f"{name} frame {len(frames)}: unexpected extra frame ({counts}, got {len(frames) + 1})"
        )
        assert (info.value.frame_index, info.value.field) == (len(frames), None)
        at = fields.index("session_id") + 1
        empty_session = [*frames[:at], b"", *frames[at + 1 :]]
        if name == "WATERMARK":  # its session is optional: an empty frame is "no session"
            assert decode_message(empty_session) == WatermarkUpdate(3, 64)
        else:  # a syntax fault: reported before the value fault of an earlier frame
            with pytest.raises(MalformedMessage) as info:
                decode_message(empty_session)
            assert (info.value.frame_index, info.value.field) == (at, "session_id")
            with pytest.raises(MalformedMessage) as info:
                decode_message([frames[0], b"-1", *empty_session[2:]])
            assert (info.value.frame_index, info.value.field) == (at, "session_id")
        for index, field in enumerate(fields, start=1):
            bad = b"\x7f" if field == "session_id" else b"-5"
            with pytest.raises(MalformedMessage) as info:
                decode_message([*frames[:index], bad, *frames[index + 1 :]])
            assert (info.value.message_type, info.value.frame_index, info.value.field) == (
                name,
                index,
                field,
            )


# ---------------------------------------------------------------------------------------------
# Byte-exact frames
# ---------------------------------------------------------------------------------------------


def test_staging_req_frames_are_byte_exact() -> None:
    """A STAGING_REQ encodes as the reference's frames, pp_rank only when set."""
    assert StagingReq(7, 0, 4, "127.0.0.1:1234").to_frames() == [
        b"STAGING_REQ",
        b"7",
        b"0",
        b"4",
        b"127.0.0.1:1234",
    ]
    assert StagingReq(7, 3, 16, "sess-a", pp_rank=1).to_frames() == [
        b"STAGING_REQ",
        b"7",
        b"3",
        b"16",
        b"sess-a",
        b"1",
    ]


def test_staging_rsp_frames_are_byte_exact() -> None:
    """A STAGING_RSP encodes as the reference's frames, the oversized answer included."""
    assert StagingRsp(11, 0, 128, 2, 640, "sess-a").to_frames() == [
        b"STAGING_RSP",
        b"11",
        b"0",
        b"128",
        b"2",
        b"640",
        b"sess-a",
    ]
    assert StagingRsp.oversized(11, 3, "sess-a").to_frames() == [
        b"STAGING_RSP",
        b"11",
        b"3",
        b"-2",
        b"0",
        b"-1",
        b"sess-a",
    ]


def test_watermark_frames_are_byte_exact() -> None:
    """A WATERMARK carries the session frame only when the session is not empty."""
    assert WatermarkUpdate(3, 4096, "sess-a").to_frames() == [
        b"WATERMARK",
        b"3",
        b"4096",
        b"sess-a",
    ]
    assert WatermarkUpdate(0, 0).to_frames() == [b"WATERMARK", b"0", b"0"]


def test_chunk_ready_frames_are_byte_exact() -> None:
    """A CHUNK_READY encodes as the reference's frames, the writer rank only when set."""
    assert ChunkReady(17, 2, 8, 4, "peer_name_with_underscores", 3).to_frames() == [
        b"CHUNK_READY",
        b"17",
        b"2",
        b"8",
        b"4",
        b"peer_name_with_underscores",
        b"3",
    ]
    assert ChunkReady(17, 2, 8, 4, "sess").to_frames() == [
        b"CHUNK_READY",
        b"17",
        b"2",
        b"8",
        b"4",
        b"sess",
    ]


def test_notification_payload_is_byte_exact() -> None:
    """The NIXL payload is the CHUNK_READY frames joined by NUL bytes."""
    assert ChunkReady(17, 2, 8, 4, "agent-1", 3).to_notification() == (
        b"CHUNK_READY\x0017\x002\x008\x004\x00agent-1\x003"
    )
    assert ChunkReady(1, 0, 0, 1, "a").to_notification() == b"CHUNK_READY\x001\x000\x000\x001\x00a"


def test_reference_frames_decode() -> None:
    """Frames the reference sends decode to the expected records."""
    assert decode_message([b"STAGING_REQ", b"11", b"0", b"4", b"sess-a"]) == StagingReq(
        11, 0, 4, "sess-a"
    )
    assert decode_message(
        [b"STAGING_RSP", b"11", b"0", b"128", b"2", b"640", b"sess-a"]
    ) == StagingRsp(11, 0, 128, 2, 640, "sess-a")
    assert decode_message([b"WATERMARK", b"3", b"4096", b"sess-a"]) == WatermarkUpdate(
        3, 4096, "sess-a"
    )
    assert decode_message([b"WATERMARK", b"3", b"4096"]) == WatermarkUpdate(3, 4096)
    assert decode_message(
        [b"CHUNK_READY", b"7", b"0", b"0", b"1", b"session", b"17"]
    ) == ChunkReady(7, 0, 0, 1, "session", 17)


def test_leading_zeros_are_accepted_and_reencoded_canonically() -> None:
    """Leading zeros and '-0' read as the reference's int() reads them; encoding is canonical."""
    message = decode_message([b"STAGING_REQ", b"007", b"-0", b"0004", b"s", b"00"])
    assert message == StagingReq(7, 0, 4, "s", pp_rank=0)
    assert message.to_frames() == [b"STAGING_REQ", b"7", b"0", b"4", b"s", b"0"]
    assert decode_message([b"WATERMARK", b"00000000000000000001", b"0"]) == WatermarkUpdate(1, 0)


def test_extreme_valid_values_round_trip() -> None:
    """The largest signed 64-bit values and a 256-byte session are accepted."""
    top = str(I64_MAX).encode()
    frames: list[object] = [b"STAGING_RSP", top, top, b"0", top, top, b"~" * 256]
    assert decode_message(frames) == StagingRsp(I64_MAX, I64_MAX, 0, I64_MAX, I64_MAX, "~" * 256)


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------


@FUZZ
@given(messages)
def test_every_message_round_trips_through_frames(message: Message) -> None:
    """Every valid message survives to_frames then decode_message and from_frames."""
    frames = message.to_frames()
    assert all(type(frame) is bytes for frame in frames)
    assert decode_message(frames) == message
    assert type(message).from_frames(frames) == message
    assert frames[0] == type(message).WIRE_TYPE


@FUZZ
@given(chunk_readies())
def test_every_chunk_ready_round_trips_through_a_notification(message: ChunkReady) -> None:
    """Every valid CHUNK_READY survives to_notification then decode_notification."""
    payload = message.to_notification()
    assert payload.startswith(b"CHUNK_READY\x00")
    assert decode_notification(payload) == message
    assert decode_notification(bytearray(payload)) == message
    assert decode_notification(memoryview(payload)) == message


@settings(max_examples=50, deadline=None)
@given(messages)
def test_bytes_like_frames_decode(message: Message) -> None:
    """Frames given as bytearray, memoryview or pyzmq Frame decode like bytes."""
    frames = message.to_frames()
    assert decode_message([bytearray(frame) for frame in frames]) == message
    assert decode_message(tuple(memoryview(frame) for frame in frames)) == message
    assert decode_message([zmq.Frame(frame) for frame in frames]) == message


def test_messages_cross_a_real_zmq_socket() -> None:
    """Encoded messages sent over an inproc PUSH/PULL pair decode from zero-copy frames."""
    sent: list[Message] = [
        StagingReq(7, 0, 4, "sess", pp_rank=2),
        StagingRsp(7, 0, 128, 1, 640, "sess"),
        StagingRsp.oversized(7, 1, "sess"),
        WatermarkUpdate(1, 640, "sess"),
        ChunkReady(7, 0, 0, 4, "sess", 3),
    ]
    with zmq.Context() as ctx, ctx.socket(zmq.PULL) as pull, ctx.socket(zmq.PUSH) as push:
        pull.bind("inproc://wire-test")
        push.connect("inproc://wire-test")
        for message in sent:
            push.send_multipart(message.to_frames())
        received = [decode_message(pull.recv_multipart(copy=False)) for _ in sent]
        push.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.LINGER, 0)
    assert received == sent


def test_from_frames_rejects_another_message_type() -> None:
    """A class's from_frames refuses a valid message of another type."""
    frames = WatermarkUpdate(1, 2).to_frames()
    with pytest.raises(
        MalformedMessage, match=r"^frame 0 \('type'\): expected STAGING_REQ, got WATERMARK$"
    ) as info:
        StagingReq.from_frames(frames)
    assert (info.value.frame_index, info.value.field) == (0, "type")


# ---------------------------------------------------------------------------------------------
# Malformed input
# ---------------------------------------------------------------------------------------------

REQ = [b"STAGING_REQ", b"7", b"0", b"4", b"sess"]
RSP = [b"STAGING_RSP", b"7", b"0", b"128", b"1", b"640", b"sess"]
WM = [b"WATERMARK", b"1", b"2", b"sess"]
CR = [b"CHUNK_READY", b"7", b"0", b"8", b"4", b"sess", b"3"]


def with_frame(frames: list[bytes], index: int, value: object) -> list[object]:
    """A copy of frames with one frame replaced."""
    out: list[object] = list(frames)
    out[index] = value
    return out


BYTES_LIKE: list[Callable[[bytes], object]] = [bytearray, memoryview, zmq.Frame]
"""The frame types other than bytes that a receiver may hand over."""

MALFORMED: list[tuple[list[object], str, int | None, str | None]] = [
    # frame counts
    ([], r"^frame 0 \('type'\): missing \(the message has no frames\)$", 0, "type"),
    (
        list(REQ[:4]),
        r"^STAGING_REQ frame 4 \('session_id'\): missing \(STAGING_REQ takes 5 or 6 frames, "
        r"got 4\)$",
        4,
        "session_id",
    ),
    (
        [b"STAGING_RSP"],
        r"^STAGING_RSP frame 1 \('room'\): missing \(STAGING_RSP takes 7 frames",
        1,
        "room",
    ),
    (list(RSP[:6]), r"^STAGING_RSP frame 6 \('session_id'\): missing", 6, "session_id"),
    (
        [b"WATERMARK", b"1"],
        r"^WATERMARK frame 2 \('tail'\): missing \(WATERMARK takes 3 or 4",
        2,
        "tail",
    ),
    (list(CR[:5]), r"^CHUNK_READY frame 5 \('session_id'\): missing", 5, "session_id"),
    (
        [*REQ, b"1", b"2"],
        r"^STAGING_REQ frame 6: unexpected extra frame \(STAGING_REQ takes 5 or 6 frames, got 7\)$",
        6,
        None,
    ),
    ([*RSP, b"x"], r"^STAGING_RSP frame 7: unexpected extra frame", 7, None),
    ([*WM, b"x"], r"^WATERMARK frame 4: unexpected extra frame", 4, None),
    ([*CR, b"5", TAG.encode(), b"x"], r"^CHUNK_READY frame 9: unexpected extra frame", 9, None),
    ([*CR, b"x"], r"^CHUNK_READY frame 7 \('epoch'\): not an ASCII decimal", 7, "epoch"),
    ([*CR, b"5", b"-"], r"^CHUNK_READY frame 8 \('tag'\): must be a 16-hex-digit digest", 8, "tag"),
    ([*CR, b"5", b""], r"^CHUNK_READY frame 8 \('tag'\): must be a 16-hex-digit digest", 8, "tag"),
    (
        [*CR, b"5", TAG.upper().encode()],
        r"^CHUNK_READY frame 8 \('tag'\): must be a 16-hex-digit digest",
        8,
        "tag",
    ),
    ([*CR, b"-1"], r"^CHUNK_READY frame 7 \('epoch'\): must be >= 0, got -1$", 7, "epoch"),
    ([*WM, *([b"1"] * 100_000)], r"^WATERMARK frame 4: unexpected extra frame", 4, None),
    # frame type
    ([b"HELLO", b"1"], r"^frame 0 \('type'\): unknown message type b'HELLO'$", 0, "type"),
    (
        [b"staging_req", *REQ[1:]],
        r"^frame 0 \('type'\): unknown message type b'staging_req'$",
        0,
        "type",
    ),
    ([b"STAGING_REQ ", *REQ[1:]], r"^frame 0 \('type'\): unknown message type", 0, "type"),
    ([b"", *REQ[1:]], r"^frame 0 \('type'\): unknown message type b''$", 0, "type"),
    ([b"X" * 5000], r"^frame 0 \('type'\): unknown message type b'XXX", 0, "type"),
    (["STAGING_REQ", *REQ[1:]], r"^frame 0 \('type'\): not a bytes-like frame: str$", 0, "type"),
    # integers
    (
        with_frame(REQ, 1, b"\xff"),
        r"^STAGING_REQ frame 1 \('room'\): not an ASCII decimal integer: b'\\xff'$",
        1,
        "room",
    ),
    (
        with_frame(REQ, 2, b"abc"),
        r"^STAGING_REQ frame 2 \('chunk_idx'\): not an ASCII decimal integer: b'abc'$",
        2,
        "chunk_idx",
    ),
    (
        with_frame(REQ, 2, b"+5"),
        r"^STAGING_REQ frame 2 \('chunk_idx'\): not an ASCII decimal integer: b'\+5'$",
        2,
        "chunk_idx",
    ),
    (
        with_frame(REQ, 2, b" 5"),
        r"^STAGING_REQ frame 2 \('chunk_idx'\): not an ASCII decimal integer: b' 5'$",
        2,
        "chunk_idx",
    ),
    (
        with_frame(REQ, 2, b"5 "),
        r"^STAGING_REQ frame 2 \('chunk_idx'\): not an ASCII decimal integer",
        2,
        "chunk_idx",
    ),
    (
        with_frame(REQ, 2, b"5\n"),
        r"^STAGING_REQ frame 2 \('chunk_idx'\): not an ASCII decimal integer",
        2,
        "chunk_idx",
    ),
    (
        with_frame(REQ, 3, b"1_000"),
        r"^STAGING_REQ frame 3 \('num_pages'\): not an ASCII decimal integer: b'1_000'$",
        3,
        "num_pages",
    ),
    (
        with_frame(REQ, 3, "\u0665".encode()),  # ARABIC-INDIC DIGIT FIVE
        r"^STAGING_REQ frame 3 \('num_pages'\): not an ASCII decimal integer",
        3,
        "num_pages",
    ),
    (
        with_frame(REQ, 3, "\u00b2".encode()),  # SUPERSCRIPT TWO
        r"^STAGING_REQ frame 3 \('num_pages'\): not an ASCII decimal integer",
        3,
        "num_pages",
    ),
    (
        with_frame(REQ, 1, b""),
        r"^STAGING_REQ frame 1 \('room'\): not an ASCII decimal integer: b''$",
        1,
        "room",
    ),
    (
        with_frame(REQ, 1, b"-"),
        r"^STAGING_REQ frame 1 \('room'\): not an ASCII decimal integer",
        1,
        "room",
    ),
    (
        with_frame(REQ, 1, b"--5"),
        r"^STAGING_REQ frame 1 \('room'\): not an ASCII decimal integer",
        1,
        "room",
    ),
    (
        with_frame(REQ, 1, b"0x10"),
        r"^STAGING_REQ frame 1 \('room'\): not an ASCII decimal integer",
        1,
        "room",
    ),
    (
        with_frame(REQ, 1, b"1e3"),
        r"^STAGING_REQ frame 1 \('room'\): not an ASCII decimal integer",
        1,
        "room",
    ),
    (
        with_frame(REQ, 1, b"7\x00"),
        r"^STAGING_REQ frame 1 \('room'\): not an ASCII decimal integer",
        1,
        "room",
    ),
    (
        with_frame(REQ, 1, b"1" * 21),
        r"^STAGING_REQ frame 1 \('room'\): integer of more than 20 digits",
        1,
        "room",
    ),
    (
        with_frame(RSP, 5, b"-" + b"9" * 21),
        r"^STAGING_RSP frame 5 \('end'\): integer of more than 20 digits",
        5,
        "end",
    ),
    (
        with_frame(REQ, 1, str(2**63).encode()),
        r"^STAGING_REQ frame 1 \('room'\): must fit a signed 64-bit integer, "
        r"got 9223372036854775808$",
        1,
        "room",
    ),
    (
        with_frame(WM, 2, b"9" * 20),
        r"^WATERMARK frame 2 \('tail'\): must fit a signed 64-bit integer",
        2,
        "tail",
    ),
    (
        with_frame(RSP, 5, str(-(2**63) - 1).encode()),
        r"^STAGING_RSP frame 5 \('end'\): must fit a signed 64-bit integer",
        5,
        "end",
    ),
    # ranges
    (
        with_frame(REQ, 1, b"-1"),
        r"^STAGING_REQ frame 1 \('room'\): must be >= 0, got -1$",
        1,
        "room",
    ),
    (
        with_frame(REQ, 2, b"-3"),
        r"^STAGING_REQ frame 2 \('chunk_idx'\): must be >= 0, got -3$",
        2,
        "chunk_idx",
    ),
    (
        with_frame(REQ, 3, b"0"),
        r"^STAGING_REQ frame 3 \('num_pages'\): must be >= 1, got 0$",
        3,
        "num_pages",
    ),
    ([*REQ, b"-1"], r"^STAGING_REQ frame 5 \('pp_rank'\): must be >= 0, got -1$", 5, "pp_rank"),
    (
        with_frame(WM, 1, b"-1"),
        r"^WATERMARK frame 1 \('round'\): must be >= 0, got -1$",
        1,
        "round",
    ),
    (with_frame(WM, 2, b"-5"), r"^WATERMARK frame 2 \('tail'\): must be >= 0, got -5$", 2, "tail"),
    (
        with_frame(CR, 3, b"-1"),
        r"^CHUNK_READY frame 3 \('page_start'\): must be >= 0, got -1$",
        3,
        "page_start",
    ),
    (
        with_frame(CR, 4, b"0"),
        r"^CHUNK_READY frame 4 \('num_pages'\): must be >= 1, got 0$",
        4,
        "num_pages",
    ),
    (
        with_frame(CR, 6, b"-2"),
        r"^CHUNK_READY frame 6 \('writer_rank'\): must be >= 0, got -2$",
        6,
        "writer_rank",
    ),
    (
        with_frame(RSP, 4, b"-1"),
        r"^STAGING_RSP frame 4 \('round'\): must be >= 0, got -1$",
        4,
        "round",
    ),
    # STAGING_RSP offsets
    (
        with_frame(RSP, 3, b"-1"),
        r"^STAGING_RSP frame 3 \('offset'\): must not be -1 \(prefill-local 'no answer yet'\)$",
        3,
        "offset",
    ),
    (
        with_frame(RSP, 3, b"-3"),
        r"^STAGING_RSP frame 3 \('offset'\): must be >= 0 or -2, got -3$",
        3,
        "offset",
    ),
    (
        [b"STAGING_RSP", b"7", b"0", b"-2", b"1", b"-1", b"sess"],
        r"^STAGING_RSP frame 4 \('round'\): must be 0 with offset -2, got 1$",
        4,
        "round",
    ),
    (
        [b"STAGING_RSP", b"7", b"0", b"-2", b"0", b"0", b"sess"],
        r"^STAGING_RSP frame 5 \('end'\): must be -1 with offset -2, got 0$",
        5,
        "end",
    ),
    (
        with_frame(RSP, 5, b"128"),
        r"^STAGING_RSP frame 5 \('end'\): must be > offset \(128\), got 128$",
        5,
        "end",
    ),
    (
        with_frame(RSP, 5, b"-1"),
        r"^STAGING_RSP frame 5 \('end'\): must be > offset \(128\), got -1$",
        5,
        "end",
    ),
    # sessions
    (
        with_frame(REQ, 4, b""),
        r"^STAGING_REQ frame 4 \('session_id'\): must be 1-256 characters of printable ASCII, "
        r"got ''$",
        4,
        "session_id",
    ),
    (
        with_frame(REQ, 4, b"s" * 257),
        r"^STAGING_REQ frame 4 \('session_id'\): must be 1-256 characters of printable ASCII, "
        r"got 'sss.*\.\.\. \(257 long\)$",
        4,
        "session_id",
    ),
    (
        with_frame(RSP, 6, b"se\nss"),
        r"^STAGING_RSP frame 6 \('session_id'\): must be 1-256 characters",
        6,
        "session_id",
    ),
    (
        with_frame(WM, 3, b"a\x00b"),
        r"^WATERMARK frame 3 \('session_id'\): must be 1-256 characters",
        3,
        "session_id",
    ),
    (
        with_frame(WM, 3, b"\x7f"),
        r"^WATERMARK frame 3 \('session_id'\): must be 1-256 characters",
        3,
        "session_id",
    ),
    (
        with_frame(CR, 5, b"\x1b[0m"),
        r"^CHUNK_READY frame 5 \('session_id'\): must be 1-256 characters",
        5,
        "session_id",
    ),
    (
        with_frame(CR, 5, "café".encode()),
        r"^CHUNK_READY frame 5 \('session_id'\): not ASCII: b'caf\\xc3\\xa9'$",
        5,
        "session_id",
    ),
    # room and chunk_idx of the other messages
    (
        with_frame(RSP, 1, b"-1"),
        r"^STAGING_RSP frame 1 \('room'\): must be >= 0, got -1$",
        1,
        "room",
    ),
    (
        with_frame(RSP, 2, b"-4"),
        r"^STAGING_RSP frame 2 \('chunk_idx'\): must be >= 0, got -4$",
        2,
        "chunk_idx",
    ),
    (
        with_frame(CR, 1, b"-1"),
        r"^CHUNK_READY frame 1 \('room'\): must be >= 0, got -1$",
        1,
        "room",
    ),
    (
        with_frame(CR, 2, b"-9"),
        r"^CHUNK_READY frame 2 \('chunk_idx'\): must be >= 0, got -9$",
        2,
        "chunk_idx",
    ),
    (
        with_frame(CR, 1, str(2**63).encode()),
        r"^CHUNK_READY frame 1 \('room'\): must fit a signed 64-bit integer, "
        r"got 9223372036854775808$",
        1,
        "room",
    ),
    # the signed 64-bit bounds of an offset
    (
        with_frame(RSP, 3, str(-(2**63)).encode()),
        r"^STAGING_RSP frame 3 \('offset'\): must be >= 0 or -2, got -9223372036854775808$",
        3,
        "offset",
    ),
    (
        with_frame(RSP, 3, str(2**63).encode()),
        r"^STAGING_RSP frame 3 \('offset'\): must fit a signed 64-bit integer, "
        r"got 9223372036854775808$",
        3,
        "offset",
    ),
    # values shown whole up to 40 bytes, cut beyond
    (
        with_frame(REQ, 1, b"a" * 40),
        r"^STAGING_REQ frame 1 \('room'\): not an ASCII decimal integer: b'a{40}'$",
        1,
        "room",
    ),
    (
        with_frame(REQ, 1, b"a" * 41),
        r"^STAGING_REQ frame 1 \('room'\): not an ASCII decimal integer: "
        r"b'a{40}'\.\.\. \(41 long\)$",
        1,
        "room",
    ),
    # non-bytes frames
    (
        with_frame(REQ, 1, 7),
        r"^STAGING_REQ frame 1 \('room'\): not a bytes-like frame: int$",
        1,
        "room",
    ),
    (
        with_frame(REQ, 4, "sess"),
        r"^STAGING_REQ frame 4 \('session_id'\): not a bytes-like frame: str$",
        4,
        "session_id",
    ),
    (
        with_frame(WM, 2, None),
        r"^WATERMARK frame 2 \('tail'\): not a bytes-like frame: NoneType$",
        2,
        "tail",
    ),
    # size
    (
        with_frame(WM, 3, b"s" * 5000),
        r"^WATERMARK: message too large: more than 4096 bytes$",
        None,
        None,
    ),
    (
        with_frame(WM, 3, memoryview(b"s" * 5000)),
        r"^WATERMARK frame 3 \('session_id'\): message too large: 5000 bytes \(at most 4096\)$",
        3,
        "session_id",
    ),
    (
        with_frame(WM, 3, bytearray(MAX_MESSAGE_BYTES + 1)),
        r"^WATERMARK frame 3 \('session_id'\): message too large: 4097 bytes",
        3,
        "session_id",
    ),
    (
        with_frame(WM, 3, zmq.Frame(b"s" * 5000)),
        r"^WATERMARK frame 3 \('session_id'\): message too large: 5000 bytes \(at most 4096\)$",
        3,
        "session_id",
    ),
    (
        [zmq.Frame(b"X" * 5000)],
        r"^frame 0 \('type'\): message too large: 5000 bytes \(at most 4096\)$",
        0,
        "type",
    ),
    # the frames add up: every frame fits, the message does not
    (
        with_frame(WM, 3, b"s" * (MAX_MESSAGE_BYTES - 10)),
        r"^WATERMARK: message too large: more than 4096 bytes$",
        None,
        None,
    ),
    # exactly MAX_MESSAGE_BYTES: not too large
    (
        with_frame(WM, 3, b"s" * (MAX_MESSAGE_BYTES - 11)),
        r"^WATERMARK frame 3 \('session_id'\): must be 1-256 characters of printable ASCII, "
        r"got 's{40}'\.\.\. \(4085 long\)$",
        3,
        "session_id",
    ),
    *(
        (
            [make(b"X" * MAX_MESSAGE_BYTES)],
            r"^frame 0 \('type'\): unknown message type b'X{40}'\.\.\. \(4096 long\)$",
            0,
            "type",
        )
        for make in BYTES_LIKE
    ),
    *(
        (
            [b"WATERMARK", make(b"1" * MAX_MESSAGE_BYTES), b"0"],
            r"^WATERMARK: message too large: more than 4096 bytes$",
            None,
            None,
        )
        for make in BYTES_LIKE
    ),
]


@pytest.mark.parametrize(
    ("frames", "match", "frame_index", "field"), MALFORMED, ids=[slug(m[1]) for m in MALFORMED]
)
def test_malformed_message_is_rejected(
    frames: list[object], match: str, frame_index: int | None, field: str | None
) -> None:
    """Each malformed message raises MalformedMessage naming the frame, the field and why."""
    with pytest.raises(MalformedMessage, match=match) as info:
        decode_message(frames)
    assert info.value.frame_index == frame_index
    assert info.value.field == field
    assert str(info.value).endswith(info.value.reason)


@pytest.mark.parametrize(
    "frames",
    [
        b"STAGING_REQ",
        bytearray(b"WATERMARK"),
        memoryview(b"WATERMARK"),
        "STAGING_REQ",
        None,
        42,
        {b"WATERMARK"},
    ],
)
def test_non_sequence_input_is_rejected(frames: object) -> None:
    """Input that is not a sequence of frames raises MalformedMessage, not TypeError."""
    with pytest.raises(MalformedMessage, match=r"^expected a sequence of frames, got \w+$") as info:
        decode_message(frames)  # type: ignore[arg-type]
    assert (info.value.frame_index, info.value.field) == (None, None)


def test_a_generator_of_frames_is_rejected() -> None:
    """A generator is not a sequence: it is rejected, never consumed."""

    def frames() -> Iterator[bytes]:
        yield from WM

    with pytest.raises(MalformedMessage, match=r"^expected a sequence of frames, got generator$"):
        decode_message(frames())  # type: ignore[arg-type]


def test_unreadable_frames_are_rejected() -> None:
    """A released buffer or a frame whose .bytes fails raises MalformedMessage."""

    class BrokenFrame:
        @property
        def bytes(self) -> bytes:
            raise RuntimeError("frame closed")

    class TextFrame:
        bytes = "STAGING_REQ"

    view = memoryview(b"7")
    view.release()
    with pytest.raises(
        MalformedMessage, match=r"^STAGING_REQ frame 1 \('room'\): unreadable memoryview frame"
    ) as info:
        decode_message(with_frame(REQ, 1, view))
    assert (info.value.frame_index, info.value.field) == (1, "room")
    with pytest.raises(
        MalformedMessage, match=r"^frame 0 \('type'\): unreadable BrokenFrame frame: frame closed$"
    ):
        decode_message([BrokenFrame(), *REQ[1:]])
    with pytest.raises(
        MalformedMessage, match=r"^frame 0 \('type'\): not a bytes-like frame: TextFrame$"
    ):
        decode_message([TextFrame(), *REQ[1:]])


MALFORMED_NOTIFICATIONS: list[tuple[object, str, int | None, str | None]] = [
    (b"", r"^frame 0 \('type'\): not a CHUNK_READY notification: b''$", 0, "type"),
    (
        b"STAGING_REQ\x007\x000\x004\x00sess",
        r"^frame 0 \('type'\): not a CHUNK_READY notification: b'STAGING_REQ'$",
        0,
        "type",
    ),
    (b"CHUNK_READY", r"^CHUNK_READY frame 1 \('room'\): missing", 1, "room"),
    (
        b"CHUNK_READY\x001\x000\x000\x001\x00s\x003\x005\x00" + TAG.encode() + b"\x00x",
        r"^CHUNK_READY frame 9: unexpected extra frame",
        9,
        None,
    ),
    (
        b"CHUNK_READY\x001\x000\x000\x000\x00s",
        r"^CHUNK_READY frame 4 \('num_pages'\): must be >= 1",
        4,
        "num_pages",
    ),
    (
        b"CHUNK_READY\x00+1\x000\x000\x001\x00s",
        r"^CHUNK_READY frame 1 \('room'\): not an ASCII",
        1,
        "room",
    ),
    (
        b"CHUNK_READY\x001\x000\x000\x001\x00",
        r"^CHUNK_READY frame 5 \('session_id'\): must be 1-256",
        5,
        "session_id",
    ),
    (
        b"CHUNK_READY\x00" + b"1" * 5000,
        r"^message too large: 5012 bytes \(at most 4096\)$",
        None,
        None,
    ),
    ("CHUNK_READY\x001\x000\x000\x001\x00s", r"^not a bytes-like frame: str$", None, None),
    (
        b"CHUNK_READY\x00" + b"1" * (MAX_MESSAGE_BYTES - 12),
        r"^CHUNK_READY frame 2 \('chunk_idx'\): missing \(CHUNK_READY takes 6 to 9 frames, "
        r"got 2\)$",
        2,
        "chunk_idx",
    ),
    *(
        (
            make(b"CHUNK_READY\x00" + b"1" * (MAX_MESSAGE_BYTES - 12)),
            r"^CHUNK_READY frame 2 \('chunk_idx'\): missing",
            2,
            "chunk_idx",
        )
        for make in (bytearray, memoryview)
    ),
    (
        bytearray(b"CHUNK_READY\x00" + b"1" * (MAX_MESSAGE_BYTES - 11)),
        r"^message too large: 4097 bytes \(at most 4096\)$",
        None,
        None,
    ),
]


@pytest.mark.parametrize(
    ("payload", "match", "frame_index", "field"),
    MALFORMED_NOTIFICATIONS,
    ids=[slug(case[1]) for case in MALFORMED_NOTIFICATIONS],
)
def test_malformed_notification_is_rejected(
    payload: object, match: str, frame_index: int | None, field: str | None
) -> None:
    """Each malformed notification raises MalformedMessage naming the field and why."""
    with pytest.raises(MalformedMessage, match=match) as info:
        decode_notification(payload)  # type: ignore[arg-type]
    assert (info.value.frame_index, info.value.field) == (frame_index, field)


def test_malformed_message_keeps_its_fields_through_pickle() -> None:
    """MalformedMessage is a ValueError whose fields survive pickling."""
    error = MalformedMessage("must be >= 0, got -1", 1, "room", "STAGING_REQ")
    assert isinstance(error, ValueError)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.reason, copy.frame_index, copy.field, copy.message_type) == (
        "must be >= 0, got -1",
        1,
        "room",
        "STAGING_REQ",
    )
    assert str(copy) == "STAGING_REQ frame 1 ('room'): must be >= 0, got -1"
    assert str(MalformedMessage("empty")) == "empty"


# ---------------------------------------------------------------------------------------------
# Properties: nothing but MalformedMessage
# ---------------------------------------------------------------------------------------------


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=10))
def test_arbitrary_bytes_raise_only_malformed_message(frames: list[bytes]) -> None:
    """Arbitrary lists of arbitrary bytes decode or raise MalformedMessage, nothing else."""
    assert_malformed_only(list(frames))


@FUZZ
@given(st.lists(plausible_frames, max_size=9))
def test_plausible_frames_raise_only_malformed_message(frames: list[bytes]) -> None:
    """Lists of plausible frames decode or raise MalformedMessage, nothing else."""
    assert_malformed_only(list(frames))


@FUZZ
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=16),
            st.text(max_size=8),
            st.integers(),
            st.none(),
            st.floats(),
            st.binary(max_size=16).map(bytearray),
            st.binary(max_size=16).map(as_view),
        ),
        max_size=8,
    )
)
def test_arbitrary_objects_raise_only_malformed_message(frames: list[object]) -> None:
    """Lists of arbitrary objects as frames decode or raise MalformedMessage, nothing else."""
    assert_malformed_only(frames)


@FUZZ
@given(messages, st.data())
def test_mutated_valid_frames_raise_only_malformed_message(
    message: Message, data: st.DataObject
) -> None:
    """Valid frames with random mutations decode or raise MalformedMessage, nothing else."""
    frames: list[bytes] = message.to_frames()
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["replace", "delete", "insert", "poke", "append"]))
        index = data.draw(st.integers(0, max(0, len(frames) - 1)))
        if op == "replace" and frames:
            frames[index] = data.draw(plausible_frames)
        elif op == "delete" and frames:
            del frames[index]
        elif op == "insert":
            frames.insert(index, data.draw(plausible_frames))
        elif op == "poke" and frames and frames[index]:
            at = data.draw(st.integers(0, len(frames[index]) - 1))
            byte = data.draw(st.integers(0, 255))
            frames[index] = frames[index][:at] + bytes([byte]) + frames[index][at + 1 :]
        else:
            frames.append(data.draw(plausible_frames))
    assert_malformed_only(list(frames))
    with contextlib.suppress(MalformedMessage):
        decode_notification(b"\x00".join(frames))


@FUZZ
@given(st.binary(max_size=128))
def test_arbitrary_notifications_raise_only_malformed_message(payload: bytes) -> None:
    """Arbitrary payloads decode as CHUNK_READY or raise MalformedMessage, nothing else."""
    message: ChunkReady | None = None
    with contextlib.suppress(MalformedMessage):
        message = decode_notification(b"CHUNK_READY\x00" + payload)
    if message is not None:
        assert decode_notification(message.to_notification()) == message


# ---------------------------------------------------------------------------------------------
# Constructors
# ---------------------------------------------------------------------------------------------

CONSTRUCTORS: list[tuple[Callable[[], object], str]] = [
    (lambda: StagingReq(-1, 0, 4, "s"), r"^invalid StagingReq: 'room' must be >= 0, got -1$"),
    (lambda: StagingReq(0, -1, 4, "s"), r"^invalid StagingReq: 'chunk_idx' must be >= 0, got -1$"),
    (lambda: StagingReq(0, 0, 0, "s"), r"^invalid StagingReq: 'num_pages' must be >= 1, got 0$"),
    (
        lambda: StagingReq(0, 0, 1, ""),
        r"^invalid StagingReq: 'session_id' must be 1-256 characters of printable ASCII, got ''$",
    ),
    (lambda: StagingReq(0, 0, 1, "x" * 257), r"^invalid StagingReq: 'session_id' must be 1-256"),
    (lambda: StagingReq(0, 0, 1, "café"), r"^invalid StagingReq: 'session_id' must be 1-256"),
    (lambda: StagingReq(0, 0, 1, "a\tb"), r"^invalid StagingReq: 'session_id' must be 1-256"),
    (
        lambda: StagingReq(0, 0, 1, "s", pp_rank=-1),
        r"^invalid StagingReq: 'pp_rank' must be >= 0, got -1$",
    ),
    (
        lambda: StagingReq(2**63, 0, 1, "s"),
        r"^invalid StagingReq: 'room' must fit a signed 64-bit integer",
    ),
    (lambda: StagingReq(True, 0, 1, "s"), r"^invalid StagingReq: 'room' must be an int, got bool$"),
    (
        lambda: StagingReq(1.0, 0, 1, "s"),  # type: ignore[arg-type]
        r"^invalid StagingReq: 'room' must be an int, got float$",
    ),
    (
        lambda: StagingReq(0, 0, 1, b"s"),  # type: ignore[arg-type]
        r"^invalid StagingReq: 'session_id' must be a str, got bytes$",
    ),
    (
        lambda: StagingReq(0, 0, 1, "s", pp_rank="1"),  # type: ignore[arg-type]
        r"^invalid StagingReq: 'pp_rank' must be an int, got str$",
    ),
    (
        lambda: StagingRsp(0, 0, NO_ANSWER_YET, 0, 5, "s"),
        r"^invalid StagingRsp: 'offset' must not be -1 \(prefill-local 'no answer yet'\)$",
    ),
    (
        lambda: StagingRsp(0, 0, -7, 0, 5, "s"),
        r"^invalid StagingRsp: 'offset' must be >= 0 or -2, got -7$",
    ),
    (
        lambda: StagingRsp(0, 0, 8, 0, 8, "s"),
        r"^invalid StagingRsp: 'end' must be > offset \(8\), got 8$",
    ),
    (
        lambda: StagingRsp(0, 0, 8, -1, 9, "s"),
        r"^invalid StagingRsp: 'round' must be >= 0, got -1$",
    ),
    (
        lambda: StagingRsp(0, 0, ALLOC_OVERSIZED, 1, -1, "s"),
        r"^invalid StagingRsp: 'round' must be 0 with offset -2, got 1$",
    ),
    (
        lambda: StagingRsp(0, 0, ALLOC_OVERSIZED, 0, 0, "s"),
        r"^invalid StagingRsp: 'end' must be -1 with offset -2, got 0$",
    ),
    (
        lambda: StagingRsp(0, 0, 0, 0, 2**63, "s"),
        r"^invalid StagingRsp: 'end' must fit a signed 64-bit integer",
    ),
    (lambda: WatermarkUpdate(-1, 0), r"^invalid WatermarkUpdate: 'round' must be >= 0, got -1$"),
    (lambda: WatermarkUpdate(0, -1), r"^invalid WatermarkUpdate: 'tail' must be >= 0, got -1$"),
    (
        lambda: WatermarkUpdate(0, 0, "\x00"),
        r"^invalid WatermarkUpdate: 'session_id' must be 1-256",
    ),
    (
        lambda: ChunkReady(0, 0, -1, 1, "s"),
        r"^invalid ChunkReady: 'page_start' must be >= 0, got -1$",
    ),
    (lambda: ChunkReady(0, 0, 0, 0, "s"), r"^invalid ChunkReady: 'num_pages' must be >= 1, got 0$"),
    (
        lambda: ChunkReady(0, 0, 0, 1, "s", -1),
        r"^invalid ChunkReady: 'writer_rank' must be >= 0, got -1$",
    ),
    (lambda: ChunkReady(0, 0, 0, 1, "\x7f"), r"^invalid ChunkReady: 'session_id' must be 1-256"),
    (lambda: ChunkReady(-1, 0, 0, 1, "s"), r"^invalid ChunkReady: 'room' must be >= 0, got -1$"),
    (
        lambda: ChunkReady(0, -2, 0, 1, "s"),
        r"^invalid ChunkReady: 'chunk_idx' must be >= 0, got -2$",
    ),
    (lambda: StagingRsp(-1, 0, 0, 0, 1, "s"), r"^invalid StagingRsp: 'room' must be >= 0, got -1$"),
    (
        lambda: StagingRsp(0, -3, 0, 0, 1, "s"),
        r"^invalid StagingRsp: 'chunk_idx' must be >= 0, got -3$",
    ),
    (
        lambda: StagingRsp(0, 0, 2**63, 0, 1, "s"),
        r"^invalid StagingRsp: 'offset' must fit a signed 64-bit integer, got 9223372036854775808$",
    ),
    (
        lambda: StagingRsp(0, 0, 0.5, 0, 1, "s"),  # type: ignore[arg-type]
        r"^invalid StagingRsp: 'offset' must be an int, got float$",
    ),
    (
        lambda: StagingRsp(0, 0, 0, 0, 1, "a\nb"),
        r"^invalid StagingRsp: 'session_id' must be 1-256 characters of printable ASCII, "
        r"got 'a\\nb'$",
    ),
]


@pytest.mark.parametrize(("build", "match"), CONSTRUCTORS, ids=[slug(m) for _, m in CONSTRUCTORS])
def test_constructor_rejects_invalid_field(build: Callable[[], object], match: str) -> None:
    """Building a message with an invalid field raises ValueError naming field and value."""
    with pytest.raises(ValueError, match=match):
        build()


def test_oversized_answer_and_constants() -> None:
    """The oversized answer is the -2/0/-1 triple; -1 is never a wire offset."""
    answer = StagingRsp.oversized(7, 2, "sess")
    assert (answer.offset, answer.round, answer.end) == (ALLOC_OVERSIZED, 0, -1)
    assert answer.is_oversized
    assert not StagingRsp(7, 2, 0, 0, 1, "sess").is_oversized
    assert (ALLOC_OVERSIZED, NO_ANSWER_YET) == (-2, -1)
    assert {b"STAGING_REQ", b"STAGING_RSP", b"WATERMARK", b"CHUNK_READY"} == MESSAGE_TYPES


def test_messages_are_frozen_and_hashable() -> None:
    """Messages are immutable records usable as dict keys."""
    message = StagingReq(7, 0, 4, "sess")
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.room = 8  # type: ignore[misc]
    assert {message: 1}[StagingReq(7, 0, 4, "sess")] == 1


class Wide(int):
    """An int subclass, as an IntEnum or a numpy-converted value might be."""


def test_int_subclasses_are_checked_at_both_bounds() -> None:
    """Accepts int subclasses at a field's minimum and at the signed 64-bit maximum."""
    req = StagingReq(Wide(0), Wide(0), Wide(1), "s", Wide(I64_MAX))
    assert req.to_frames() == [b"STAGING_REQ", b"0", b"0", b"1", b"s", str(I64_MAX).encode()]
    rsp = StagingRsp(Wide(I64_MAX), Wide(0), Wide(0), Wide(0), Wide(I64_MAX), "s")
    assert rsp.to_frames()[1:6] == [str(I64_MAX).encode(), b"0", b"0", b"0", str(I64_MAX).encode()]
    with pytest.raises(ValueError, match=r"^invalid StagingReq: 'num_pages' must be >= 1, got 0$"):
        StagingReq(0, 0, Wide(0), "s")
    with pytest.raises(
        ValueError, match=r"^invalid StagingReq: 'room' must fit a signed 64-bit integer, got "
    ):
        StagingReq(Wide(I64_MAX + 1), 0, 1, "s")
    with pytest.raises(
        ValueError,
        match=r"^invalid StagingRsp: 'offset' must be >= 0 or -2, got -9223372036854775808$",
    ):
        StagingRsp(0, 0, Wide(-(2**63)), 0, 1, "s")


def test_malformed_message_args_hold_every_field() -> None:
    """Passes all four fields to ValueError, so args and repr show them."""
    error = MalformedMessage("must be >= 0, got -1", 1, "room", "STAGING_REQ")
    assert error.args == ("must be >= 0, got -1", 1, "room", "STAGING_REQ")
    assert repr(error) == "MalformedMessage('must be >= 0, got -1', 1, 'room', 'STAGING_REQ')"
    assert MalformedMessage("empty").args == ("empty", None, None, None)


def test_any_sequence_of_frames_decodes() -> None:
    """Decodes frames from any Sequence, not only a list or a tuple."""
    assert decode_message(UserList(WM)) == WatermarkUpdate(1, 2, "sess")
    assert decode_message(UserList(CR)) == ChunkReady(7, 0, 8, 4, "sess", 3)


def test_notification_refuses_a_record_other_than_chunk_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refuses the payload if the CHUNK_READY codec ever built another record (defensive)."""
    monkeypatch.setitem(wire._CODECS, ChunkReady.WIRE_TYPE, wire._CODECS[StagingReq.WIRE_TYPE])
    with pytest.raises(
        MalformedMessage, match=r"^frame 0 \('type'\): not a CHUNK_READY notification$"
    ) as info:
        decode_notification(b"CHUNK_READY\x007\x000\x004\x00sess")
    assert (info.value.reason, info.value.frame_index, info.value.field) == (
        "not a CHUNK_READY notification",
        0,
        "type",
    )
    assert info.value.message_type is None


# ---------------------------------------------------------------------------------------------
# The empty WATERMARK session frame of the reference's decode (issue 17)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [bytes, *BYTES_LIKE], ids=lambda f: f.__name__)
def test_watermark_with_an_empty_session_frame_is_one_without_a_session(
    make: Callable[[bytes], object],
) -> None:
    """The reference's decode sends WATERMARK with an empty session frame; it decodes as
    "no session", the same record as the three-frame message, and re-encodes as that."""
    frames = [b"WATERMARK", b"3", b"4096", make(b"")]
    message = decode_message(frames)
    assert message == WatermarkUpdate(3, 4096)
    assert message == decode_message([b"WATERMARK", b"3", b"4096"])
    assert isinstance(message, WatermarkUpdate)
    assert message.session_id == ""
    assert message.to_frames() == [b"WATERMARK", b"3", b"4096"]
    assert WatermarkUpdate.from_frames(frames) == message


def test_watermark_with_an_empty_session_frame_crosses_a_real_zmq_socket() -> None:
    """Over a PUSH -> PULL pair, the empty frame arrives as sent and decodes."""
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    push = context.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send_multipart([b"WATERMARK", b"3", b"4096", b""])
        assert pull.poll(5000)
        received = pull.recv_multipart()
        assert received == [b"WATERMARK", b"3", b"4096", b""]
        assert decode_message(received) == WatermarkUpdate(3, 4096)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        context.term()


EMPTY_SESSION_ELSEWHERE = [
    (with_frame(REQ, 4, b""), "STAGING_REQ", 4),
    (with_frame(RSP, 6, b""), "STAGING_RSP", 6),
    (with_frame(CR, 5, b""), "CHUNK_READY", 5),
    (with_frame(CR, 5, b"")[:6], "CHUNK_READY", 5),
]


@pytest.mark.parametrize(("frames", "kind", "index"), EMPTY_SESSION_ELSEWHERE)
def test_an_empty_session_is_still_refused_in_every_other_message(
    frames: list[object], kind: str, index: int
) -> None:
    """Only WATERMARK's session is optional; in the other three an empty one is malformed."""
    with pytest.raises(MalformedMessage) as info:
        decode_message(frames)
    assert str(info.value) == (
        f"{kind} frame {index} ('session_id'): must be 1-256 characters of printable ASCII, got ''"
    )
    assert (info.value.frame_index, info.value.field) == (index, "session_id")


def test_an_empty_session_is_still_refused_in_a_notification() -> None:
    """The NIXL arrival notification names its session too."""
    with pytest.raises(MalformedMessage, match=r"^CHUNK_READY frame 5 \('session_id'\): must be"):
        decode_notification(b"CHUNK_READY\x007\x000\x008\x004\x00\x003")


@pytest.mark.parametrize(
    ("session", "match"),
    [
        (b" ", None),  # printable: a session of one space is a session
        (b"a\x00b", r"must be 1-256 characters of printable ASCII, got 'a\\x00b'$"),
        (b"\x7f", r"must be 1-256 characters of printable ASCII"),
        (b"\t", r"must be 1-256 characters of printable ASCII"),
        (b"s" * 257, r"must be 1-256 characters of printable ASCII, got 'sss.*\(257 long\)$"),
        ("café".encode(), r"not ASCII: b'caf\\xc3\\xa9'$"),
    ],
    ids=["space", "nul", "del", "tab", "too-long", "not-ascii"],
)
def test_every_other_malformed_watermark_session_is_still_refused(
    session: bytes, match: str | None
) -> None:
    """Accepting the empty frame did not loosen the rule for any non-empty session."""
    frames = [b"WATERMARK", b"3", b"4096", session]
    if match is None:
        assert decode_message(frames) == WatermarkUpdate(3, 4096, session.decode())
        return
    with pytest.raises(MalformedMessage, match=r"^WATERMARK frame 3 \('session_id'\): " + match):
        decode_message(frames)


def test_an_empty_watermark_session_frame_is_no_extra_frame_allowance() -> None:
    """The empty frame takes the session's place; a fifth frame after it is still extra."""
    with pytest.raises(MalformedMessage, match=r"^WATERMARK frame 4: unexpected extra frame"):
        decode_message([b"WATERMARK", b"3", b"4096", b"", b""])


def test_an_epoch_needs_a_writer_rank_and_a_tag_an_epoch() -> None:
    """The optional frames of CHUNK_READY come in order, so a record that skips one cannot be
    built (it could not be encoded)."""
    with pytest.raises(ValueError, match=r"'epoch' needs a writer_rank"):
        ChunkReady(1, 0, 0, 1, "s", None, 3)
    with pytest.raises(ValueError, match=r"'tag' needs an epoch"):
        ChunkReady(1, 0, 0, 1, "s", 0, None, "0" * 16)
    with pytest.raises(ValueError, match=r"'tag' must be a 16-hex-digit digest"):
        ChunkReady(1, 0, 0, 1, "s", 0, 0, "-")
