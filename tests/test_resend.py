"""ResendBox: copies go every interval until spent, acknowledged or cancelled; bounded."""

from __future__ import annotations

from staging_contracts.control.resend import ResendBox


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_copies_go_every_interval_until_spent_acknowledged_or_cancelled() -> None:
    clock = Clock()
    box = ResendBox(clock, interval_s=1.0, capacity=3)
    box.add(1, "a", [b"ROOM_FAILED", b"1"], copies=2)
    box.add(1, "b", [b"ROOM_META", b"1"], copies=-1)
    box.add(2, "b", [b"ROOM_META", b"2"], copies=-1)
    assert box.take_due() == []
    clock.now = 1.0
    assert len(box.take_due()) == 3
    box.ack(1, "b", b"ROOM_META")
    clock.now = 2.0
    assert box.take_due() == [("a", [b"ROOM_FAILED", b"1"]), ("b", [b"ROOM_META", b"2"])]
    clock.now = 3.0
    assert box.take_due() == [("b", [b"ROOM_META", b"2"])]  # room 1's copies are spent
    box.cancel_room(2)
    assert len(box) == 0
    for room in range(5):
        box.add(room, "a", [b"ROOM_META"], copies=-1)
    assert len(box) == 3  # the oldest went
