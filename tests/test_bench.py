"""The bench command: rows, table and JSON (figures are not asserted: no timed tests)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from staging_contracts._bench import BenchOptions, BenchRow, format_table
from staging_contracts._cluster._messages import RankMemory, RankSummary
from staging_contracts._cluster.runner import ClusterResult, RankReport
from staging_contracts._run.workload import TransferConfig
from staging_contracts.cli import main


def test_bench_contract_writes_json_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench contract prints a table and writes the documented JSON keys, the warm and the
    cold instance checks with notes; quick rows have no goal."""
    out_path = tmp_path / "rows.json"
    assert main(["bench", "contract", "--quick", "--json", str(out_path)]) == 0
    rows = json.loads(out_path.read_text())
    assert [r["name"] for r in rows] == [
        "contract.per-call",
        "contract.member-read",
        "contract.member-assign",
        "contract.member-assign.unwatched",
        "contract.instance-check",
        "contract.instance-check.cold",
        "contract.class-check",
    ]
    for row in rows:
        assert set(row) == {"name", "ours", "anchor", "unit", "ratio", "goal", "note"}
        assert row["ours"] > 0
        assert row["anchor"] > 0
    # quick: a smoke test, no goal; every note says so first
    assert [r["goal"] for r in rows] == [""] * 7
    assert [r["note"].startswith("quick: smoke only") for r in rows] == [True] * 7
    bare = [True, False, False, False, False, False, True]
    assert [r["note"] == "quick: smoke only" for r in rows] == bare
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


def _fake_cluster(
    seen: list[TransferConfig], elapsed: Callable[[TransferConfig, int], float]
) -> Callable[[TransferConfig], ClusterResult]:
    """A stand-in for run_cluster: every prefill rank writes its share of the request in
    ``elapsed(config, run number)`` seconds; ranks report their memory at the done barrier
    (prefill 3 MiB, decode 5 MiB; on CUDA 7 MiB on the GPU) and decode its ring."""

    def fake(config: TransferConfig) -> ClusterResult:
        seen.append(config)
        share = config.request_bytes // config.prefill_tp
        cuda = 7 << 20 if config.device == "cuda" else None
        # on CUDA the stand-in ranks could not reset their peak: it counts from their start
        since = "process start" if config.device == "cuda" else "timed requests"
        prefill = tuple(
            RankReport(
                "prefill",
                p,
                True,
                RankSummary(bytes_written=share, memory=RankMemory(3 << 20, since, None, cuda)),
                0,
            )
            for p in range(config.prefill_tp)
        )
        staged = config.mode == "staged"
        ring = (256 << 20, 128 << 20) if staged else (None, None)
        held = RankMemory(5 << 20, since, None, cuda)
        decode = tuple(
            RankReport(
                "decode", d, True, RankSummary(memory=held, ring_peak=ring[0], ring_size=ring[1]), 0
            )
            for d in range(config.decode_tp)
        )
        return ClusterResult(config, prefill + decode, elapsed(config, len(seen)))

    return fake


