"""``bench scaling``: the sweep, its files, its slopes, its charts and its refusals.

Figures are never asserted (no timed tests): the end-to-end test checks shapes, that every
point verified and that figures are finite and positive; the arithmetic (percentiles, line
fits, GB/s) is checked exactly on made-up data.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from staging_contracts.bench import BenchOptions, plots, scaling
from staging_contracts.bench.scaling import (
    CSV_COLUMNS,
    ScalingPlan,
    ScalingResult,
    ScalingRow,
    fit_line,
    fit_rows,
    percentile,
    run_scaling,
)
from staging_contracts.cli import main
from staging_contracts.cluster.runner import ClusterResult, RankReport
from staging_contracts.cluster.workload import TransferConfig
from staging_contracts.engines import engine_available

REPO = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _row(
    engine: str = "nixl",
    dimension: str = "tokens",
    value: int | str = 1000,
    *,
    tokens: int = 1000,
    concurrency: int = 1,
    elapsed_s: float = 0.5,
    p50: float = 0.4,
    p99: float = 0.45,
    ok: bool = True,
) -> ScalingRow:
    nbytes = tokens * 1000 * concurrency
    return ScalingRow(
        engine=engine,
        dimension=dimension,
        value=value,
        tokens=tokens,
        prefill_tp=4,
        decode_tp=2,
        page_size=16,
        concurrency=concurrency,
        bytes=nbytes,
        elapsed_s=elapsed_s,
        staged_gbps=nbytes / elapsed_s / 1e9,
        raw_gbps=2.0,
        latency_p50_s=p50,
        latency_p99_s=p99,
        peak_ring_bytes=1 << 20,
        peak_rss_bytes=300 << 20,
        ok=ok,
        error="" if ok else "decode 0 killed by SIGKILL without a report",
    )


def _made_up_result() -> ScalingResult:
    """Two engines, every dimension, with exact linear trends."""
    rows: list[ScalingRow] = []
    for engine, extra in (("mooncake", 0.1), ("nixl", 0.0)):
        rows += [
            _row(engine, "tokens", t, tokens=t, elapsed_s=0.1 + extra + 0.2 * t / 1000)
            for t in (1000, 2000, 4000)
        ]
        rows += [
            _row(engine, "tp", pair, tokens=4000, elapsed_s=0.9 + extra)
            for pair in ("4->2", "2->4", "8->2")
        ]
        rows += [
            _row(engine, "page_size", size, tokens=4000, elapsed_s=0.9 + extra) for size in (1, 16)
        ]
        rows += [
            _row(
                engine,
                "concurrency",
                n,
                tokens=4000,
                concurrency=n,
                p50=0.05 + 0.25 * n,
                p99=0.1 + 0.5 * n,
            )
            for n in (1, 2, 4)
        ]
    return ScalingResult(
        ScalingPlan.quick(), tuple(rows), tuple(fit_rows(rows)), {"x": "gone"}, {"cpus": 2}
    )


# ------------------------------------------------------------------------ arithmetic


def test_fit_line_on_points_on_a_line() -> None:
    """Points on y = 2x + 1 give slope 2, intercept 1 and r2 1."""
    assert fit_line([1, 2, 3, 4], [3, 5, 7, 9]) == pytest.approx((2.0, 1.0, 1.0))


def test_fit_line_least_squares_and_r2() -> None:
    """(0,0), (1,2), (2,1): slope 0.5, intercept 0.5, r2 = 1 - 1.5/2 = 0.25."""
    assert fit_line([0, 1, 2], [0, 2, 1]) == pytest.approx((0.5, 0.5, 0.25))


def test_fit_line_flat_series_has_r2_one() -> None:
    """A flat series is explained by its flat line."""
    assert fit_line([1, 2, 3], [4, 4, 4]) == pytest.approx((0.0, 4.0, 1.0))


@pytest.mark.parametrize(
    ("xs", "ys", "match"),
    [([1, 1], [2, 3], "two distinct"), ([1, 2], [1], "y values"), ([], [], "two distinct")],
)
def test_fit_line_refuses_what_defines_no_line(
    xs: list[float], ys: list[float], match: str
) -> None:
    """Fewer than two distinct x values, or mismatched lengths, define no line."""
    with pytest.raises(ValueError, match=match):
        fit_line(xs, ys)


def test_percentile_interpolates_between_ranks() -> None:
    """Linear interpolation between closest ranks (NumPy's default)."""
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match=r"0\.\.100"):
        percentile(values, 101)


