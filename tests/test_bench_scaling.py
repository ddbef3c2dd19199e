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
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from staging_contracts._bench import BenchOptions, plots, scaling
from staging_contracts._bench.scaling import (
    CSV_COLUMNS,
    P99_MIN_SAMPLES,
    ScalingPlan,
    ScalingResult,
    ScalingRow,
    fit_line,
    fit_rows,
    high_latency,
    percentile,
    run_scaling,
    slope_stderr,
)
from staging_contracts._cluster._messages import RankSummary
from staging_contracts._cluster.runner import ClusterResult, RankReport
from staging_contracts._run.workload import TransferConfig
from staging_contracts.cli import main
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
    runs: tuple[float, ...] = (),
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
        runs=max(1, len(runs)),
        elapsed_s=elapsed_s,
        elapsed_runs_s=runs,
        staged_gbps=nbytes / elapsed_s / 1e9,
        raw_gbps=2.0,
        latency_samples=concurrency * max(1, len(runs)),
        latency_p50_s=p50,
        latency_high_s=p99,
        latency_high_stat="max",
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
            "latency-high-vs-concurrency",
            "latency-p50-vs-concurrency",
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
    high = fits[("mooncake", "latency-high-vs-concurrency")]
    assert (high.slope, high.intercept) == pytest.approx((0.5, 0.1))
    assert tokens.slope_se == pytest.approx(0.0, abs=1e-12)  # exactly on the line
    head, tail = tokens.describe().split(" +- ")
    assert head == "nixl time-vs-tokens: 0.2"
    se, rest = tail.split(" ", 1)
    assert float(se) == pytest.approx(tokens.slope_se)
    assert rest == "s per 1k tokens, intercept 0.1 s (r2 1.000, 3 points)"


def test_slope_stderr_from_the_residuals() -> None:
    """(0,0), (1,2), (2,1): slope 0.5, residuals -0.5, 1, -0.5: SS_res 1.5, Sxx 2, n-2 = 1,
    so se = sqrt(1.5 / 1 / 2); two samples leave no freedom: nan."""
    assert slope_stderr([0, 1, 2], [0, 2, 1]) == pytest.approx(math.sqrt(0.75))
    assert math.isnan(slope_stderr([0, 1], [0, 2]))


