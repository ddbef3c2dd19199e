"""The per-request and peer control messages: ROOM_META, ROOM_FAILED, fences, liveness."""

from __future__ import annotations

import pytest

from staging_contracts.control.room_messages import (
    Ping,
    Pong,
    RoomFailed,
    RoomFence,
    RoomFenced,
    RoomMeta,
)
from staging_contracts.control.wire import MalformedMessage


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
        ([b"ROOM_META", b"7", b"1", b"12"], r"^ROOM_META: ROOM_META takes 5 frames, got 4$"),
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
