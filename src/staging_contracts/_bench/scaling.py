"""``bench scaling``: how the staged transfer's throughput and latency grow, per engine.

Not a row group of :data:`~staging_contracts._bench.GROUPS`: its result is a table of points
and fitted slopes, run on its own as ``staging-contracts bench scaling``. It sweeps one
dimension at a time around a base point (:meth:`ScalingPlan.full`; the docs' benchmarks page
lists the values and the measured figures); every point is real
:func:`~staging_contracts._cluster.runner.run_cluster` runs, each rank its own process, every
decode page verified. The base point is measured once per engine and shared by the four
dimensions' series.

A point is :attr:`ScalingPlan.runs` staged runs: its throughput is the median of theirs, its
latencies (per request, from the first ``STAGING_REQ`` to the last decode rank's success) are
pooled over them. The raw write of the same bytes by the same rank processes
(``mode="raw"``), the ceiling the staged path is measured against, is run once per TP pair and
byte count. Least-squares lines (:func:`fit_line`, with :func:`slope_stderr`) give transfer
time against tokens and latency against concurrency, per engine.

``BenchOptions.quick`` runs tiny points for smoke tests (figures meaningless);
``BenchOptions.device`` places every rank's pools, buffers and ring (``"cuda"`` needs a GPU).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Final

import torch

from .._cluster.preflight import preflight
from .._cluster.runner import ClusterResult, run_cluster
from .._run import Interrupted
from .._run.workload import Device, TransferConfig
from ..engines import engine_available
from . import ENGINES, BenchOptions, aligned

logger = logging.getLogger(__name__)

P99_MIN_SAMPLES: Final = 100
"""Fewest latency samples a point needs before its high figure is called a p99; with fewer
it is the maximum (:func:`high_latency`)."""

PointValue = int | str
"""The value of a point on its dimension: an int, or ``"P->D"`` for a TP pair."""


@dataclass(frozen=True, slots=True)
class ScalingPoint:
    """One planned point: where it sits and the run that measures it (any engine)."""

    dimension: str
    """``tokens``, ``tp``, ``page_size`` or ``concurrency``."""
    value: PointValue
    config: TransferConfig
    """The run, with the base point's engine (replaced per engine)."""


_FULL_BASE: Final = TransferConfig(
    prefill_tp=4,
    decode_tp=2,
    kv_heads=8,
    layers=8,
    head_dim=128,
    tokens=4096,
    page_size=16,
    requests=1,
    dtype="bf16",
    chunk_tokens=1024,
    ring_chunks=2,
    warmup_requests=1,
)
"""The sweep's base point: P=4 -> D=2, 8 KV heads of 128, 8 layers, bf16, 4096 tokens."""


