"""The per-request control messages: ROOM_META and ROOM_FAILED."""

from __future__ import annotations

import pytest

from staging_contracts.control.room_messages import RoomFailed, RoomMeta
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