def test_fit_rows_gives_each_engines_slopes() -> None:
    """Time vs tokens in s per 1k tokens with its intercept, latency vs concurrency per
    percentile; failed points are left out of the fits."""
    result = _made_up_result()
    rows = [*result.rows, _row("nixl", "tokens", 8000, tokens=8000, elapsed_s=99.0, ok=False)]
    fits = {(f.engine, f.name): f for f in fit_rows(rows)}
    assert sorted(fits) == [
        (engine, name)
        for engine in ("mooncake", "nixl")
        for name in (
            "latency-p50-vs-concurrency",
            "latency-p99-vs-concurrency",
            "time-vs-tokens",
        )
    ]
    tokens = fits[("nixl", "time-vs-tokens")]
    assert (tokens.slope, tokens.intercept, tokens.r2) == pytest.approx((0.2, 0.1, 1.0))
    assert tokens.points == 3
    assert tokens.slope_unit == "s per 1k tokens"
    assert fits[("mooncake", "time-vs-tokens")].intercept == pytest.approx(0.2)
    p50 = fits[("nixl", "latency-p50-vs-concurrency")]
    assert (p50.slope, p50.intercept) == pytest.approx((0.25, 0.05))
    p99 = fits[("mooncake", "latency-p99-vs-concurrency")]
    assert (p99.slope, p99.intercept) == pytest.approx((0.5, 0.1))
    assert tokens.describe() == (
        "nixl time-vs-tokens: 0.2 s per 1k tokens, intercept 0.1 s (r2 1.000, 3 points)"
    )


def test_a_series_of_one_point_gets_no_fit() -> None:
    """One token length (a sweep that failed elsewhere) defines no slope."""
    assert fit_rows([_row(), _row(dimension="concurrency", value=1)]) == []


# ------------------------------------------------------------------------ files


def test_csv_and_json_shapes(tmp_path: Path) -> None:
    """CSV: the documented columns, one line per row; JSON: plan, machine, skipped, fits,
    rows with the same keys (NaN written as null)."""
    result = _made_up_result()
    nan_row = _row(ok=False, elapsed_s=math.nan)
    result = ScalingResult(result.plan, (*result.rows, nan_row), result.fits, result.skipped)
    paths = result.write(tmp_path / "out")
    assert [p.name for p in paths] == ["scaling.json", "scaling.csv"]
    with (tmp_path / "out" / "scaling.csv").open() as handle:
        reader = csv.DictReader(handle)
        assert tuple(reader.fieldnames or ()) == CSV_COLUMNS
        lines = list(reader)
    assert len(lines) == len(result.rows)
    assert lines[0]["engine"] == "mooncake"
    assert lines[0]["dimension"] == "tokens"
    assert float(lines[0]["staged_gbps"]) == pytest.approx(result.rows[0].staged_gbps)
    data = json.loads((tmp_path / "out" / "scaling.json").read_text())
    assert set(data) == {"plan", "machine", "skipped", "fits", "rows"}
    assert data["skipped"] == {"x": "gone"}
    assert data["plan"]["base"]["tokens"] == 256
    assert data["plan"]["tp"] == ["2->1"]
    assert {tuple(sorted(r)) for r in data["rows"]} == {tuple(sorted(CSV_COLUMNS))}
    assert data["rows"][-1]["elapsed_s"] is None
    assert data["rows"][-1]["ok"] is False
    assert set(data["fits"][0]) == {
        "engine",
        "name",
        "slope",
        "intercept",
        "r2",
        "points",
        "slope_unit",
    }


