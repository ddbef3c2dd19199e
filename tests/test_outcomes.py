"""Typed outcomes: every reason group the soak report knows maps to its FailureReason."""

from __future__ import annotations

import pytest

from staging_contracts._cluster.soak_report import reason_group
from staging_contracts.outcomes import (
    FailureReason,
    Outcome,
    RoomFailure,
    TransferRecord,
    classify,
)

# Messages as the library writes them today (decode handler, prefill writer, liveness).
MESSAGES = [
    ("decode failed the room: prefill writer rank 0 at tcp://x is dead", FailureReason.PEER_DEAD),
    ("no progress for 3.0s", FailureReason.STALLED),
    ("prefill rank 1 never sent ROOM_META", FailureReason.NO_ROOM_META),
    ("room never became writable before the deadline", FailureReason.TIMEOUT),
    ("engine write failed: peer unreachable", FailureReason.ENGINE_ERROR),
    ("registration refused: ring full", FailureReason.REFUSED),
    ("room released before it finished", FailureReason.RELEASED_EARLY),
    ("rank error: boom", FailureReason.RANK_ERROR),
    ("decode fenced the room", FailureReason.FENCED),
    ("integrity check failed on chunk 2", FailureReason.INTEGRITY),
    ("no STAGING_REQ for 5.0s", FailureReason.ROOM_BOUND),
    ("refused: manager draining", FailureReason.DRAINING),
    ("something new", FailureReason.OTHER),
]


@pytest.mark.parametrize(("detail", "expected"), MESSAGES)
def test_classify_maps_each_message_to_its_reason(detail: str, expected: FailureReason) -> None:
    assert classify(detail) is expected
    failure = RoomFailure.from_detail(detail)
    assert failure.reason is expected
    assert failure.detail == detail


@pytest.mark.parametrize(("detail", "expected"), MESSAGES)
def test_reason_values_agree_with_the_soak_groups(detail: str, expected: FailureReason) -> None:
    # The soak groups by the same enum: its summary and the metrics name a reason alike.
    assert reason_group(detail) == expected.value


def test_transfer_record_latency_and_sglang_names() -> None:
    failure = RoomFailure.from_detail("no progress for 1s")
    record = TransferRecord(7, 4096, 3, 10.0, 10.5, 1e9, 1e9 + 0.5, Outcome.FAILED, failure)
    assert record.latency_s == pytest.approx(0.5)
    assert record.transfer_latency_s == record.latency_s
    assert record.transfer_total_bytes == 4096
    assert record.reason is FailureReason.STALLED
    assert f"{FailureReason.STALLED}" == "stalled"  # str-valued: readable in messages, labels