@dataclass(frozen=True, slots=True)
class ScalingPlan:
    """The base point and the values swept around it.

    Raises:
        ValueError: an empty sweep, a value below 1, or a repeat count below 1.
    """

    base: TransferConfig
    """The base point; its ``requests`` is the base concurrency."""
    tokens: tuple[int, ...]
    tp_pairs: tuple[tuple[int, int], ...]
    """``(prefill_tp, decode_tp)`` pairs."""
    page_sizes: tuple[int, ...]
    concurrency: tuple[int, ...]
    """Requests staged at once (all issued together, through the same rings)."""
    run_timeout_s: float = 300.0
    """Bound on each cluster run."""
    runs: int = 1
    """Staged runs per point (throughput: their median; latencies: pooled)."""

    def __post_init__(self) -> None:
        sweeps = (self.tokens, self.tp_pairs, self.page_sizes, self.concurrency)
        if not all(sweeps):
            raise ValueError("every dimension needs at least one value")
        flat = [*self.tokens, *self.page_sizes, *self.concurrency]
        flat += [n for pair in self.tp_pairs for n in pair]
        if min(flat) < 1 or self.run_timeout_s <= 0 or self.runs < 1:
            raise ValueError("sizes, TP sizes, runs and the timeout must be positive")

    @classmethod
    def full(cls) -> ScalingPlan:
        """The documented sweep, each staged point run twice."""
        return cls(
            base=_FULL_BASE,
            tokens=(1024, 2048, 4096, 8192, 16384, 32768),
            tp_pairs=((1, 4), (2, 4), (4, 2), (8, 2), (4, 1)),
            page_sizes=(1, 16, 64),
            concurrency=(1, 2, 4, 8, 16),
            runs=2,
        )

    @classmethod
    def quick(cls) -> ScalingPlan:
        """Tiny points for smoke tests, each run once: five runs per engine."""
        return cls(
            base=replace(
                _FULL_BASE,
                prefill_tp=2,
                decode_tp=1,
                layers=2,
                head_dim=64,
                tokens=256,
                chunk_tokens=128,
            ),
            tokens=(256, 512),
            tp_pairs=((2, 1),),
            page_sizes=(16,),
            concurrency=(1, 2),
            run_timeout_s=120.0,
        )

    def points(self) -> list[ScalingPoint]:
        """Every point, dimension by dimension (the base point once in each)."""
        base = self.base
        points = [ScalingPoint("tokens", n, replace(base, tokens=n)) for n in self.tokens]
        points += [
            ScalingPoint("tp", f"{p}->{d}", replace(base, prefill_tp=p, decode_tp=d))
            for p, d in self.tp_pairs
        ]
        points += [
            ScalingPoint("page_size", n, replace(base, page_size=n)) for n in self.page_sizes
        ]
        points += [
            ScalingPoint("concurrency", n, replace(base, requests=n)) for n in self.concurrency
        ]
        return points

    def describe(self) -> dict[str, Any]:
        """The plan as JSON-ready values: the base point's geometry and each sweep."""
        base = self.base
        return {
            "base": {
                "tokens": base.tokens,
                "prefill_tp": base.prefill_tp,
                "decode_tp": base.decode_tp,
                "page_size": base.page_size,
                "concurrency": base.requests,
                "layers": base.layers,
                "kv_heads": base.kv_heads,
                "head_dim": base.head_dim,
                "dtype": base.dtype,
                "chunk_tokens": base.chunk_tokens,
                "ring_chunks": base.ring_chunks,
                "warmup_requests": base.warmup_requests,
                "device": base.device,
            },
            "tokens": list(self.tokens),
            "tp": [f"{p}->{d}" for p, d in self.tp_pairs],
            "page_size": list(self.page_sizes),
            "concurrency": list(self.concurrency),
            "runs": self.runs,
            "raw": "mode='raw', the point's rank processes, once per TP pair and byte count",
        }


@dataclass(frozen=True, slots=True)
class ScalingRow:
    """One measured point of one engine (a CSV line; the base point is in each dimension)."""

    engine: str
    dimension: str
    value: PointValue
    tokens: int
    prefill_tp: int
    decode_tp: int
    page_size: int
    concurrency: int
    bytes: int
    """KV bytes of every timed request of the point (what both the staged run and the raw
    write move)."""
    runs: int
    elapsed_s: float
    """The median of the staged runs' transfer phases (``nan`` when a run failed)."""
    elapsed_runs_s: tuple[float, ...]
    """Each staged run's transfer phase, in run order (empty when a run failed)."""
    staged_gbps: float
    """The median over the runs of ``bytes`` / the run's transfer phase."""
    raw_gbps: float
    """The engine's raw write of ``bytes`` by the same TP pair of processes (``nan`` when it
    could not be measured)."""
    latency_samples: int
    """Per-request latencies pooled over the runs (``runs`` x ``concurrency`` when it
    verified)."""
    latency_p50_s: float
    latency_high_s: float
    latency_high_stat: str
    """What ``latency_high_s`` is: ``"p99"`` or ``"max"`` (:func:`high_latency`)."""
    peak_ring_bytes: int
    """Largest peak use of a decode rank's staging ring."""
    peak_rss_bytes: int | None
    """Largest peak RSS of a rank process (``None``: the ranks did not report it)."""
    ok: bool = True
    error: str = ""
    """Why the point failed (empty when it verified)."""

    def high_label(self) -> str:
        """``p99``, or ``max of K`` when the high figure is the maximum of K samples."""
        if self.latency_high_stat == "p99":
            return "p99"
        return f"max of {self.latency_samples}"


CSV_COLUMNS: Final = tuple(f.name for f in fields(ScalingRow))
"""Columns of the CSV file, in order: the fields of :class:`ScalingRow` (``elapsed_runs_s``
as the runs' seconds joined by spaces)."""


