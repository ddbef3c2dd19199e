"""ResendBox: copies go every interval until spent, acknowledged or cancelled; bounded."""

from __future__ import annotations

from staging_contracts._control.resend import ResendBox


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


def test_backoff_doubles_the_wait_up_to_its_cap_and_acks_by_tag_or_endpoint() -> None:
    """ROOM_FAILED's box: 0.5 s, 1 s, 2 s, then 2 s (the cap); ``ack_tag`` stops a message to
    every endpoint, ``cancel_endpoint`` everything to a dead peer."""
    clock = Clock()
    box = ResendBox(clock, interval_s=0.5, backoff=2.0, max_interval_s=2.0)
    box.add(1, "a", [b"ROOM_FAILED", b"1"], copies=-1, tag=7)
    due: list[float] = []
    while clock.now < 8.0:
        clock.now = round(clock.now + 0.25, 2)
        if box.take_due():
            due.append(clock.now)
    assert due == [0.5, 1.5, 3.5, 5.5, 7.5]
    box.add(2, "a", [b"ROOM_FAILED", b"2"], copies=-1, tag=8)
    box.add(2, "b", [b"ROOM_FAILED", b"2"], copies=-1, tag=8)
    box.add(2, "b", [b"ROOM_FAILED", b"2"], copies=-1, tag=9)
    box.ack_tag(2, b"ROOM_FAILED", 8)
    assert sorted(k[1:] for k in set(box.keys()) if k[0] == 2) == [("b", b"ROOM_FAILED", 9)]
    box.cancel_endpoint("b")
    assert [k[0] for k in set(box.keys())] == [1]