@pytest.fixture
def verified(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fake run verifies; every engine imports and passes preflight."""
    from staging_contracts._bench import transfer_bench

    monkeypatch.setattr(ClusterResult, "verified", property(lambda self: True))
    monkeypatch.setattr(transfer_bench, "engine_available", lambda name: (True, ""))
    monkeypatch.setattr(transfer_bench, "preflight", lambda config: None)


FIXED = {"staged": 0.5, "raw": 0.125, "per-token": 5.0}


@pytest.mark.usefixtures("verified")
def test_transfer_group_builds_its_rows_from_the_three_measurements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each engine gets a vs-raw and a vs-per-token row: the staged, raw and per-token runs
    share the processes, request and warm-up (only the mode differs, and the per-token
    tokens over Mooncake); ratios are staged / anchor GB/s; notes state the terms and what
    each role's ranks held at the done barrier."""
    from staging_contracts._bench import transfer_bench

    seen: list[TransferConfig] = []
    fake = _fake_cluster(seen, lambda config, number: FIXED[config.mode])
    monkeypatch.setattr(transfer_bench, "run_cluster", fake)
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
    assert raw.goal == ">= 0.5"
    assert rows["transfer.nixl.vs-per-token"].ratio == pytest.approx(10.0)
    assert rows["transfer.nixl.vs-per-token"].goal == ">= 8"
    # Mooncake's per-token run sends fewer tokens with the same writers: compared in GB/s.
    moon = rows["transfer.mooncake.vs-per-token"]
    assert moon.anchor == pytest.approx(config.request_bytes / 8 / 5.0 / 1e9)
    assert "fewer tokens, same writers: compared in GB/s" in moon.note
    assert "fewer tokens" not in rows["transfer.nixl.vs-per-token"].note
    for row in rows.values():
        assert row.note.startswith(
            "both: 4 writer -> 2 receiver processes, 1 warm-up request first, 5 rounds, the"
            " modes in turns (order reversed every other round); ratio per round "
        )
        assert "inconclusive" not in row.note
        assert (
            "staged: 512 MiB (4096 tokens x 32 layers), peak RSS to done: prefill <= 3,"
            " decode <= 5 MiB, ring reserved peak 256 of 128 MiB (next-round regions reserved"
            " ahead, never more in use);" in row.note
        )
        assert "CUDA" not in row.note
        assert "quick" not in row.note
    # Same processes, request and warm-up in every run; five rounds of each mode.
    assert {(c.prefill_tp, c.decode_tp, c.layers, c.warmup_requests) for c in seen} == {
        (4, 2, 32, 1)
    }
    modes = [(c.backend, c.mode, c.tokens) for c in seen]
    for backend in ("mooncake", "nixl"):
        assert modes.count((backend, "staged", 4096)) == 5
        assert modes.count((backend, "raw", 4096)) == 5
    assert modes.count(("nixl", "per-token", 4096)) == 5
    assert modes.count(("mooncake", "per-token", 512)) == 5


@pytest.mark.usefixtures("verified")
def test_transfer_modes_alternate_within_each_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every round runs each mode once, the order reversed every other round: no mode
    always runs first, and no block of one mode's runs."""
    from staging_contracts._bench import transfer_bench

    seen: list[TransferConfig] = []
    fake = _fake_cluster(seen, lambda config, number: FIXED[config.mode])
    monkeypatch.setattr(transfer_bench, "run_cluster", fake)
    transfer_bench.run(BenchOptions(backends=("nixl",)))
    forward = ["staged", "raw", "per-token"]
    assert [c.mode for c in seen] == [*forward, *forward[::-1]] * 2 + forward


@pytest.mark.usefixtures("verified")
def test_a_spread_that_straddles_the_goal_is_inconclusive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rounds whose ratios fall on both sides of the goal: the note gives the lowest and
    highest ratio per round and says inconclusive; the goal itself is kept."""
    from staging_contracts._bench import transfer_bench

    seen: list[TransferConfig] = []

    def elapsed(config: TransferConfig, number: int) -> float:
        if config.mode == "staged":  # rounds 1, 3, 5 fast (ratio 1.0), 2, 4 slow (0.25)
            return 0.125 if (number - 1) // 3 % 2 == 0 else 0.5
        return FIXED[config.mode]

    monkeypatch.setattr(transfer_bench, "run_cluster", _fake_cluster(seen, elapsed))
    rows = {row.name: row for row in transfer_bench.run(BenchOptions(backends=("nixl",)))}
    raw = rows["transfer.nixl.vs-raw"]
    assert raw.goal == ">= 0.5"
    assert "ratio per round 0.25 to 1 (5 rounds): inconclusive against >= 0.5;" in raw.note
    per_token = rows["transfer.nixl.vs-per-token"]  # 10 to 40: every round meets >= 8
    assert "ratio per round 10 to 40 (5 rounds);" in per_token.note


def test_spread_note_verdicts() -> None:
    """Inconclusive only when some rounds meet the goal and others do not."""
    assert transfer_bench_spread([0.4, 0.6], ">= 0.5") == (
        "ratio per round 0.4 to 0.6 (2 rounds): inconclusive against >= 0.5"
    )
    assert transfer_bench_spread([0.6, 0.7], ">= 0.5") == "ratio per round 0.6 to 0.7 (2 rounds)"
    assert transfer_bench_spread([0.3, 0.4], ">= 0.5") == "ratio per round 0.3 to 0.4 (2 rounds)"
    assert transfer_bench_spread([0.4, 0.6], "") == "ratio per round 0.4 to 0.6 (2 rounds)"


def transfer_bench_spread(ratios: list[float], goal: str) -> str:
    from staging_contracts._bench.transfer_bench import spread_note

    return spread_note(ratios, goal)


@pytest.mark.usefixtures("verified")
def test_quick_transfer_rows_have_no_goal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quick mode is a smoke test: one round, no goal, and the note says so first."""
    from staging_contracts._bench import transfer_bench

    seen: list[TransferConfig] = []
    fake = _fake_cluster(seen, lambda config, number: FIXED[config.mode])
    monkeypatch.setattr(transfer_bench, "run_cluster", fake)
    rows = transfer_bench.run(BenchOptions(quick=True, backends=("nixl",)))
    assert [row.goal for row in rows] == ["", ""]
    assert [row.goal_met for row in rows] == [None, None]
    for row in rows:
        assert row.note.startswith("quick: smoke only; both: 4 writer -> 2 receiver processes")
        assert "1 round; ratio per round" in row.note
        assert "inconclusive" not in row.note
    assert len(seen) == 3


@pytest.mark.usefixtures("verified")
def test_on_cuda_the_note_says_the_transfers_are_within_one_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--device cuda: every rank uses the same GPU, and each role's CUDA peak is given."""
    from staging_contracts._bench import transfer_bench

    seen: list[TransferConfig] = []
    fake = _fake_cluster(seen, lambda config, number: FIXED[config.mode])
    monkeypatch.setattr(transfer_bench, "run_cluster", fake)
    rows = transfer_bench.run(BenchOptions(device="cuda", backends=("nixl",)))
    assert {c.device for c in seen} == {"cuda"}
    for row in rows:
        assert (
            "decode <= 5 MiB (since the process started), CUDA peak allocated: prefill <= 7,"
            " decode <= 7 MiB" in row.note
        )
        assert row.note.endswith(
            "; CUDA: every rank on its current device, the same GPU: transfers within one"
            " GPU, not across GPUs"
        )


@pytest.mark.usefixtures("verified")
def test_an_engine_that_fails_is_marked_failed_and_the_others_are_measured(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Mooncake's raw run does not verify: its two rows say FAILED and why (no figures, no
    goal), the error is logged, and NIXL's rows are measured as usual."""
    from staging_contracts._bench import transfer_bench

    seen: list[TransferConfig] = []
    fake = _fake_cluster(seen, lambda config, number: FIXED[config.mode])
    bad = ClusterResult(transfer_bench.staged_config("mooncake"), (), 0.0)

    def flaky(config: TransferConfig) -> ClusterResult:
        if config.backend == "mooncake" and config.mode == "raw":
            return replace(bad, timed_out=True)
        return fake(config)

    monkeypatch.setattr(ClusterResult, "verified", property(lambda self: not self.timed_out))
    monkeypatch.setattr(transfer_bench, "run_cluster", flaky)
    with caplog.at_level("ERROR", logger=transfer_bench.__name__):
        rows = {row.name: row for row in transfer_bench.run(BenchOptions())}
    assert sorted(rows) == [
        "transfer.mooncake.vs-per-token",
        "transfer.mooncake.vs-raw",
        "transfer.nixl.vs-per-token",
        "transfer.nixl.vs-raw",
    ]
    for name in ("transfer.mooncake.vs-raw", "transfer.mooncake.vs-per-token"):
        row = rows[name]
        assert (row.ours, row.anchor, row.ratio, row.goal) == (0.0, 0.0, 0.0, "")
        assert row.note.startswith("FAILED: RunFailed: raw transfer did not verify (timed out)")
    assert rows["transfer.nixl.vs-raw"].ratio == pytest.approx(0.25)
    assert "mooncake failed, its rows are marked failed" in caplog.text


@pytest.mark.usefixtures("verified")
def test_an_engine_that_cannot_run_on_the_device_is_skipped_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """preflight refuses Mooncake on CUDA: it gets no rows and the reason is logged; NIXL
    is measured."""
    from staging_contracts._bench import transfer_bench

    def refuse(config: TransferConfig) -> None:
        if config.backend == "mooncake":
            raise ValueError("--backend mooncake --device cuda: built without CUDA")

    seen: list[TransferConfig] = []
    fake = _fake_cluster(seen, lambda config, number: FIXED[config.mode])
    monkeypatch.setattr(transfer_bench, "preflight", refuse)
    monkeypatch.setattr(transfer_bench, "run_cluster", fake)
    with caplog.at_level("WARNING", logger=transfer_bench.__name__):
        rows = transfer_bench.run(BenchOptions(device="cuda"))
    assert [row.name for row in rows] == ["transfer.nixl.vs-raw", "transfer.nixl.vs-per-token"]
    assert {c.backend for c in seen} == {"nixl"}
    assert "skipping mooncake (--backend mooncake --device cuda: built without CUDA)" in (
        caplog.text
    )


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
    assert [r["goal"] for r in rows] == ["", ""]  # quick: a smoke test, no goal
    assert [r["note"] for r in rows] == ["quick: smoke only"] * 2
    assert rows[1]["anchor"] == rows[0]["ours"]
    for row in rows:
        assert row["ours"] > 0
        assert 0 < row["ratio"] < 100