@dataclass(frozen=True, slots=True)
class Fit:
    """A least-squares line ``y = slope * x + intercept`` over one engine's series."""

    engine: str
    name: str
    """``time-vs-tokens``, ``latency-p50-vs-concurrency`` or
    ``latency-high-vs-concurrency``."""
    slope: float
    slope_se: float
    """Standard error of ``slope`` (:func:`slope_stderr`; ``nan`` with two samples)."""
    intercept: float
    r2: float
    """Coefficient of determination (1.0: the points lie on the line)."""
    points: int
    """Samples the line was fitted through (every run's time for ``time-vs-tokens``)."""
    slope_unit: str
    """e.g. ``s per 1k tokens``."""

    def describe(self) -> str:
        """One line: ``ENGINE NAME: SLOPE +- SE UNIT, intercept I s (r2 R, N points)``."""
        return (
            f"{self.engine} {self.name}: {self.slope:.4g} +- {_num(self.slope_se, '.2g')} "
            f"{self.slope_unit}, intercept {self.intercept:.4g} s (r2 {self.r2:.3f}, "
            f"{self.points} points)"
        )


@dataclass(frozen=True, slots=True)
class ScalingResult:
    """Everything one sweep found."""

    plan: ScalingPlan
    rows: tuple[ScalingRow, ...]
    fits: tuple[Fit, ...]
    skipped: dict[str, str] = field(default_factory=dict)
    """Engine -> why it was not run (it does not import)."""
    machine: dict[str, Any] = field(default_factory=dict)
    """CPU count and load averages before and after the sweep."""
    interrupted: str | None = None
    """The stop signal that ended the sweep early (``"SIGTERM"``), or ``None``; the rows are
    then the points measured before it."""

    @property
    def ok(self) -> bool:
        """At least one engine ran, every point verified, and the sweep was not stopped."""
        return bool(self.rows) and all(row.ok for row in self.rows) and not self.interrupted

    def as_json(self) -> dict[str, Any]:
        """The result as JSON-ready values (``nan`` as ``null``)."""
        return {
            "partial": self.interrupted is not None,
            "interrupted": self.interrupted,
            "plan": self.plan.describe(),
            "machine": self.machine,
            "skipped": self.skipped,
            "fits": [_no_nan(asdict(fit)) for fit in self.fits],
            "rows": [_no_nan(asdict(row)) for row in self.rows],
        }

    def write(self, directory: str | Path) -> list[Path]:
        """Write ``scaling.json`` and ``scaling.csv`` into ``directory`` (made if missing);
        returns their paths."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        json_path = folder / "scaling.json"
        json_path.write_text(json.dumps(self.as_json(), indent=2) + "\n")
        csv_path = folder / "scaling.csv"
        with csv_path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            for row in self.rows:
                line = asdict(row)
                line["elapsed_runs_s"] = " ".join(repr(s) for s in row.elapsed_runs_s)
                writer.writerow(line)
        return [json_path, csv_path]

    def format_text(self) -> str:
        """The points as an aligned table, then the skipped engines and the fitted slopes."""
        columns: tuple[tuple[str, Callable[[ScalingRow], str]], ...] = (
            ("engine", lambda row: row.engine),
            ("dimension", lambda row: row.dimension),
            ("value", lambda row: str(row.value)),
            ("MiB", lambda row: f"{row.bytes / 2**20:.1f}"),
            ("runs", lambda row: str(row.runs)),
            ("staged GB/s", lambda row: _num(row.staged_gbps)),
            ("raw GB/s", lambda row: _num(row.raw_gbps)),
            ("samples", lambda row: str(row.latency_samples)),
            ("p50 s", lambda row: _num(row.latency_p50_s)),
            ("high s", lambda row: f"{_num(row.latency_high_s)} ({row.high_label()})"),
            ("ring MiB", lambda row: f"{row.peak_ring_bytes / 2**20:.1f}"),
            ("RSS MiB", lambda row: _mib(row.peak_rss_bytes)),
            ("ok", lambda row: "yes" if row.ok else "NO"),
        )
        table = [[name for name, _ in columns]]
        table += [[cell(row) for _, cell in columns] for row in self.rows]
        base = self.plan.describe()["base"]
        lines = [
            "base point: {tokens} tokens, TP {prefill_tp}->{decode_tp}, page size {page_size}, "
            "{concurrency} request(s) at once; {layers} layers, {kv_heads} KV heads of "
            "{head_dim}, {dtype}, chunks of {chunk_tokens} tokens, ring of {ring_chunks} "
            "chunks; staged runs per point: {runs} (GB/s: their median; latency samples "
            "pooled); high = p99 from {p99} samples, else the max".format(
                **base, runs=self.plan.runs, p99=P99_MIN_SAMPLES
            ),
            *aligned(table),
        ]
        lines.extend(
            f"{row.engine} {row.dimension}={row.value}: {row.error}"
            for row in self.rows
            if not row.ok
        )
        lines.extend(f"skipped {engine}: {why}" for engine, why in self.skipped.items())
        lines.append("how the cost grows (least squares, slope +- its standard error):")
        lines.extend(f"  {fit.describe()}" for fit in self.fits)
        if not self.fits:
            lines.append("  (no series with two points to fit)")
        if self.interrupted is not None:
            lines.append(
                f"PARTIAL: interrupted by {self.interrupted}: the points measured before it"
            )
        return "\n".join(lines)


def _num(value: float, spec: str = ".4g") -> str:
    return "-" if math.isnan(value) else format(value, spec)


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.0f}"


def _no_nan(values: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN: ``nan`` becomes ``None``."""
    return {
        key: None if isinstance(value, float) and math.isnan(value) else value
        for key, value in values.items()
    }


