"""PNG charts of a :class:`~staging_contracts._bench.scaling.ScalingResult` (matplotlib).

matplotlib is an optional extra (``pip install 'staging-contracts[plot]'``); it is imported
only inside :func:`write_plots`, with the non-interactive Agg backend, so the package works
without it. :func:`matplotlib_missing` says, before a long sweep starts, whether it is there.

Four charts (:data:`CHARTS`): staged GB/s against request length with the engine's raw
write of the same bytes as a dashed line, per-request latency p50 and high figure against
concurrency, and staged GB/s per TP pair and per page size as grouped bars; one colour per
engine. A point that failed is never drawn as a figure: lines leave a gap at it, and bars put
a hatched outline labelled ``failed`` (or ``missing``, for a value the engine has no row for)
where its bar would be.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from .scaling import ScalingResult, ScalingRow

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

CHARTS: Final = (
    "scaling-throughput.png",
    "scaling-latency.png",
    "scaling-tp.png",
    "scaling-page-size.png",
)
"""The files :func:`write_plots` writes, in order."""

DPI: Final = 100
"""Resolution of the charts (small files: the README shows one)."""

FIGSIZE: Final = (7.0, 4.2)
"""Size of each chart in inches: every title and label must fit inside it."""

_COLOURS: Final = {"mooncake": "tab:blue", "nixl": "tab:orange"}


def matplotlib_missing() -> str | None:
    """Why the charts cannot be drawn (matplotlib is not installed), or ``None``."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed (pip install 'staging-contracts[plot]')"
    return None


