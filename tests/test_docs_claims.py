"""Figures the docs state are the ones the records they cite hold."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Final

REPO: Final = Path(__file__).resolve().parent.parent
NUMBERS: Final = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _flat(path: Path) -> str:
    """The page's text with its line breaks and runs of white space as single spaces."""
    return " ".join(path.read_text().split())


def test_the_stated_mutation_times_are_the_summarys() -> None:
    """docs/testing.md gives the fastest and slowest module's time and the total as
    docs/mutation-summary.md records them (the time of each module heads its section)."""
    summary = (REPO / "docs" / "mutation-summary.md").read_text()
    times = {name: int(s) for name, s in re.findall(r"^## `(\w+)` \((\d+) s\)$", summary, re.M)}
    assert len(times) >= 8, times  # every module of make mutation
    fastest = min(times, key=lambda name: times[name])
    slowest = max(times, key=lambda name: times[name])
    minutes = round(sum(times.values()) / 60)
    stated = (
        f"from {times[fastest]} s (`{fastest}`) to {times[slowest]} s (`{slowest}`),"
        f" {minutes} minutes for all {NUMBERS[len(times)]},"
    )
    page = _flat(REPO / "docs" / "testing.md")
    assert stated in page
    assert f"against the summary's {times['wire']} s" in page


def _documented_rows() -> list[re.Pattern[str]]:
    """A pattern per row name the benchmarks page's tables list (first column): ``.suffix``
    stands for the previous name with its last part replaced, ``<case>`` for any one part."""
    patterns = []
    for line in (REPO / "docs" / "benchmarks.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        previous = ""
        for shown in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            name = previous.rsplit(".", 1)[0] + shown if shown.startswith(".") else shown
            previous = name
            parts = [r"[^.]+" if p.startswith("<") else re.escape(p) for p in name.split(".")]
            patterns.append(re.compile(r"\.".join(parts)))
    return patterns


def test_every_row_bench_prints_is_in_the_benchmarks_tables(tmp_path: Path) -> None:
    """The rows ``staging-contracts bench contract staging control --quick`` prints are each
    described in docs/benchmarks.md (the transfer group's two rows per engine are too)."""
    out = tmp_path / "rows.json"
    script = Path(sys.executable).with_name("staging-contracts")
    groups = ["contract", "staging", "control"]
    result = subprocess.run(
        [str(script), "bench", *groups, "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    printed = {row["name"] for row in json.loads(out.read_text())}
    assert len(printed) > 20, printed  # the reader finds the rows
    patterns = _documented_rows()
    missing = {name for name in printed if not any(p.fullmatch(name) for p in patterns)}
    assert missing == set()
    for row in ("transfer.nixl.vs-raw", "transfer.mooncake.vs-per-token"):
        assert any(p.fullmatch(row) for p in patterns), row


def test_every_environment_variable_the_package_reads_is_in_the_operating_table() -> None:
    """Each ``STAGING_CONTRACTS_*`` name the package's code holds is a row of the table of
    docs/operating.md (a variable added to the code must be documented there)."""
    source = REPO / "src" / "staging_contracts"
    named = {
        name
        for path in source.rglob("*.py")
        for name in re.findall(r"\"(STAGING_CONTRACTS_[A-Z_]+)\"", path.read_text())
    }
    assert {"STAGING_CONTRACTS_SECRET", "STAGING_CONTRACTS_INTEGRITY"} <= named
    page = (REPO / "docs" / "operating.md").read_text()
    rows = set(re.findall(r"^\| `(STAGING_CONTRACTS_[A-Z_]+)` \|", page, re.M))
    assert named - rows == set()
