"""The per-request and peer control messages: ROOM_META, ROOM_FAILED, fences, liveness."""

from __future__ import annotations

import pytest

from staging_contracts._control.room_messages import (
    Ping,
    Pong,
    RoomFailed,
    RoomFailedAck,
    RoomFence,
    RoomFenced,
    RoomMeta,
)
from staging_contracts._control.wire import MalformedMessage


def test_room_meta_round_trips() -> None:
    """ROOM_META encodes to ASCII frames and decodes back."""
    meta = RoomMeta(7, 1, 12, 4)
    assert meta.to_frames() == [b"ROOM_META", b"7", b"1", b"12", b"4"]
    assert RoomMeta.from_frames(meta.to_frames()) == meta


def test_room_failed_round_trips_and_cuts_long_reasons() -> None:
    """ROOM_FAILED carries a bounded ASCII reason."""
    failed = RoomFailed(3, "engine write failed")
    assert RoomFailed.from_frames(failed.to_frames()) == failed
    assert len(RoomFailed(3, "x" * 2000).to_frames()[2]) == 512


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([b"ROOM_META", b"7", b"1", b"12"], r"^ROOM_META: ROOM_META takes 5 or 6 frames, got 4$"),
        ([b"ROOM_META", b"+7", b"1", b"12", b"4"], r"^ROOM_META frame 1 \('room'\)"),
        ([b"ROOM_META", b"7", b"1", b"0", b"4"], r"^ROOM_META: page counts must be >= 1$"),
        ([b"WATERMARK", b"7"], r"^frame 0 \('type'\): expected ROOM_META$"),
        ([b"ROOM_META", b"7", "1", b"12", b"4"], r"^ROOM_META frame 2: frame is not bytes$"),
    ],
)
def test_malformed_room_meta_is_rejected(frames: list[object], match: str) -> None:
    """Bad ROOM_META frames raise MalformedMessage naming the frame."""
    with pytest.raises(MalformedMessage, match=match):
        RoomMeta.from_frames(frames)


def test_malformed_room_failed_is_rejected() -> None:
    """An oversized reason is malformed."""
    with pytest.raises(
        MalformedMessage, match=r"^ROOM_FAILED frame 2 \('reason'\): reason too long$"
    ):
        RoomFailed.from_frames([b"ROOM_FAILED", b"1", b"x" * 600])


def test_openings_trail_room_meta_and_room_failed_and_old_frames_still_parse() -> None:
    """ROOM_META and ROOM_FAILED carry the opening they belong to as trailing frames (and
    ROOM_FAILED its reply address); frames of an older sender without them still parse, as
    opening 0 (none). ROOM_FAILED_ACK names the opening and the acknowledging listener."""
    meta = RoomMeta(7, 1, 12, 4, opening=2**64 - 1)
    assert meta.to_frames()[5:] == [b"18446744073709551615"]
    assert RoomMeta.from_frames(meta.to_frames()) == meta
    failed = RoomFailed(3, "aborted", 42, "tcp://127.0.0.1:5000")
    assert failed.to_frames() == [b"ROOM_FAILED", b"3", b"aborted", b"42", b"tcp://127.0.0.1:5000"]
    assert RoomFailed.from_frames(failed.to_frames()) == failed
    assert RoomFailed.from_frames([b"ROOM_FAILED", b"3", b"old"]) == RoomFailed(3, "old", 0, "")
    ack = RoomFailedAck(3, 42, "tcp://127.0.0.1:6000")
    assert RoomFailedAck.from_frames(ack.to_frames()) == ack
    with pytest.raises(ValueError, match="needs reply_to"):
        RoomFailed(3, "x", 42).to_frames()