def write_plots(result: ScalingResult, directory: str | Path) -> list[Path]:
    """Draw the charts of ``result`` into ``directory`` (made if missing); their paths.

    A chart whose series has no point that verified is still written, with its axes and a
    note that it is empty, so the set of files is always :data:`CHARTS`.

    Raises:
        ImportError: matplotlib is not installed (see :func:`matplotlib_missing`).
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for name, figure in drawn_charts(result):
        path = folder / name
        figure.savefig(path, dpi=DPI)
        paths.append(path)
    return paths


def drawn_charts(result: ScalingResult) -> Iterator[tuple[str, Figure]]:
    """Each chart of :data:`CHARTS`, drawn and laid out, with its file name.

    Each figure is closed once the next one is asked for (or the iteration ends), so use it
    within the loop. :func:`write_plots` saves them; tests measure them.

    Raises:
        ImportError: matplotlib is not installed (see :func:`matplotlib_missing`).
    """
    import matplotlib  # noqa: PLC0415 - an optional extra, loaded only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = list(result.rows)
    engines = list(dict.fromkeys(row.engine for row in result.rows))
    machine = _machine_note(result)
    for name, draw in zip(CHARTS, (_throughput, _latency, _tp_bars, _page_bars), strict=True):
        figure, axes = plt.subplots(figsize=FIGSIZE)
        try:
            draw(axes, rows, engines)
            figure.text(0.99, 0.01, machine, ha="right", va="bottom", fontsize=7, color="0.4")
            figure.tight_layout(rect=(0, 0.03, 1, 1))
            yield name, figure
        finally:
            plt.close(figure)


def _machine_note(result: ScalingResult) -> str:
    base = result.plan.base
    cpus = result.machine.get("cpus")
    load = result.machine.get("load_before") or []
    where = f"{cpus} CPUs" if cpus else ""
    where += f" (load {load[0]:.1f} at start)" if cpus and load else ""
    where += ", " if where else ""
    runs = "one run" if result.plan.runs == 1 else f"median of {result.plan.runs} runs"
    return (
        f"{where}{base.layers} layers x {base.kv_heads} KV heads x {base.head_dim}, "
        f"{base.dtype}; each point {runs}, every page verified"
    )


def _series(rows: Sequence[ScalingRow], engine: str, dimension: str) -> list[ScalingRow]:
    return [row for row in rows if row.engine == engine and row.dimension == dimension]


def _figure(row: ScalingRow, value: float) -> float:
    """``value`` when ``row`` verified, else ``nan`` (matplotlib leaves a gap there)."""
    return value if row.ok else math.nan


def _empty(axes: Axes, rows: Sequence[ScalingRow]) -> None:
    if not any(row.ok for row in rows):
        axes.text(0.5, 0.5, "no point verified", ha="center", va="center", transform=axes.transAxes)


_Line = tuple[list[float], str, str, float | None]
"""One line of a chart: its y values, format, label and alpha (``None``: opaque)."""


def _throughput(axes: Axes, rows: Sequence[ScalingRow], engines: Sequence[str]) -> None:
    def lines(engine: str, series: Sequence[ScalingRow]) -> list[_Line]:
        return [
            ([_figure(row, row.staged_gbps) for row in series], "o-", f"{engine} staged", None),
            # nan (a gap) where the raw write failed
            ([row.raw_gbps for row in series], "s--", f"{engine} raw write, same bytes", 0.7),
        ]

    drawn = _lines(axes, rows, engines, "tokens", lines)
    axes.set_xscale("log", base=2)
    ticks = sorted({row.tokens for row in drawn})
    axes.set_xticks(ticks or [1])
    axes.set_xticklabels([f"{t // 1024}k" if t % 1024 == 0 else str(t) for t in ticks] or [""])
    axes.set_xlabel("request length (tokens)")
    axes.set_ylabel("throughput (GB/s)")
    axes.set_title("Staged transfer throughput vs request length")


def _latency(axes: Axes, rows: Sequence[ScalingRow], engines: Sequence[str]) -> None:
    def lines(engine: str, series: Sequence[ScalingRow]) -> list[_Line]:
        stats = {r.latency_high_stat for r in series if r.ok}
        high = "p99" if stats == {"p99"} else "max" if stats == {"max"} else "p99 or max"
        return [
            ([_figure(r, r.latency_p50_s) for r in series], "o-", f"{engine} p50", None),
            ([_figure(r, r.latency_high_s) for r in series], "^--", f"{engine} {high}", None),
        ]

    drawn = _lines(axes, rows, engines, "concurrency", lines)
    counts = sorted({row.concurrency for row in drawn})
    if counts:
        axes.set_xticks(counts)
    axes.set_xlabel("concurrent requests")
    axes.set_ylabel("latency per request (s)")
    axes.set_title("Per-request latency vs concurrency\n(first STAGING_REQ to decode SUCCESS)")


def _lines(
    axes: Axes,
    rows: Sequence[ScalingRow],
    engines: Sequence[str],
    dimension: str,
    lines: Callable[[str, Sequence[ScalingRow]], list[_Line]],
) -> list[ScalingRow]:
    """Per engine, the ``lines`` of its ``dimension`` series against that field; the rows drawn.

    ``dimension`` (``tokens`` or ``concurrency``) names both the series and the row field
    that is its x value; the series is drawn in that field's order. The y axis starts at 0,
    with a grid, and the legend is drawn when a point verified; the caller labels the chart.
    """
    drawn: list[ScalingRow] = []
    for engine in engines:
        series = sorted(_series(rows, engine, dimension), key=lambda row: getattr(row, dimension))
        drawn += series
        xs = [getattr(row, dimension) for row in series]
        for ys, style, label, alpha in lines(engine, series):
            axes.plot(xs, ys, style, color=_COLOURS.get(engine), alpha=alpha, label=label)
    _empty(axes, drawn)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    if any(row.ok for row in drawn):
        axes.legend(fontsize=8)
    return drawn


def _bars(
    axes: Axes,
    rows: Sequence[ScalingRow],
    engines: Sequence[str],
    dimension: str,
    title: str,
    xlabel: str,
) -> None:
    values: list[Any] = list(dict.fromkeys(row.value for row in rows if row.dimension == dimension))
    width = 0.8 / max(1, len(engines))
    measured_gbps = [r.staged_gbps for r in rows if r.dimension == dimension and r.ok]
    marker = 0.25 * max(measured_gbps, default=1.0)  # a hatched outline, not a figure
    for slot, engine in enumerate(engines):
        by_value = {row.value: row for row in _series(rows, engine, dimension)}
        xs = [i + (slot - (len(engines) - 1) / 2) * width for i in range(len(values))]
        measured = [
            (x, by_value[value].staged_gbps)
            for x, value in zip(xs, values, strict=True)
            if value in by_value and by_value[value].ok
        ]
        bars = axes.bar(
            [x for x, _ in measured],
            [gbps for _, gbps in measured],
            width,
            color=_COLOURS.get(engine),
            label=engine,
        )
        axes.bar_label(bars, fmt="%.3g", fontsize=7)
        for x, value in zip(xs, values, strict=True):
            if value in by_value and by_value[value].ok:
                continue
            why = "failed" if value in by_value else "missing"
            axes.bar(
                x,
                marker,
                width,
                fill=False,
                hatch="//",
                edgecolor=_COLOURS.get(engine),
                linewidth=1,
                gid=why,
            )
            axes.text(x, marker, why, rotation=90, ha="center", va="bottom", fontsize=7)
    _empty(axes, [row for row in rows if row.dimension == dimension])
    axes.set_xticks(range(len(values)))
    axes.set_xticklabels([str(value) for value in values])
    axes.set_xlabel(xlabel)
    axes.set_ylabel("staged throughput (GB/s)")
    axes.set_title(title)
    axes.grid(True, axis="y", alpha=0.3)
    axes.margins(y=0.2)  # room above the bars for their labels and the legend
    if values:
        axes.legend(fontsize=8, loc="upper right", ncols=len(engines))


def _tp_bars(axes: Axes, rows: Sequence[ScalingRow], engines: Sequence[str]) -> None:
    _bars(axes, rows, engines, "tp", "Staged throughput per TP pair", "prefill TP -> decode TP")


def _page_bars(axes: Axes, rows: Sequence[ScalingRow], engines: Sequence[str]) -> None:
    _bars(axes, rows, engines, "page_size", "Staged throughput per page size", "page size (tokens)")