def test_time_vs_tokens_is_fitted_through_every_run() -> None:
    """Each run's time is a sample of the fit: two runs of three token lengths are six
    points, and their spread gives the slope a standard error."""
    rows = [
        _row(tokens=1000, elapsed_s=1.0, runs=(0.9, 1.1)),
        _row(tokens=2000, elapsed_s=2.0, runs=(1.9, 2.1)),
        _row(tokens=3000, elapsed_s=3.0, runs=(2.9, 3.1)),
    ]
    (fit,) = fit_rows(rows)
    xs = [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    ys = [0.9, 1.1, 1.9, 2.1, 2.9, 3.1]
    assert fit.points == 6
    assert (fit.slope, fit.intercept) == pytest.approx((1.0, 0.0))
    assert fit.slope_se == pytest.approx(slope_stderr(xs, ys))
    assert fit.slope_se > 0


def test_high_latency_is_the_max_below_100_samples_and_p99_from_100() -> None:
    """Below P99_MIN_SAMPLES the high figure is the largest sample, labelled max; from
    there on it is the interpolated 99th percentile, labelled p99."""
    few = [0.3, 0.1, 0.9, 0.2]
    assert high_latency(few) == (0.9, "max")
    many = [float(i) for i in range(P99_MIN_SAMPLES)]  # 0 .. 99
    value, stat = high_latency(many)
    assert value == pytest.approx(98.01)
    assert stat == "p99"
    value, stat = high_latency([])
    assert math.isnan(value)
    assert stat == "max"


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
    assert set(data) == {"partial", "interrupted", "plan", "machine", "skipped", "fits", "rows"}
    assert (data["partial"], data["interrupted"]) == (False, None)
    assert data["skipped"] == {"x": "gone"}
    assert data["plan"]["base"]["tokens"] == 256
    assert data["plan"]["tp"] == ["2->1"]
    assert {tuple(sorted(r)) for r in data["rows"]} == {tuple(sorted(CSV_COLUMNS))}
    assert data["rows"][-1]["elapsed_s"] is None
    assert data["plan"]["runs"] == 1
    assert data["rows"][0]["runs"] == 1
    assert data["rows"][0]["latency_samples"] == 1
    assert data["rows"][0]["latency_high_stat"] == "max"
    two_runs = _row(runs=(0.25, 0.5))
    ScalingResult(result.plan, (two_runs,), ()).write(tmp_path / "two")
    with (tmp_path / "two" / "scaling.csv").open() as handle:
        (line,) = list(csv.DictReader(handle))
    assert line["elapsed_runs_s"] == "0.25 0.5"
    assert line["runs"] == "2"
    assert line["latency_samples"] == "2"
    two_data = json.loads((tmp_path / "two" / "scaling.json").read_text())
    assert two_data["rows"][0]["elapsed_runs_s"] == [0.25, 0.5]
    assert data["rows"][-1]["ok"] is False
    assert set(data["fits"][0]) == {
        "engine",
        "name",
        "slope",
        "slope_se",
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
    fit = next(f for f in result.fits if (f.engine, f.name) == ("nixl", "time-vs-tokens"))
    assert f"  {fit.describe()}" in lines
    assert "staged runs per point: 1" in lines[0]
    header = lines[1].split()
    assert "runs" in header
    assert "samples" in header
    assert "p99" not in lines[1]  # the high figure of 1-4 samples is no p99
    assert "0.45 (max of 1)" in lines[3]
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
    stamps = {i: 10.0 + 0.1 * i for i in range(config.requests)}
    done = {i: 10.0 + 0.1 * i + 0.5 + 0.25 * i for i in range(config.requests)}
    prefill = tuple(
        RankReport(
            "prefill",
            p,
            True,
            RankSummary(room_first_request_s=stamps, peak_rss_bytes=100 + p, start=0.0),
            0,
        )
        for p in range(config.prefill_tp)
    )
    decode = tuple(
        RankReport(
            "decode",
            d,
            True,
            RankSummary(
                verified=True,
                room_done_s=done,
                peak_rss_bytes=200 + d,
                ring_peak=1000 * (d + 1),
                ring_size=5000,
            ),
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
    assert two.latency_high_s == pytest.approx(0.75)
    assert two.latency_high_stat == "max"
    assert (two.runs, two.latency_samples) == (1, 2)
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
        "latency-high-vs-concurrency",
    }  # one token length verified: no time-vs-tokens slope


def test_repeated_runs_pool_latencies_and_take_the_median_throughput(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With runs=3 each staged point runs three times and the raw write once; GB/s is the
    median of the runs', latencies are pooled (3 x concurrency samples), the time fit goes
    through every run; a run that fails fails its point, naming the run."""
    calls: dict[tuple[str, int, int], int] = {}

    def fake_run(config: TransferConfig, *, timeout_s: float) -> ClusterResult:
        key = (config.mode, config.tokens, config.requests)
        calls[key] = calls.get(key, 0) + 1
        if config.mode == "raw":
            return _fake_cluster_result(config, 1.0)
        if config.tokens == 512 and calls[key] == 2:  # its second run dies
            return ClusterResult(config, (), 0.0, frozenset({0}))
        return _fake_cluster_result(config, (1.0, 3.0, 2.0)[calls[key] - 1] * config.requests)

    monkeypatch.setattr(scaling, "run_cluster", fake_run)
    monkeypatch.setattr(scaling, "preflight", lambda config: None)
    monkeypatch.setattr(scaling, "engine_available", lambda name: (True, ""))
    plan = replace(ScalingPlan.quick(), runs=3)
    result = run_scaling(BenchOptions(backends=("nixl",)), plan=plan)
    assert calls == {
        ("staged", 256, 1): 3,
        ("raw", 256, 1): 1,
        ("staged", 512, 1): 2,  # stopped at its failed run
        ("raw", 512, 1): 1,
        ("staged", 256, 2): 3,
    }
    rows = {(r.dimension, r.value): r for r in result.rows}
    base = rows[("tokens", 256)]
    nbytes = plan.base.request_bytes
    assert base.runs == 3
    assert base.elapsed_runs_s == (1.0, 3.0, 2.0)
    assert base.elapsed_s == 2.0
    assert base.staged_gbps == pytest.approx(nbytes / 2.0 / 1e9)
    two = rows[("concurrency", 2)]
    # each run: request 0 took 0.5 s, request 1 took 0.75 s; pooled over three runs
    samples = [0.5, 0.75] * 3
    assert two.latency_samples == len(samples) == 6
    assert two.latency_p50_s == pytest.approx(percentile(samples, 50))
    assert (two.latency_high_s, two.latency_high_stat) == (max(samples), "max")
    assert two.high_label() == "max of 6"
    failed = rows[("tokens", 512)]
    assert not failed.ok
    assert failed.error == "run 2: requests [0] failed"
    assert math.isnan(failed.staged_gbps)
    assert failed.latency_samples == 0
    assert "time-vs-tokens" not in {f.name for f in result.fits}  # 512 failed


def test_full_plan_repeats_and_quick_plan_does_not() -> None:
    """The documented sweep runs each staged point twice; quick once; 0 runs is refused."""
    assert ScalingPlan.full().runs == 2
    assert ScalingPlan.quick().runs == 1
    with pytest.raises(ValueError, match="runs"):
        replace(ScalingPlan.quick(), runs=0)


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


def test_every_text_of_every_chart_fits_inside_its_figure() -> None:
    """No title, label, tick label, legend entry or note is cut off at the figure's edge,
    with the full plan's machine note (the longest) and both engines."""
    pytest.importorskip("matplotlib")
    made_up = _made_up_result()
    result = replace(made_up, plan=ScalingPlan.full(), machine={"cpus": 2, "load_before": [9.0]})
    outside: list[str] = []
    for name, figure in plots.drawn_charts(result):
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
        frame = figure.bbox.padded(0.5)  # half a pixel of rounding
        boxes = [("axes", axes.get_tightbbox(renderer)) for axes in figure.axes]  # drawn only
        boxes += [(t.get_text(), t.get_window_extent(renderer)) for t in figure.texts]
        for what, box in boxes:
            if box is None:
                continue
            if box.x0 < frame.x0 or box.x1 > frame.x1 or box.y0 < frame.y0 or box.y1 > frame.y1:
                title = " / ".join(axes.get_title() for axes in figure.axes)
                outside.append(f"{name} ({title!r}): {what} spans {box.extents}, not in {frame}")
    assert outside == []


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (the test is skipped without matplotlib)."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    return pytest.importorskip("matplotlib.pyplot")


def test_a_failed_point_is_a_gap_in_the_lines_not_zero() -> None:
    """The throughput and latency lines hold nan (a gap) at a failed point, never 0."""
    plt = _pyplot()

    rows = [
        _row(tokens=1000, elapsed_s=0.5),
        _row(tokens=2000, elapsed_s=0.5, ok=False),
        _row(tokens=4000, elapsed_s=0.5),
    ]
    figure, axes = plt.subplots()
    try:
        plots._throughput(axes, rows, ["nixl"])
        staged, raw = axes.lines
        assert list(staged.get_xdata()) == [1000, 2000, 4000]
        ys = list(staged.get_ydata())
        assert math.isnan(ys[1])
        assert ys[0] == pytest.approx(rows[0].staged_gbps)
        assert list(raw.get_ydata()) == [2.0, 2.0, 2.0]  # the raw write did verify
    finally:
        plt.close(figure)
    rows = [_row(dimension="concurrency", value=n, concurrency=n, ok=n != 2) for n in (1, 2, 4)]
    figure, axes = plt.subplots()
    try:
        plots._latency(axes, rows, ["nixl"])
        p50, high = axes.lines
        assert math.isnan(list(p50.get_ydata())[1])
        assert math.isnan(list(high.get_ydata())[1])
        assert high.get_label() == "nixl max"
    finally:
        plt.close(figure)


def test_a_failed_or_missing_bar_is_hatched_and_labelled_not_zero() -> None:
    """Bars: a failed point and a value an engine has no row for get a hatched outline
    labelled failed / missing; no 0 GB/s bar is drawn."""
    plt = _pyplot()

    rows = [
        _row("nixl", "tp", "4->2", elapsed_s=0.5),
        _row("nixl", "tp", "2->4", elapsed_s=0.5, ok=False),
        _row("mooncake", "tp", "4->2", elapsed_s=0.25),
    ]
    figure, axes = plt.subplots()
    try:
        plots._tp_bars(axes, rows, ["nixl", "mooncake"])
        filled = [p for p in axes.patches if p.get_fill()]
        assert sorted(p.get_height() for p in filled) == pytest.approx(
            sorted([rows[0].staged_gbps, rows[2].staged_gbps])
        )
        outlined = [p for p in axes.patches if not p.get_fill()]
        assert sorted(p.get_gid() for p in outlined) == ["failed", "missing"]
        assert all(p.get_hatch() == "//" and p.get_height() > 0 for p in outlined)
        texts = sorted(t.get_text() for t in axes.texts)
        assert "failed" in texts
        assert "missing" in texts
        assert all(p.get_height() > 0 for p in axes.patches)
    finally:
        plt.close(figure)


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
        "import staging_contracts._bench.plots as p, staging_contracts._bench.scaling\n"
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
        for key in ("staged_gbps", "raw_gbps", "latency_p50_s", "latency_high_s", "elapsed_s"):
            assert math.isfinite(row[key]), (key, row)
            assert row[key] > 0, (key, row)
        assert (row["runs"], row["latency_samples"]) == (1, row["concurrency"])
        assert row["latency_high_stat"] == "max"
        assert row["elapsed_runs_s"] == [row["elapsed_s"]]
        p50, high = row["latency_p50_s"], row["latency_high_s"]
        if row["concurrency"] == 1:  # one sample: the median and the max are it
            assert high == p50
        else:  # two samples: p50 is their mean, high the larger; the smaller is 2*p50-high
            other = 2 * p50 - high
            assert 0 < other <= high, row
        assert row["peak_ring_bytes"] > 0
        assert row["peak_rss_bytes"] is None or row["peak_rss_bytes"] > 0
    assert rows[1]["bytes"] == 2 * rows[0]["bytes"]
    assert {f["name"] for f in data["fits"]} == {
        "time-vs-tokens",
        "latency-p50-vs-concurrency",
        "latency-high-vs-concurrency",
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
    """--dry-run lists every check and step with its time bound, runs nothing, writes no
    summary; the bound of everything (the CUDA check and engine probes included, each plus
    the 5 s before SIGKILL) is what it prints and stays under 8 minutes."""
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)}
    done = _gpu_check("--dry-run", env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    checks = [line for line in lines if line.startswith("check ")]
    names = [line.split()[1].rstrip(":") for line in steps]
    assert names == [
        "cuda-tests",
        "demo-nixl-cuda",
        "demo-mooncake-cuda",
        "bench-staging-cuda",
        "bench-transfer-cuda",
    ]
    assert [line.split()[1].rstrip(":") for line in checks] == [
        "pick-python",
        "nvidia-smi",
        "cuda-and-versions",
        "probe-nixl",
        "probe-mooncake",
    ]
    assert all("timeout" in line for line in steps)
    assert "-m cuda" in steps[0]
    assert all("--device cuda" in line for line in steps[1:])
    bounds = [int(line.split("timeout ")[1].split("s")[0]) for line in checks + steps]
    total = sum(bounds) + 5 * len(bounds)  # each killed 5 s after its bound
    assert lines[-1].startswith(f"total bound: {total}s ")
    assert total < 8 * 60
    assert list(tmp_path.iterdir()) == []


def _fake_python(folder: Path) -> Path:
    """A 'python' whose torch is a CPU-only build: prints what the CUDA check prints and
    says no device."""
    fake = folder / "fake-python"
    fake.write_text(
        "#!/bin/sh\n"
        "echo 'torch: 9.9.9+cpu'\n"
        "echo 'torch.version.cuda: None'\n"
        "echo 'cuda device: none visible'\n"
        "exit 1\n"
    )
    fake.chmod(0o755)
    return fake


def test_gpu_check_without_cuda_names_torch_and_writes_under_a_relative_out(
    tmp_path: Path,
) -> None:
    """A relative $OUT is taken from the caller's folder (not the repository root the
    script moves to); with no CUDA device the message names torch's version and CUDA
    build, the summary records them, and the exit is 1."""
    env = {"PATH": "/usr/bin:/bin", "OUT": "rel/out", "PYTHON": str(_fake_python(tmp_path))}
    done = subprocess.run(
        ["bash", str(GPU_CHECK)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    assert "no CUDA device visible to torch" in done.stderr
    assert "torch: 9.9.9+cpu; torch.version.cuda: None" in done.stderr
    summary = tmp_path / "rel" / "out" / "gpu-check-summary.txt"
    text = summary.read_text()
    assert "torch: 9.9.9+cpu" in text
    assert "torch.version.cuda: None" in text
    assert not (REPO / "rel").exists()


@pytest.mark.skipif(
    not (REPO / ".venv" / "bin" / "python").exists() or torch.version.cuda is not None,
    reason="needs the repository's venv with a CPU-only torch",
)
def test_gpu_check_leaves_a_cpu_only_venv_for_python3(tmp_path: Path) -> None:
    """Without $PYTHON, a venv whose torch has no CUDA build is not used: the script says
    so and goes on with python3 (which, here, finds no CUDA device either)."""
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)}
    done = _gpu_check(env=env)
    assert done.returncode == 1
    assert "its torch has no CUDA build (or does not import): using python3" in done.stderr
    assert "(python3: torch" in done.stderr
    text = (tmp_path / "gpu-check-summary.txt").read_text()
    assert "python: python3 (" in text


def test_gpu_check_refuses_unknown_arguments() -> None:
    """Anything but --dry-run or --help: exit 2 with the usage."""
    done = _gpu_check("--fast")
    assert done.returncode == 2
    assert "usage: scripts/gpu-check [--dry-run]" in done.stderr
