"""Figures the docs state are the ones the records they cite hold."""

from __future__ import annotations

import re
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
