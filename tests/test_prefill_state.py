"""Prefill-side books: monotonic watermarks per session and announced regions."""

from __future__ import annotations

import threading
import time

from staging_contracts import RegionAnswer, Watermark
from staging_contracts._prefill.books import RegionAnswerTable, WatermarkTracker


def test_watermarks_only_move_forward() -> None:
    """An older watermark never replaces a newer one (lexicographic order)."""
    book = WatermarkTracker()
    assert book.latest("s") == Watermark(0, 0)
    assert book.observe("s", Watermark(1, 10))
    assert not book.observe("s", Watermark(1, 5))
    assert not book.observe("s", Watermark(0, 100))
    assert book.observe("s", Watermark(2, 0))
    assert book.latest("s") == Watermark(2, 0)
    assert book.latest("other") == Watermark(0, 0)


def test_readiness_follows_the_rule_of_the_spec() -> None:
    """Round 0 is always ready; round r needs round r-1 freed up to the region's end."""
    book = WatermarkTracker()
    assert book.is_ready("s", 0, 10_000)
    assert not book.is_ready("s", 1, 10)
    book.observe("s", Watermark(0, 10))
    assert book.is_ready("s", 1, 10)
    assert not book.is_ready("s", 1, 11)
    book.observe("s", Watermark(1, 0))
    assert book.is_ready("s", 1, 11)
    assert not book.is_ready("s", 2, 1)


def test_wait_ready_wakes_on_observe_and_times_out_otherwise() -> None:
    """A waiter is woken by a watermark that makes its region ready; others time out."""
    book = WatermarkTracker()
    start = time.monotonic()
    assert not book.wait_ready("s", 1, 5, timeout=0.05)
    assert time.monotonic() - start >= 0.05
    timer = threading.Timer(0.02, book.observe, args=("s", Watermark(0, 5)))
    timer.start()
    assert book.wait_ready("s", 1, 5, timeout=5.0)
    timer.join()


def test_region_table_records_waits_and_forgets() -> None:
    """Answers are keyed by (room, chunk, session); waiters wake; rooms can be forgotten."""
    table = RegionAnswerTable()
    assert table.wait(1, 0, "s", timeout=0.01) is None
    answer = RegionAnswer(0, 0, 64)
    timer = threading.Timer(0.02, table.record, args=(1, 0, "s", answer))
    timer.start()
    assert table.wait(1, 0, "s", timeout=5.0) == answer
    timer.join()
    table.record(1, 1, "s", RegionAnswer(-2, 0, -1))
    refused = table.get(1, 1, "s")
    assert refused is not None
    assert refused.refused
    table.record(2, 0, "s", answer)
    table.forget_room(1)
    assert len(table) == 1
    table.discard(2, 0, "s")
    assert table.get(2, 0, "s") is None
