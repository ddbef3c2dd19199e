"""The bench command: rows, table and JSON (figures are not asserted: no timed tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from staging_contracts.bench import BenchRow, format_table
from staging_contracts.cli import main


def test_bench_contract_writes_json_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench contract prints a table and writes the documented JSON keys."""
    out_path = tmp_path / "rows.json"
    assert main(["bench", "contract", "--quick", "--json", str(out_path)]) == 0
    rows = json.loads(out_path.read_text())
    assert [r["name"] for r in rows] == [
        "contract.per-call",
        "contract.instance-check",
        "contract.class-check",
    ]
    for row in rows:
        assert set(row) == {"name", "ours", "anchor", "unit", "ratio", "goal"}
        assert row["ours"] > 0
        assert row["anchor"] > 0
    assert [r["goal"] for r in rows] == ["<= 1.02", "<= 0.3", ""]
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == [
        "name",
        "ours",
        "anchor",
        "unit",
        "ratio",
        "goal",
        "met",
    ]


def test_bench_rejects_unknown_group(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown group name is a usage error."""
    with pytest.raises(SystemExit) as info:
        main(["bench", "no-such-group"])
    assert info.value.code == 2
    assert "invalid choice: 'no-such-group'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("goal", "ratio", "met"),
    [("<= 1.02", 1.01, True), ("<= 1.02", 1.03, False), (">= 0.5", 0.6, True), ("", 3.0, None)],
)
def test_goal_met(goal: str, ratio: float, met: bool | None) -> None:
    """goal_met compares the ratio with the goal's bound."""
    row = BenchRow("x", 1.0, 1.0, "u", ratio, goal)
    assert row.goal_met is met
    last_column = format_table([row]).splitlines()[2].split()[-1]
    assert last_column == {True: "yes", False: "NO", None: "-"}[met]