def test_text_gives_the_base_point_the_table_failures_skips_and_slopes() -> None:
    """The printed summary names the base point, every row, failures, skipped engines and
    each slope."""
    result = _made_up_result()
    failed = _row("nixl", "tokens", 8000, tokens=8000, ok=False)
    result = ScalingResult(result.plan, (*result.rows, failed), result.fits, result.skipped)
    text = result.format_text()
    lines = text.splitlines()
    assert lines[0].startswith("base point: 256 tokens, TP 2->1, page size 16, 1 request(s)")
    assert lines[1].split()[:3] == ["engine", "dimension", "value"]
    assert len([line for line in lines if line.startswith(("mooncake ", "nixl "))]) >= len(
        result.rows
    )
    assert "nixl tokens=8000: decode 0 killed by SIGKILL without a report" in lines
    assert "skipped x: gone" in lines
    assert "  nixl time-vs-tokens: 0.2 s per 1k tokens, intercept 0.1 s (r2 1.000, 3 points)" in (
        lines
    )
    assert not result.ok


def test_plans_sweep_one_dimension_at_a_time_around_the_base() -> None:
    """Every point differs from the base in its own dimension only; the full plan is the
    documented one."""
    plan = ScalingPlan.full()
    points = plan.points()
    base = plan.base
    assert (base.tokens, base.prefill_tp, base.decode_tp, base.page_size, base.requests) == (
        4096,
        4,
        2,
        16,
        1,
    )
    assert [p.value for p in points if p.dimension == "tp"] == [
        "1->4",
        "2->4",
        "4->2",
        "8->2",
        "4->1",
    ]
    assert [p.value for p in points if p.dimension == "tokens"] == [
        1024,
        2048,
        4096,
        8192,
        16384,
        32768,
    ]
    assert [p.value for p in points if p.dimension == "page_size"] == [1, 16, 64]
    assert [p.value for p in points if p.dimension == "concurrency"] == [1, 2, 4, 8, 16]
    for point in points:
        changed = {
            name
            for name in ("tokens", "prefill_tp", "decode_tp", "page_size", "requests")
            if getattr(point.config, name) != getattr(base, name)
        }
        allowed = {
            "tokens": {"tokens"},
            "tp": {"prefill_tp", "decode_tp"},
            "page_size": {"page_size"},
            "concurrency": {"requests"},
        }[point.dimension]
        assert changed <= allowed
    assert len({p.config for p in points}) == 16  # the base point once
    assert base.warmup_requests == 1
    with pytest.raises(ValueError, match="at least one value"):
        ScalingPlan(base, (), ((1, 1),), (16,), (1,))


# ------------------------------------------------------------------------ the sweep, faked


def _fake_cluster_result(config: TransferConfig, elapsed: float) -> ClusterResult:
    stamps = {str(i): 10.0 + 0.1 * i for i in range(config.requests)}
    done = {str(i): 10.0 + 0.1 * i + 0.5 + 0.25 * i for i in range(config.requests)}
    prefill = tuple(
        RankReport(
            "prefill",
            p,
            True,
            {"room_first_request_s": stamps, "peak_rss_bytes": 100 + p, "start": 0.0},
            0,
        )
        for p in range(config.prefill_tp)
    )
    decode = tuple(
        RankReport(
            "decode",
            d,
            True,
            {
                "verified": True,
                "room_done_s": done,
                "peak_rss_bytes": 200 + d,
                "ring_peak": 1000 * (d + 1),
                "ring_size": 5000,
            },
            0,
        )
        for d in range(config.decode_tp)
    )
    return ClusterResult(config, decode + prefill, elapsed)