def high_latency(samples: Sequence[float]) -> tuple[float, str]:
    """The high latency figure of a point and what it is: ``(p99, "p99")`` with at least
    :data:`P99_MIN_SAMPLES` samples, else ``(max, "max")`` (a p99 of fewer samples is an
    interpolation towards the maximum, not a 99th percentile); ``(nan, "max")`` for none."""
    if len(samples) >= P99_MIN_SAMPLES:
        return percentile(samples, 99), "p99"
    return (max(samples) if samples else math.nan), "max"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation between the
    closest ranks (NumPy's default); ``nan`` for no values.

    Raises:
        ValueError: ``q`` outside 0..100.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q={q!r} must lie in 0..100")
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float, float]:
    """``(slope, intercept, r2, slope standard error)``: see :func:`fit_line`."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values but {len(ys)} y values")
    if len(set(xs)) < 2:
        raise ValueError("a line needs at least two distinct x values")
    n = len(xs)
    mean_x = sum(xs) / n
    mean_y = sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    ss_tot = sum((y - mean_y) ** 2 for y in ys)
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys, strict=True))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    se = math.sqrt(ss_res / (n - 2) / sxx) if n > 2 else math.nan
    return slope, intercept, r2, se


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares line through ``(xs, ys)``: ``(slope, intercept, r2)``.

    ``r2`` is 1.0 when every ``y`` is the same (the line explains all there is).

    Raises:
        ValueError: different lengths, or fewer than two distinct ``x``.
    """
    slope, intercept, r2, _ = _least_squares(xs, ys)
    return slope, intercept, r2