@pytest.mark.parametrize(
    ("cls", "frames", "match"),
    [
        (RoomMeta, [b"ROOM_META", b"7", b"1", b"12", b"4", b"0"], r"frame 5 \('opening'\)"),
        (RoomMeta, [b"ROOM_META", b"7", b"1", b"12", b"4", b"9" * 21], r"\('opening'\)"),
        (RoomFailed, [b"ROOM_FAILED", b"3", b"x", b"42"], r"takes 3 or 5 frames, got 4$"),
        (
            RoomFailed,
            [b"ROOM_FAILED", b"3", b"x", b"18446744073709551616", b"e"],
            r"frame 3 \('opening'\)",
        ),
        (RoomFailed, [b"ROOM_FAILED", b"3", b"x", b"42", b"a b"], r"frame 4 \('reply_to'\)"),
        (RoomFailedAck, [b"ROOM_FAILED_ACK", b"3", b"42"], r"takes 4 frames, got 3$"),
        (RoomFailedAck, [b"ROOM_FAILED_ACK", b"3", b"-1", b"e"], r"frame 2 \('opening'\)"),
    ],
)
def test_malformed_openings_are_rejected(
    cls: type[RoomMeta] | type[RoomFailed] | type[RoomFailedAck], frames: list[bytes], match: str
) -> None:
    """A zero, oversized or non-decimal opening, a half-present trailer, a bad reply address:
    MalformedMessage naming the frame."""
    with pytest.raises(MalformedMessage, match=match):
        cls.from_frames(frames)


def test_fence_messages_round_trip() -> None:
    """ROOM_FENCE and ROOM_FENCED encode to ASCII frames and decode back."""
    fence = RoomFence(9, "decode-0", "tcp://127.0.0.1:5000", "aborted")
    assert fence.to_frames() == [
        b"ROOM_FENCE",
        b"9",
        b"decode-0",
        b"tcp://127.0.0.1:5000",
        b"aborted",
    ]
    assert RoomFence.from_frames(fence.to_frames()) == fence
    fenced = RoomFenced(9, "decode-0", 3)
    assert fenced.to_frames() == [b"ROOM_FENCED", b"9", b"decode-0", b"3"]
    assert RoomFenced.from_frames(fenced.to_frames()) == fenced
    assert len(RoomFence(1, "s", "e", "y" * 900).to_frames()[4]) == 512


def test_liveness_messages_round_trip() -> None:
    """PING and PONG carry one endpoint."""
    assert Ping.from_frames(Ping("tcp://a:1").to_frames()) == Ping("tcp://a:1")
    assert Pong.from_frames([b"PONG", b"tcp://b:2"]) == Pong("tcp://b:2")


@pytest.mark.parametrize(
    ("cls", "frames", "match"),
    [
        (RoomFence, [b"ROOM_FENCE", b"1", b"s", b"e"], r"^ROOM_FENCE: ROOM_FENCE takes 5 frames"),
        (
            RoomFence,
            [b"ROOM_FENCE", b"1", b"", b"e", b"r"],
            r"^ROOM_FENCE frame 2 \('session_id'\)",
        ),
        (
            RoomFence,
            [b"ROOM_FENCE", b"1", b"s", b"a b", b"r"],
            r"^ROOM_FENCE frame 3 \('reply_to'\)",
        ),
        (RoomFence, [b"ROOM_FENCE", b"-1", b"s", b"e", b"r"], r"^ROOM_FENCE frame 1 \('room'\)"),
        (RoomFenced, [b"ROOM_FENCED", b"1", b"s", b"x"], r"^ROOM_FENCED frame 3 \('writer_rank'\)"),
        (Ping, [b"PING", b"x" * 257], r"^PING frame 1 \('reply_to'\)"),
        (Pong, [b"PING", b"e"], r"^frame 0 \('type'\): expected PONG$"),
    ],
)
def test_malformed_peer_messages_are_rejected(
    cls: type[RoomFence | RoomFenced | Ping | Pong], frames: list[object], match: str
) -> None:
    """Bad fence and liveness frames raise MalformedMessage naming the frame."""
    with pytest.raises(MalformedMessage, match=match):
        cls.from_frames(frames)