def test_sweep_runs_each_distinct_point_once_and_derives_its_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The base point runs once per engine and is shared by the four series; the raw write
    runs once per TP pair and byte count, through the same cluster in mode raw; GB/s,
    percentiles, ring and RSS peaks come from the runs; a point that fails is a row with its
    reason and the sweep goes on."""
    runs: list[TransferConfig] = []

    def fake_run(config: TransferConfig, *, timeout_s: float) -> ClusterResult:
        runs.append(config)
        if config.mode == "raw":
            return _fake_cluster_result(config, config.request_bytes * config.requests / 4e9)
        if config.tokens == 512:  # this staged point dies
            return ClusterResult(config, (), 0.0, frozenset({0}))
        return _fake_cluster_result(config, 0.5 * config.requests)

    monkeypatch.setattr(scaling, "run_cluster", fake_run)
    monkeypatch.setattr(scaling, "preflight", lambda config: None)
    monkeypatch.setattr(scaling, "engine_available", lambda name: (name == "nixl", "no wheel"))
    said: list[str] = []
    result = run_scaling(BenchOptions(quick=True), progress=said.append)

    assert result.skipped == {"mooncake": "no wheel"}
    assert "bench scaling: skipping mooncake: no wheel" in said
    base = ScalingPlan.quick().base
    assert [(c.mode, c.tokens, c.requests) for c in runs] == [
        ("staged", 256, 1),
        ("raw", 256, 1),
        ("staged", 512, 1),
        ("raw", 512, 1),  # 2 requests of 256 tokens share it: same writers, same bytes
        ("staged", 256, 2),
    ]
    assert all(c.backend == "nixl" and c.warmup_requests == 1 for c in runs)
    assert [(r.dimension, r.value) for r in result.rows] == [
        ("tokens", 256),
        ("tokens", 512),
        ("tp", "2->1"),
        ("page_size", 16),
        ("concurrency", 1),
        ("concurrency", 2),
    ]
    two = result.rows[-1]
    assert two.bytes == 2 * base.request_bytes
    assert two.elapsed_s == pytest.approx(1.0)
    assert two.staged_gbps == pytest.approx(two.bytes / 1.0 / 1e9)
    assert two.raw_gbps == pytest.approx(4.0)
    # latencies: request 0 took 0.5 s, request 1 took 0.75 s
    assert two.latency_p50_s == pytest.approx(0.625)
    assert two.latency_p99_s == pytest.approx(0.5 + 0.25 * 0.99)
    assert two.peak_ring_bytes == 1000
    assert two.peak_rss_bytes == 200
    failed = result.rows[1]
    assert not failed.ok
    assert failed.error == "requests [0] failed"
    assert math.isnan(failed.staged_gbps)
    assert failed.raw_gbps == pytest.approx(4.0)
    assert not result.ok
    assert {f.name for f in result.fits} == {
        "latency-p50-vs-concurrency",
        "latency-p99-vs-concurrency",
    }  # one token length verified: no time-vs-tokens slope


def test_a_failed_raw_write_fails_its_points(monkeypatch: pytest.MonkeyPatch) -> None:
    """The raw write is part of the point: when it does not verify, the row says so."""

    def fake_run(config: TransferConfig, *, timeout_s: float) -> ClusterResult:
        if config.mode == "raw":
            return ClusterResult(config, (), 0.0, frozenset({0}), timed_out=True)
        return _fake_cluster_result(config, 0.5)

    monkeypatch.setattr(scaling, "run_cluster", fake_run)
    monkeypatch.setattr(scaling, "preflight", lambda config: None)
    monkeypatch.setattr(scaling, "engine_available", lambda name: (True, ""))
    result = run_scaling(BenchOptions(quick=True, backends=("mooncake",)))
    assert {(r.ok, r.error) for r in result.rows} == {(False, "raw write: the run timed out")}
    assert all(math.isnan(r.raw_gbps) and r.staged_gbps > 0 for r in result.rows)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (BenchOptions(quick=True, backends=("local",)), "in-tree engines only"),
        pytest.param(
            BenchOptions(quick=True, device="cuda"),
            "no CUDA device here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here"),
        ),
    ],
)
def test_sweep_refuses_what_it_cannot_measure(options: BenchOptions, match: str) -> None:
    """Only the in-tree engines; cuda only with a CUDA device."""
    with pytest.raises(ValueError, match=match):
        run_scaling(options)


# ------------------------------------------------------------------------ charts


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return len(data) > 0 and data.startswith(PNG_SIGNATURE)


def test_plots_are_written_as_png_files(tmp_path: Path) -> None:
    """Each chart is a PNG file; an empty result still gives every chart."""
    pytest.importorskip("matplotlib")
    paths = plots.write_plots(_made_up_result(), tmp_path / "charts")
    assert [p.name for p in paths] == list(plots.CHARTS)
    assert all(_is_png(p) for p in paths)
    empty = ScalingResult(ScalingPlan.quick(), (), ())
    assert all(_is_png(p) for p in plots.write_plots(empty, tmp_path / "empty"))


def test_matplotlib_missing_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without matplotlib the reason names the extra; with it there is none."""
    found = importlib.util.find_spec("matplotlib") is not None
    assert (plots.matplotlib_missing() is None) is found
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert plots.matplotlib_missing() == (
        "matplotlib is not installed (pip install 'staging-contracts[plot]')"
    )


