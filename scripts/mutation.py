"""Mutation testing of the core modules, one mutmut run per module (``make mutation``).

Each module is mutated on its own, in a scratch copy of the repository under
``.mutation/<module>/`` (git-ignored), with only the tests that exercise it, so that a run
takes seconds to minutes rather than the whole suite per mutant. Then:

1. every mutant mutmut reports as surviving is checked again in a **fresh process** (a new
   ``pytest`` with ``MUTANT_UNDER_TEST`` set before anything is imported), which catches
   mutants of code that runs at import or class creation: mutmut's forked workers have
   already run that code unmutated;
2. survivors listed in ``tests/mutation-equivalents/<module>.txt`` (one ``NAME  reason`` a
   line) count as killed: each is a mutant that no test can tell from the original, with
   the reason;
3. a table (killed / total, score, goal) is printed; each module's outcome is kept in
   ``.mutation/<module>/outcome.json``, and once every module has one (from this run or an
   earlier one, e.g. ``make mutation MODULES=wire`` after a change to the wire tests), the
   table is written to ``docs/mutation-summary.md`` with the survivors left, so that the
   figures are committed.

Usage: ``python scripts/mutation.py [MODULE ...] [--jobs N] [--summary PATH]``, where MODULE
is a key of :data:`TARGETS` (``contract``, ``layout``, ...); all of them by default. It is too
slow for ``make test`` (minutes per module on two cores) and is not part of it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

REPO: Final = Path(__file__).resolve().parent.parent
SCRATCH: Final = REPO / ".mutation"
EQUIVALENTS: Final = REPO / "tests" / "mutation-equivalents"
SUMMARY: Final = REPO / "docs" / "mutation-summary.md"
MUTMUT: Final = Path(sys.executable).with_name("mutmut")


@dataclass(frozen=True)
class Target:
    """One module to mutate, the tests that exercise it and the score it must reach."""

    path: str
    """The module, relative to the repository root."""
    tests: tuple[str, ...]
    """Test files (or node ids) that run against it."""
    goal: float
    """Lowest acceptable score (killed, timed out or equivalent, over all mutants)."""


_CONTRACT_TESTS: Final = (
    "tests/test_contract.py",
    "tests/test_contract_reports.py",
    "tests/test_enforcement.py",
    "tests/test_declarations.py",
    "tests/test_mixin.py",
    "tests/test_typeforms.py",
    "tests/test_valuecheck.py",
)

TARGETS: Final[dict[str, Target]] = {
    "contract": Target("src/staging_contracts/_contract/contract.py", _CONTRACT_TESTS, 0.90),
    "enforcement": Target("src/staging_contracts/_contract/enforcement.py", _CONTRACT_TESTS, 0.90),
    "declarations": Target(
        "src/staging_contracts/_contract/declarations.py", _CONTRACT_TESTS, 0.90
    ),
    "allocator": Target(
        "src/staging_contracts/_staging/allocator.py",
        ("tests/test_allocator.py", "tests/test_reference_vectors.py"),
        0.90,
    ),
    "layout": Target(
        "src/staging_contracts/_staging/layout.py",
        ("tests/test_layout.py", "tests/test_reference_vectors.py"),
        0.90,
    ),
    "wire": Target("src/staging_contracts/_control/wire.py", ("tests/test_wire.py",), 0.90),
    "decode": Target(
        "src/staging_contracts/_decode/handler.py",
        (
            "tests/test_control_plane.py",
            "tests/test_decode_handler.py",
            "tests/test_reliability.py",
            "tests/test_kv_requests.py",
        ),
        0.85,
    ),
    "prefill": Target(
        "src/staging_contracts/_prefill/writer.py",
        (
            "tests/test_control_plane.py",
            "tests/test_prefill_writer.py",
            "tests/test_reliability.py",
            "tests/test_kv_requests.py",
        ),
        0.85,
    ),
}
"""The modules under mutation testing, by name."""

KILLED_STATUSES: Final = frozenset({"killed", "timeout", "caught by type check", "segfault"})
"""mutmut verdicts that count as caught (a mutant that hangs or crashes the tests is caught)."""


@dataclass
class Outcome:
    """What one module's run found."""

    name: str
    target: Target
    statuses: dict[str, str] = field(default_factory=dict)
    """mutmut's verdict per mutant."""
    fresh_killed: set[str] = field(default_factory=set)
    """Survivors killed when re-run in a fresh process."""
    equivalent: set[str] = field(default_factory=set)
    """Survivors listed as equivalent."""
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return len(self.statuses)

    @property
    def caught(self) -> int:
        mutmut_killed = sum(s in KILLED_STATUSES for s in self.statuses.values())
        return mutmut_killed + len(self.fresh_killed) + len(self.equivalent)

    @property
    def survivors(self) -> list[str]:
        return sorted(
            name
            for name, status in self.statuses.items()
            if status not in KILLED_STATUSES
            and name not in self.fresh_killed
            and name not in self.equivalent
        )

    @property
    def score(self) -> float:
        return self.caught / self.total if self.total else 0.0