def slope_stderr(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Standard error of the least-squares slope through ``(xs, ys)``:
    ``sqrt(SS_res / (n - 2) / Sxx)``; ``nan`` with two samples (no residual freedom).

    Raises:
        ValueError: as :func:`fit_line`.
    """
    return _least_squares(xs, ys)[3]


def fit_rows(rows: Iterable[ScalingRow]) -> list[Fit]:
    """The slopes of each engine's series: transfer time against thousands of tokens (every
    run's time: ``elapsed_runs_s``, else ``elapsed_s``), and latency p50 and high figure
    against concurrency (points that failed are left out; a series with fewer than two
    distinct values gets no fit)."""
    rows = [row for row in rows if row.ok]
    fits: list[Fit] = []
    for engine in dict.fromkeys(row.engine for row in rows):
        mine = [row for row in rows if row.engine == engine]
        concurrent = [r for r in mine if r.dimension == "concurrency"]
        series: list[tuple[str, str, list[tuple[float, float]]]] = [
            (
                "time-vs-tokens",
                "s per 1k tokens",
                [
                    (r.tokens / 1000, t)
                    for r in mine
                    if r.dimension == "tokens"
                    for t in (r.elapsed_runs_s or (r.elapsed_s,))
                ],
            ),
            (
                "latency-p50-vs-concurrency",
                "s per concurrent request",
                [(r.concurrency, r.latency_p50_s) for r in concurrent],
            ),
            (
                "latency-high-vs-concurrency",
                "s per concurrent request",
                [(r.concurrency, r.latency_high_s) for r in concurrent],
            ),
        ]
        for name, unit, measured in series:
            pairs = [(x, y) for x, y in measured if not math.isnan(y)]
            if len({x for x, _ in pairs}) < 2:
                continue
            slope, intercept, r2, se = _least_squares([x for x, _ in pairs], [y for _, y in pairs])
            fits.append(Fit(engine, name, slope, se, intercept, r2, len(pairs), unit))
    return fits


def run_scaling(
    options: BenchOptions,
    *,
    plan: ScalingPlan | None = None,
    progress: Callable[[str], None] | None = None,
) -> ScalingResult:
    """Run the sweep for every engine of ``options.backends`` (default :data:`ENGINES`) that
    imports; an engine that does not is skipped, with the reason, in the result.

    Args:
        options: ``quick`` picks :meth:`ScalingPlan.quick` (unless ``plan`` is given);
            ``backends`` restricts the engines.
        plan: the sweep (default: :meth:`ScalingPlan.full` or :meth:`ScalingPlan.quick`).
        progress: called with one line before each measurement.

    **Blocking:** every point's cluster runs (staged, and raw where its TP pair and bytes
    are new), ``plan.runs`` staged runs a point, each bounded by ``plan.run_timeout_s``.
    Under :func:`~staging_contracts._run.stop_on_signals` (raising), a stop signal ends the
    sweep: the point being measured is dropped (its ranks are killed as the
    :class:`~staging_contracts._run.Interrupted` unwinds the run), the rows before it are
    returned, with :attr:`ScalingResult.interrupted` set.

    Raises:
        ValueError: a backend that is not one of :data:`ENGINES`, or ``device="cuda"``
            without a CUDA device.
    """
    chosen = (
        plan if plan is not None else (ScalingPlan.quick() if options.quick else ScalingPlan.full())
    )
    if options.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here (torch.cuda.is_available() is false)")
    device: Device = "cuda" if options.device == "cuda" else "cpu"
    chosen = replace(chosen, base=replace(chosen.base, device=device))
    engines = options.backends if options.backends is not None else ENGINES
    unknown = [name for name in engines if name not in ENGINES]
    if unknown:
        raise ValueError(
            f"backend {unknown[0]!r}: bench scaling runs the in-tree engines only "
            f"({', '.join(ENGINES)})"
        )
    say = progress if progress is not None else logger.info
    machine: dict[str, Any] = {"cpus": os.cpu_count(), "load_before": _load()}
    rows: list[ScalingRow] = []
    skipped: dict[str, str] = {}
    interrupted = None
    try:
        for engine in dict.fromkeys(engines):
            available, reason = engine_available(engine)
            if not available:
                skipped[engine] = reason
                say(f"bench scaling: skipping {engine}: {reason}")
                continue
            _sweep(engine, chosen, say, rows)
    except Interrupted as stop:  # a driver under stop_on_signals: keep what was measured
        interrupted = str(stop)
    machine["load_after"] = _load()
    return ScalingResult(chosen, tuple(rows), tuple(fit_rows(rows)), skipped, machine, interrupted)


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not every platform has load averages
        return []


@dataclass(frozen=True, slots=True)
class _Measured:
    """What one cluster run of a point gave."""

    elapsed_s: float = math.nan
    latencies: tuple[float, ...] = ()
    peak_ring_bytes: int = 0
    peak_rss_bytes: int | None = None
    error: str = ""


def _sweep(
    engine: str, plan: ScalingPlan, say: Callable[[str], None], rows: list[ScalingRow]
) -> None:
    """Every point of one engine, each row added to ``rows`` as soon as it is measured: each
    distinct staged run ``plan.runs`` times (stopping at its first failure), the raw write
    once per TP pair and byte count (the first point with them is run in ``mode="raw"``)."""
    points = plan.points()
    configs = [replace(point.config, backend=engine) for point in points]
    runs: dict[TransferConfig, list[_Measured]] = {}
    raw: dict[tuple[int, int, int], _Measured] = {}
    total = len(set(configs)) * plan.runs + len({_raw_key(config) for config in configs})
    done = 0
    for point, config in zip(points, configs, strict=True):
        nbytes = _timed_bytes(config)
        where = f"{engine} {point.dimension}={point.value}"
        if config not in runs:
            runs[config] = []
            for run in range(plan.runs):
                done += 1
                say(
                    f"bench scaling: {where}, run {run + 1}/{plan.runs} "
                    f"({done}/{total}, {nbytes / 2**20:.0f} MiB)"
                )
                runs[config].append(_measure(config, plan))
                if runs[config][-1].error:
                    break
        key = _raw_key(config)
        if key not in raw:
            done += 1
            say(f"bench scaling: {where}, raw write ({done}/{total})")
            raw[key] = _measure(replace(config, mode="raw"), plan)
        rows.append(_row(engine, point, config, runs[config], raw[key]))


def _row(
    engine: str,
    point: ScalingPoint,
    config: TransferConfig,
    found: list[_Measured],
    anchor: _Measured,
) -> ScalingRow:
    """A point's row from its staged runs (a failed run fails it) and its raw write."""
    nbytes = _timed_bytes(config)
    errors = [
        f"run {i + 1}: {m.error}" if len(found) > 1 else m.error
        for i, m in enumerate(found)
        if m.error
    ]
    errors += [f"raw write: {anchor.error}"] if anchor.error else []
    good = [] if any(m.error for m in found) else found
    samples = [latency for m in good for latency in m.latencies]
    high, stat = high_latency(samples)
    rss = [m.peak_rss_bytes for m in found if m.peak_rss_bytes is not None]
    return ScalingRow(
        engine=engine,
        dimension=point.dimension,
        value=point.value,
        tokens=config.tokens,
        prefill_tp=config.prefill_tp,
        decode_tp=config.decode_tp,
        page_size=config.page_size,
        concurrency=config.requests,
        bytes=nbytes,
        runs=len(found),
        elapsed_s=percentile([m.elapsed_s for m in good], 50),
        elapsed_runs_s=tuple(m.elapsed_s for m in good),
        staged_gbps=percentile([_gbps(nbytes, m.elapsed_s) for m in good], 50),
        raw_gbps=_gbps(nbytes, anchor.elapsed_s),
        latency_samples=len(samples),
        latency_p50_s=percentile(samples, 50),
        latency_high_s=high,
        latency_high_stat=stat,
        peak_ring_bytes=max((m.peak_ring_bytes for m in found), default=0),
        peak_rss_bytes=max(rss) if rss else None,
        ok=not errors,
        error="; ".join(errors),
    )


