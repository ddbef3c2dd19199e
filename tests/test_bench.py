"""The bench command: rows, table and JSON (figures are not asserted: no timed tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from staging_contracts.bench import BenchOptions, BenchRow, format_table
from staging_contracts.cli import main
from staging_contracts.cluster.workload import TransferConfig


def test_bench_contract_writes_json_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench contract prints a table and writes the documented JSON keys, the warm and the
    cold instance checks with notes."""
    out_path = tmp_path / "rows.json"
    assert main(["bench", "contract", "--quick", "--json", str(out_path)]) == 0
    rows = json.loads(out_path.read_text())
    assert [r["name"] for r in rows] == [
        "contract.per-call",
        "contract.instance-check",
        "contract.instance-check.cold",
        "contract.class-check",
    ]
    for row in rows:
        assert set(row) == {"name", "ours", "anchor", "unit", "ratio", "goal", "note"}
        assert row["ours"] > 0
        assert row["anchor"] > 0
    assert [r["goal"] for r in rows] == ["<= 1.02", "<= 0.3", "<= 1.0", ""]
    assert [bool(r["note"]) for r in rows] == [False, True, True, False]
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
    """An unknown group name is a usage error: exit 2, one line naming the groups."""
    assert main(["bench", "no-such-group"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "staging-contracts bench: unknown group 'no-such-group': choose from contract, "
        "staging, control, transfer"
    ]


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


def test_notes_are_marked_and_printed_as_footnotes() -> None:
    """A row's note is printed under the table, numbered, with the mark after its name."""
    rows = [
        BenchRow("a", 1.0, 1.0, "u", 1.0, "", "four writers on both sides"),
        BenchRow("b", 1.0, 1.0, "u", 1.0, ""),
        BenchRow("c", 1.0, 1.0, "u", 1.0, "", "warmed up"),
    ]
    lines = format_table(rows).splitlines()
    assert [line.split()[0:2] for line in lines[2:5]] == [["a", "[1]"], ["b", "1"], ["c", "[2]"]]
    assert lines[5:] == ["[1] four writers on both sides", "[2] warmed up"]


def test_transfer_group_builds_its_rows_from_the_three_measurements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each engine gets a vs-raw and a vs-per-token row: the staged, raw and per-token runs
    share the processes, request and warm-up (only the mode differs, and the per-token
    tokens over Mooncake); ratios are staged / anchor GB/s; notes state the terms."""
    from staging_contracts.bench import transfer_bench
    from staging_contracts.cluster.runner import ClusterResult, RankReport

    seen: list[TransferConfig] = []
    elapsed = {"staged": 0.5, "raw": 0.125, "per-token": 5.0}

    def fake_cluster(config: TransferConfig) -> ClusterResult:
        seen.append(config)
        share = config.request_bytes // config.prefill_tp
        prefill = tuple(
            RankReport("prefill", p, True, {"bytes_written": share, "peak_rss_bytes": 3 << 20}, 0)
            for p in range(config.prefill_tp)
        )
        return ClusterResult(config, prefill, elapsed[config.mode])

    monkeypatch.setattr(ClusterResult, "verified", property(lambda self: True))
    monkeypatch.setattr(transfer_bench, "engine_available", lambda name: (True, ""))
    monkeypatch.setattr(transfer_bench, "run_cluster", fake_cluster)
    rows = {row.name: row for row in transfer_bench.run(BenchOptions())}
    assert sorted(rows) == [
        "transfer.mooncake.vs-per-token",
        "transfer.mooncake.vs-raw",
        "transfer.nixl.vs-per-token",
        "transfer.nixl.vs-raw",
    ]
    config = transfer_bench.staged_config("nixl")
    assert config.request_bytes == 32 * 2 * 4096 * 8 * 128 * 2
    staged = config.request_bytes / 0.5 / 1e9
    raw = rows["transfer.nixl.vs-raw"]
    assert raw.ours == pytest.approx(staged)
    assert raw.anchor == pytest.approx(config.request_bytes / 0.125 / 1e9)
    assert raw.ratio == pytest.approx(0.25)
    assert rows["transfer.nixl.vs-per-token"].ratio == pytest.approx(10.0)
    # Mooncake's per-token run sends fewer tokens with the same writers: compared in GB/s.
    moon = rows["transfer.mooncake.vs-per-token"]
    assert moon.anchor == pytest.approx(config.request_bytes / 8 / 5.0 / 1e9)
    assert "fewer tokens, same writers: compared in GB/s" in moon.note
    assert "fewer tokens" not in rows["transfer.nixl.vs-per-token"].note
    for row in rows.values():
        assert "4 writer -> 2 receiver processes, 1 warm-up request first" in row.note
        assert "peak RSS <= 3 MiB" in row.note
    # Same processes, request and warm-up in every run; three repeats of each mode.
    assert {(c.prefill_tp, c.decode_tp, c.layers, c.warmup_requests) for c in seen} == {
        (4, 2, 32, 1)
    }
    modes = [(c.backend, c.mode, c.tokens) for c in seen]
    for backend in ("mooncake", "nixl"):
        assert modes.count((backend, "staged", 4096)) == 3
        assert modes.count((backend, "raw", 4096)) == 3
    assert modes.count(("nixl", "per-token", 4096)) == 3
    assert modes.count(("mooncake", "per-token", 512)) == 3


def test_bench_control_measures_plain_and_curve_rates(tmp_path: Path) -> None:
    """bench control gives the plain row against the echo anchor and the CURVE row against
    the plain rate of the same run, with finite positive figures (not timed)."""
    out_path = tmp_path / "rows.json"
    assert main(["bench", "control", "--quick", "--json", str(out_path)]) == 0
    rows = json.loads(out_path.read_text())
    assert [r["name"] for r in rows] == [
        "control.staging-req-rate",
        "control.staging-req-rate.curve",
    ]
    assert [r["goal"] for r in rows] == [">= 0.5", ">= 0.8"]
    assert rows[1]["anchor"] == rows[0]["ours"]
    for row in rows:
        assert row["ours"] > 0
        assert 0 < row["ratio"] < 100