def read_equivalents(folder: Path = EQUIVALENTS) -> dict[str, str]:
    """Mutant name -> the reason it is equivalent, from every ``*.txt`` in ``folder``.

    One ``NAME  reason`` a line; blank lines and ``#`` comments are skipped.
    """
    found: dict[str, str] = {}
    for path in sorted(folder.glob("*.txt")):
        for number, raw in enumerate(path.read_text().splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, _, reason = line.partition(" ")
            if not reason.strip():
                raise SystemExit(f"{path.name}:{number}: {name!r} needs a one-line reason")
            found[name] = reason.strip()
    return found


def _prepare(name: str, target: Target) -> Path:
    work = SCRATCH / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copytree(REPO / "src", work / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(
        REPO / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__", ".hyp*")
    )
    tests = [t for t in target.tests if (REPO / t.split("::")[0]).exists()]
    config = (REPO / "pyproject.toml").read_text() + (
        "\n[tool.mutmut]\n"
        'source_paths = ["src"]\n'
        f'only_mutate = ["{target.path}"]\n'
        f"pytest_add_cli_args_test_selection = {tests!r}\n".replace("'", '"')
        + 'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"]\n'
    )
    (work / "pyproject.toml").write_text(config)
    return work


def _mutmut(work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MUTMUT), *args], cwd=work, capture_output=True, text=True, check=False
    )


def _statuses(work: Path) -> dict[str, str]:
    result = _mutmut(work, "results", "--all", "true")
    statuses = {}
    for line in result.stdout.splitlines():
        match = re.match(r"^\s*(\S+): (.+)$", line)
        if match:
            statuses[match.group(1)] = match.group(2).strip()
    return statuses


def _fresh_run(work: Path, mutant: str | None, tests: list[str]) -> int:
    env = dict(os.environ, PYTHONPATH=str(work / "mutants" / "src"))
    env.pop("PYTEST_ADDOPTS", None)
    env["MUTANT_UNDER_TEST"] = mutant or ""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
        cwd=work / "mutants",
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    return result.returncode


def _tests_for(work: Path, mutant: str) -> list[str]:
    """The test ids mutmut recorded for a mutant, one per line (ids may contain spaces)."""
    lines = _mutmut(work, "tests-for-mutant", mutant).stdout.splitlines()
    return [line.strip() for line in lines if "::" in line]


KILLING_EXITS: Final = frozenset({1, 2})
"""pytest exit codes that kill a mutant in a fresh process: tests failed (1), or collection
or import failed (2); a process killed by a signal (negative) kills it too. Not 3 (internal
error), 4 (usage: e.g. a test id not found) or 5 (no tests), which say nothing of it."""


def run_target(name: str, target: Target, jobs: int, equivalents: dict[str, str]) -> Outcome:
    """Mutate one module and classify every mutant."""
    start = time.monotonic()
    work = _prepare(name, target)
    run = _mutmut(work, "run", "--max-children", str(jobs))
    if run.returncode != 0:
        sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
        raise SystemExit(f"mutmut failed on {name} (exit {run.returncode})")
    outcome = Outcome(name, target, statuses=_statuses(work))
    survivors = [m for m, s in outcome.statuses.items() if s not in KILLED_STATUSES]
    fresh_candidates = [m for m in survivors if m not in equivalents]
    if fresh_candidates:
        selection = [t for t in target.tests if (REPO / t.split("::")[0]).exists()]
        if _fresh_run(work, None, selection) != 0:
            raise SystemExit(f"{name}: the unmutated tests fail in a fresh process")
        for mutant in fresh_candidates:
            tests = _tests_for(work, mutant)
            status = _fresh_run(work, mutant, tests) if tests else 0
            if status in KILLING_EXITS or status < 0:
                outcome.fresh_killed.add(mutant)
    outcome.equivalent = {m for m in survivors if m in equivalents}
    outcome.seconds = time.monotonic() - start
    return outcome