def _timed_bytes(config: TransferConfig) -> int:
    """KV bytes of every timed request of a run (what the staged run and the raw write move)."""
    return config.request_bytes * config.requests


def _raw_key(config: TransferConfig) -> tuple[int, int, int]:
    """What the raw write depends on: the writers, the receivers and the bytes."""
    return config.prefill_tp, config.decode_tp, _timed_bytes(config)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan


def _measure(config: TransferConfig, plan: ScalingPlan) -> _Measured:
    """One cluster run (staged or raw); a run that cannot start or does not verify is an
    error of its point, and the sweep goes on."""
    try:
        preflight(config)
    except ValueError as exc:
        return _Measured(error=f"refused before starting: {exc}")
    result = run_cluster(config, timeout_s=plan.run_timeout_s)
    if not result.verified:
        return _Measured(error=_failure(result))
    latencies = result.request_latencies_s()
    missing = len(latencies) != config.requests and config.mode == "staged"
    rss = [*result.peak_rss_bytes("prefill").values(), *result.peak_rss_bytes("decode").values()]
    rings = [peak for peak, _ in result.ring_peaks().values()]
    return _Measured(
        elapsed_s=result.elapsed_s,
        latencies=tuple(latencies.values()),
        peak_ring_bytes=max(rings, default=0),
        peak_rss_bytes=max(rss) if rss else None,
        error="some requests have no latency" if missing else "",
    )


def _failure(result: ClusterResult) -> str:
    """Why a run did not verify, in one line."""
    if result.timed_out:
        return "the run timed out"
    if result.first_death is not None:
        death = result.first_death
        return f"{death.role} {death.rank} {death.reason}"
    if result.failed_requests:
        return f"requests {sorted(result.failed_requests)} failed"
    return "the decode pages did not verify"
