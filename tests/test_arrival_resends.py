"""Issue 24, finding 6 on prefill: a lost ``CHUNK_READY`` is sent again until decode's
watermark shows its region consumed, the copies are bounded, and a room opened again, closed
(for a region shared with other writers) or fenced by decode sends no more copies (see
``staging_contracts._prefill.arrival_resends``)."""

from __future__ import annotations

from collections.abc import Sequence

from staging_contracts._control.wire import ChunkReady
from staging_contracts._prefill.arrival_resends import ArrivalResends
from staging_contracts._prefill.books import WatermarkTracker
from staging_contracts.protocols import Watermark

D0 = "tcp://127.0.0.1:7000"
SESSION = "decode-0"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Sent:
    def __init__(self) -> None:
        self.sent: list[tuple[str, list[bytes]]] = []

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool:
        self.sent.append((endpoint, list(frames)))
        return True


def arrival(room: int = 1, chunk: int = 0, epoch: int | None = 3) -> ChunkReady:
    return ChunkReady(room, chunk, chunk * 2, 2, SESSION, 0, epoch, None)


def box(copies: int = 4) -> tuple[ArrivalResends, WatermarkTracker, Sent, Clock]:
    marks, sent, clock = WatermarkTracker(), Sent(), Clock()
    return ArrivalResends(marks, sent, clock, 0.5, copies), marks, sent, clock


def test_a_chunk_ready_goes_again_each_interval_until_the_watermark_passes_its_region() -> None:
    resends, marks, sent, clock = box()
    message = arrival()
    resends.add(message, D0, offset=4096, sole_writer=True)
    assert resends.flush() == 0  # not due yet: the first copy went with the write
    clock.now += 0.5
    assert resends.flush() == 1
    assert sent.sent == [(D0, message.to_frames())]
    marks.observe(SESSION, Watermark(3, 4096))  # the region itself is the oldest live one
    clock.now += 0.5
    assert resends.flush() == 1
    marks.observe(SESSION, Watermark(3, 8192))  # past it: freed, so consumed
    clock.now += 0.5
    assert resends.flush() == 0
    assert len(resends) == 0
    assert resends.sent == 2


def test_copies_are_bounded() -> None:
    resends, _, sent, clock = box(copies=3)
    resends.add(arrival(), D0, offset=0, sole_writer=True)
    for _ in range(10):
        clock.now += 0.5
        resends.flush()
    assert len(sent.sent) == 3
    assert len(resends) == 0


def test_a_room_opened_again_sends_no_copy_of_its_earlier_opening() -> None:
    resends, _, sent, clock = box()
    resends.add(arrival(room=1), D0, offset=0, sole_writer=True)
    resends.add(arrival(room=2), D0, offset=1024, sole_writer=True)
    resends.cancel_room(1)
    clock.now += 0.5
    resends.flush()
    assert [ChunkReady.from_frames(f).room for _, f in sent.sent] == [2]


def test_an_arrival_without_an_epoch_is_not_sent_again() -> None:
    """No epoch, no region to tell a late copy by: sent once, as before."""
    resends, _, sent, clock = box()
    resends.add(arrival(epoch=None), D0, offset=0, sole_writer=True)
    clock.now += 0.5
    assert resends.flush() == 0
    assert sent.sent == []


def test_closing_the_room_stops_only_the_copies_of_shared_regions() -> None:
    """A sole writer's copies outlive the room's close on prefill (ordering keeps them ahead
    of any later opening's request); a shared region's stop there."""
    resends, _, sent, clock = box()
    resends.add(arrival(room=1, chunk=0), D0, offset=0, sole_writer=True)
    resends.add(arrival(room=1, chunk=1), D0, offset=1024, sole_writer=False)
    resends.close_room(1)
    clock.now += 0.5
    resends.flush()
    assert [ChunkReady.from_frames(f).chunk_idx for _, f in sent.sent] == [0]


def test_a_fence_from_the_decode_session_stops_its_copies() -> None:
    resends, _, sent, clock = box()
    resends.add(arrival(room=1), D0, offset=0, sole_writer=True)
    resends.add(arrival(room=2), D0, offset=1024, sole_writer=True)
    resends.cancel_session(1, "another-session")
    resends.cancel_session(1, SESSION)
    clock.now += 0.5
    resends.flush()
    assert [ChunkReady.from_frames(f).room for _, f in sent.sent] == [2]