def format_table(outcomes: list[Outcome]) -> str:
    """The summary table, in Markdown."""
    rows = [
        "| module | mutants | killed by mutmut | killed in a fresh process | equivalent "
        "| survived | score | goal | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        by_mutmut = sum(s in KILLED_STATUSES for s in o.statuses.values())
        met = "yes" if o.score >= o.target.goal else "**NO**"
        rows.append(
            f"| `{o.target.path.removeprefix('src/')}` | {o.total} | {by_mutmut} "
            f"| {len(o.fresh_killed)} | {len(o.equivalent)} | {len(o.survivors)} "
            f"| {o.score:.1%} | >= {o.target.goal:.0%} | {met} |"
        )
    return "\n".join(rows)


def write_summary(outcomes: list[Outcome], path: Path) -> None:
    """The committed summary: the table, then the survivors left in each module."""
    lines = [
        "# Mutation testing summary",
        "",
        "Written by `make mutation` (`scripts/mutation.py`); see `docs/testing.md` for how to",
        "run and read it. mutmut "
        + _mutmut(REPO, "--version").stdout.strip().rsplit(" ", 1)[-1]
        + f", every mutant of each module, Python {sys.version.split()[0]}.",
        "",
        format_table(outcomes),
        "",
    ]
    for o in outcomes:
        counts = Counter(o.statuses.values())
        lines += [
            f"## `{o.name}` ({o.seconds:.0f} s)",
            "",
            "mutmut verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
            "",
        ]
        if o.survivors:
            lines += ["Survivors left:", ""] + [f"- `{m}`" for m in o.survivors] + [""]
        else:
            lines += ["No survivors left.", ""]
    path.write_text("\n".join(lines))


def save_outcome(outcome: Outcome) -> None:
    """Keep a module's outcome beside its scratch copy, for a summary of every module."""
    doc = {
        "statuses": outcome.statuses,
        "fresh_killed": sorted(outcome.fresh_killed),
        "equivalent": sorted(outcome.equivalent),
        "seconds": outcome.seconds,
    }
    (SCRATCH / outcome.name / "outcome.json").write_text(json.dumps(doc, indent=1))


def load_outcome(name: str) -> Outcome | None:
    """The latest saved outcome of a module (``None`` if it was never run)."""
    path = SCRATCH / name / "outcome.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    return Outcome(
        name,
        TARGETS[name],
        statuses=dict(doc["statuses"]),
        fresh_killed=set(doc["fresh_killed"]),
        equivalent=set(doc["equivalent"]),
        seconds=float(doc["seconds"]),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", metavar="MODULE", help=", ".join(TARGETS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--summary", type=Path, default=SUMMARY)
    args = parser.parse_args(argv)
    if not MUTMUT.exists():
        raise SystemExit(f"mutmut is not installed beside {sys.executable}: pip install mutmut")
    names = args.modules or list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown module {unknown[0]!r}: choose from {', '.join(TARGETS)}")
    equivalents = read_equivalents()
    outcomes = []
    for name in names:
        print(f"mutating {name} ({TARGETS[name].path}) ...", flush=True)
        outcomes.append(run_target(name, TARGETS[name], args.jobs, equivalents))
        save_outcome(outcomes[-1])
        print(format_table(outcomes[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(outcomes))
    every = [load_outcome(name) for name in TARGETS]
    if all(outcome is not None for outcome in every):
        write_summary([o for o in every if o is not None], args.summary)
        print(f"\nsummary of every module written to {args.summary.relative_to(REPO)}")
    return 0 if all(o.score >= o.target.goal for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