def test_the_package_imports_without_matplotlib() -> None:
    """bench.scaling and bench.plots import in a process where matplotlib cannot."""
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "import staging_contracts.bench.plots as p, staging_contracts.bench.scaling\n"
        "print(p.matplotlib_missing() is None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "matplotlib" not in done.stderr


# ------------------------------------------------------------------------ command line


def _forbid_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sweep(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sweep ran")

    monkeypatch.setattr(scaling, "run_scaling", no_sweep)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["bench", "scaling", "contract"],
            "staging-contracts bench: scaling runs on its own: give it alone, not with other "
            "groups",
        ),
        (
            ["bench", "transfer", "scaling"],
            "staging-contracts bench: scaling runs on its own: give it alone, not with other "
            "groups",
        ),
        (
            ["bench", "scaling", "--json", "x.json"],
            "staging-contracts bench: --json is for row groups; bench scaling writes "
            "scaling.json under --out",
        ),
        (
            ["bench", "contract", "--plot", "charts"],
            "staging-contracts bench: --out and --plot are for bench scaling",
        ),
        (
            ["bench", "--out", "d"],
            "staging-contracts bench: --out and --plot are for bench scaling",
        ),
    ],
)
def test_cli_refusals(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Mixing scaling with row groups or their options is a usage error: exit 2, one line."""
    _forbid_sweep(monkeypatch)
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [message]


def test_cli_refuses_plot_without_matplotlib_before_the_sweep(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--plot without matplotlib: one line naming the extra, exit 2, nothing run."""
    _forbid_sweep(monkeypatch)
    monkeypatch.setattr(plots, "matplotlib_missing", lambda: "matplotlib is not installed")
    assert main(["bench", "scaling", "--quick", "--plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "staging-contracts bench: --plot: matplotlib is not installed"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--backend", "local"],
            "staging-contracts bench: backend 'local': bench scaling runs the in-tree engines "
            "only (mooncake, nixl)",
        ),
        pytest.param(
            ["--device", "cuda"],
            "staging-contracts bench: --device cuda: no CUDA device here "
            "(torch.cuda.is_available() is false)",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here"),
        ),
    ],
)
def test_cli_refuses_backends_and_devices_it_cannot_measure(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Exit 2 and one line, and no file written."""
    assert main(["bench", "scaling", "--quick", "--out", str(tmp_path), *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [message]
    assert list(tmp_path.iterdir()) == []


def test_cli_without_an_engine_says_so_and_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """No engine imports: each is named as skipped, with its reason, and the exit is 1."""
    monkeypatch.setattr(scaling, "engine_available", lambda name: (False, f"no {name} wheel"))
    assert main(["bench", "scaling", "--quick", "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "skipped mooncake: no mooncake wheel" in captured.out.splitlines()
    assert "skipped nixl: no nixl wheel" in captured.out.splitlines()
    assert captured.err.splitlines()[-1] == "staging-contracts bench: no engine could be run"
    assert json.loads((tmp_path / "scaling.json").read_text())["rows"] == []


def _first_engine() -> str | None:
    return next((name for name in ("mooncake", "nixl") if engine_available(name)[0]), None)


@pytest.mark.timeout(400)
def test_quick_sweep_end_to_end_over_a_real_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench scaling --quick over one real engine: every point verified, files written,
    figures finite and positive, slopes printed (not timed: no figure is compared)."""
    engine = _first_engine()
    if engine is None:
        pytest.skip("neither the Mooncake nor the NIXL engine imports here")
    argv = ["bench", "scaling", "--quick", "--backend", engine, "--out", str(tmp_path)]
    status = main(argv)
    out = capsys.readouterr().out
    assert status == 0, out
    data = json.loads((tmp_path / "scaling.json").read_text())
    rows = data["rows"]
    assert [(r["dimension"], r["value"]) for r in rows] == [
        ("tokens", 256),
        ("tokens", 512),
        ("tp", "2->1"),
        ("page_size", 16),
        ("concurrency", 1),
        ("concurrency", 2),
    ]
    for row in rows:
        assert row["ok"] is True, row
        assert row["engine"] == engine
        for key in ("staged_gbps", "raw_gbps", "latency_p50_s", "latency_p99_s", "elapsed_s"):
            assert math.isfinite(row[key]), (key, row)
            assert row[key] > 0, (key, row)
        assert row["latency_p99_s"] >= row["latency_p50_s"]
        assert row["peak_ring_bytes"] > 0
        assert row["peak_rss_bytes"] is None or row["peak_rss_bytes"] > 0
    assert rows[1]["bytes"] == 2 * rows[0]["bytes"]
    assert {f["name"] for f in data["fits"]} == {
        "time-vs-tokens",
        "latency-p50-vs-concurrency",
        "latency-p99-vs-concurrency",
    }
    assert f"{engine} time-vs-tokens:" in out
    with (tmp_path / "scaling.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == len(rows)


# ------------------------------------------------------------------------ scripts/gpu-check

GPU_CHECK = REPO / "scripts" / "gpu-check"


def _gpu_check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(GPU_CHECK), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
        cwd=REPO,
    )


def test_gpu_check_parses_and_is_executable() -> None:
    """The script is executable and bash parses it."""
    assert GPU_CHECK.stat().st_mode & 0o111
    done = subprocess.run(
        ["bash", "-n", str(GPU_CHECK)], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr


def test_gpu_check_dry_run_lists_its_steps(tmp_path: Path) -> None:
    """--dry-run lists every step with its time bound and command, runs nothing, writes no
    summary."""
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)}
    done = _gpu_check("--dry-run", env=env)
    assert done.returncode == 0, done.stderr
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    names = [line.split()[1].rstrip(":") for line in steps]
    assert names == [
        "cuda-tests",
        "demo-nixl-cuda",
        "demo-mooncake-cuda",
        "bench-staging-cuda",
        "bench-transfer-cuda",
    ]
    assert all("timeout" in line for line in steps)
    assert "-m cuda" in steps[0]
    assert all("--device cuda" in line for line in steps[1:])
    bounds = [int(line.split("timeout ")[1].split("s,")[0]) for line in steps]
    assert sum(bounds) + 5 * len(bounds) < 8 * 60  # each killed 5 s after its bound
    assert list(tmp_path.iterdir()) == []


def test_gpu_check_refuses_unknown_arguments() -> None:
    """Anything but --dry-run or --help: exit 2 with the usage."""
    done = _gpu_check("--fast")
    assert done.returncode == 2
    assert "usage: scripts/gpu-check [--dry-run]" in done.stderr
