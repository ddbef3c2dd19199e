"""The transfer bench group against the real engines, in its quick mode: the rows' shape and
notes, and finite positive figures (no timing assertions: figures are for people)."""

from __future__ import annotations

import math

import pytest

from staging_contracts.bench import BenchOptions, transfer_bench
from staging_contracts.engines import engine_available

AVAILABLE = [name for name in transfer_bench.ENGINES if engine_available(name)[0]]


@pytest.mark.skipif(
    not AVAILABLE,
    reason="no transfer engine imports here: "
    + "; ".join(f"{n}: {engine_available(n)[1]}" for n in transfer_bench.ENGINES),
)
def test_quick_transfer_group_measures_ours_and_both_anchors_on_every_engine() -> None:
    """Every importable engine gets its two rows, measured through the rank processes in one
    round; quick rows have no goal; each note states both sides' processes, warm-up, bytes,
    tokens and what each role's ranks held at the done barrier."""
    rows = transfer_bench.run(BenchOptions(quick=True))
    assert [row.name for row in rows] == [
        f"transfer.{engine}.{name}" for engine in AVAILABLE for name in ("vs-raw", "vs-per-token")
    ]
    for row in rows:
        assert row.unit == "GB/s"
        assert row.goal == ""
        for value in (row.ours, row.anchor, row.ratio):
            assert math.isfinite(value)
            assert value > 0
        assert row.ratio == pytest.approx(row.ours / row.anchor)
        anchor = "raw" if row.name.endswith("vs-raw") else "per-token"
        assert row.note.startswith(
            "quick: smoke only; both: 4 writer -> 2 receiver processes, 1 warm-up request"
            " first, 1 round; ratio per round "
        )
        assert "staged: 8 MiB (512 tokens x 4 layers), peak RSS to done: prefill <= " in row.note
        assert "ring reserved peak" in row.note
        assert f"; {anchor}: 8 MiB (512 tokens x 4 layers), peak RSS to done: prefill <= " in (
            row.note
        )
