"""Benchmarks: our figure against an anchor measured in the same run, as a ratio.

Each group is a module of this package with a ``run(options: BenchOptions) ->
list[BenchRow]`` function, loaded lazily by name. Figures are medians of repeated
measurements. Benchmarks are never timed tests: they report, and the goals are for people to
read.

May import: ``_cluster``, ``_run``, ``backends`` and everything below them; never ``testing``
or ``cli``.
Imported by: ``cli`` (``staging-contracts bench``).
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Final

from .._run._signals import Interrupted

__all__ = [
    "DEVICES",
    "GROUPS",
    "BenchOptions",
    "BenchRow",
    "format_table",
    "run_groups",
    "write_json",
]

GROUPS: Final[dict[str, str]] = {
    "contract": "staging_contracts._bench.contract_bench",
    "staging": "staging_contracts._bench.staging_bench",
    "control": "staging_contracts._bench.control_bench",
    "transfer": "staging_contracts._bench.transfer_bench",
}
"""Group name -> module that implements it."""

ENGINES: Final = ("mooncake", "nixl")
"""The in-tree cross-process engines: what ``transfer`` and ``scaling`` run by default."""

DEVICES: Final = ("cpu", "cuda")
"""Devices the KV pools and staging buffers of a benchmark can live on."""

QUICK_NOTE: Final = "quick: smoke only"
"""How a quick row's note starts (its figures are not for judging, and it has no goal)."""


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What every group's ``run`` is given: size, device and backends of the run.

    Raises:
        ValueError: an unknown device, or an empty backend name.
    """

    quick: bool = False
    """Small sizes and few repetitions: for smoke tests, not for figures."""
    device: str = "cpu"
    """Where KV pools and staging buffers live (:data:`DEVICES`); ``"cuda"`` needs a GPU."""
    backends: tuple[str, ...] | None = None
    """Backends of the ``transfer`` group, as registry names or ``MODULE:CLASS[=MODULE:FACTORY]``
    specs (``None``: every in-tree engine that can be imported)."""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is not one of {', '.join(DEVICES)}")
        if self.backends is not None and not all(self.backends):
            raise ValueError("a backend name must not be empty")


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One benchmark result."""

    name: str
    """Dotted name, ``group.benchmark``."""
    ours: float
    """Our figure, in ``unit``."""
    anchor: float
    """The anchor's figure in the same unit, measured in the same run."""
    unit: str
    """Unit of ``ours`` and ``anchor`` (e.g. ``ns/call``, ``GB/s``)."""
    ratio: float
    """As each benchmark defines it (usually ours / anchor)."""
    goal: str
    """The goal on ``ratio``, e.g. ``<= 1.02`` or ``>= 0.5``; empty when informative only."""
    note: str = ""
    """What a reader needs to judge the comparison (writer counts, sizes, warm-up), if any."""

    @property
    def goal_met(self) -> bool | None:
        """Whether ``ratio`` meets ``goal``; ``None`` when there is no goal."""
        if not self.goal:
            return None
        op, _, bound = self.goal.partition(" ")
        limit = float(bound)
        return self.ratio <= limit if op == "<=" else self.ratio >= limit


def ratio_row(
    name: str, ours: float, anchor: float, unit: str, goal: str = "", *, note: str = ""
) -> BenchRow:
    """Build a row whose ratio is ``ours / anchor`` (``inf`` for an anchor of 0)."""
    ratio = ours / anchor if anchor else math.inf
    return BenchRow(name, ours, anchor, unit, ratio, goal, note)


def smoke(rows: list[BenchRow]) -> list[BenchRow]:
    """``rows`` of a quick run: no goal, and each note starts with :data:`QUICK_NOTE`."""
    return [replace(r, goal="", note="; ".join(filter(None, (QUICK_NOTE, r.note)))) for r in rows]


def run_groups(
    groups: Sequence[str] | None,
    options: BenchOptions | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    """Run the named groups (all when ``None``), in the order given, with ``options``.

    Under :func:`~staging_contracts._run.stop_on_signals` (raising), a stop signal ends the
    run: the group being run is unwound (its rank processes killed) and the rows of the groups
    that ended before it are returned; the caller's stop request says which signal.

    **Blocking:** until every group ran (minutes for the whole set; seconds when quick).

    Raises:
        KeyError: an unknown group name.
    """
    chosen = options if options is not None else BenchOptions()
    rows: list[BenchRow] = []
    try:
        for group in groups or list(GROUPS):
            module = importlib.import_module(GROUPS[group])
            if progress is not None:
                progress(f"bench {group} ...")
            rows.extend(module.run(chosen))
    except Interrupted:  # keep what the ended groups measured
        pass
    return rows


def format_table(rows: Iterable[BenchRow]) -> str:
    """Rows as an aligned text table (name, ours, anchor, unit, ratio, goal, met), then notes.

    A row with a note gets a mark ``[n]`` after its name and the note as footnote ``n``.
    """
    header = ("name", "ours", "anchor", "unit", "ratio", "goal", "met")
    table = [header]
    notes: list[str] = []
    for row in rows:
        name = row.name
        if row.note:
            notes.append(row.note)
            name = f"{row.name} [{len(notes)}]"
        met = {None: "", True: "yes", False: "NO"}[row.goal_met]
        table.append(
            (
                name,
                _fmt(row.ours),
                _fmt(row.anchor),
                row.unit,
                f"{row.ratio:.3f}",
                row.goal or "-",
                met,
            )
        )
    lines = aligned(table)
    lines.extend(f"[{number}] {note}" for number, note in enumerate(notes, 1))
    return "\n".join(lines)


def aligned(table: Sequence[Sequence[str]]) -> list[str]:
    """A header and its rows as left-aligned columns, with a rule under the header."""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _fmt(value: float) -> str:
    if value == 0 or 0.01 <= abs(value) < 1e6:
        return f"{value:.4g}"
    return f"{value:.3e}"


def write_json(rows: Iterable[BenchRow], path: str | Path) -> None:
    """Write rows as a JSON list of objects: name, ours, anchor, unit, ratio, goal, note."""
    Path(path).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
