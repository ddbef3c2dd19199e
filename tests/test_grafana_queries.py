"""How the dashboard's queries group and filter (review of issue 26, item 10): by scrape
target too (``job``, ``instance``: two pods' rank 0 are not one series), each room counted
once, and no ring line divided by prefill's capacity of 0."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = (
    Path(__file__).resolve().parents[1] / "integrations" / "grafana" / "staging-contracts.json"
)
GROUPING = re.compile(r"\b(?:sum|max|min|avg|count) by \(([^)]*)\)")
SELECTOR = re.compile(r"staging_contracts_[a-z_]+\{([^}]*)\}")


def panels() -> list[dict[str, Any]]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    found: list[dict[str, Any]] = doc["panels"]
    return found


def exprs(title_part: str = "") -> list[str]:
    return [t["expr"] for p in panels() if title_part in p["title"] for t in p["targets"]]


def test_the_dashboard_has_job_and_instance_variables() -> None:
    doc = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in doc["templating"]["list"]]
    assert {"job", "instance", "role", "rank"} <= set(names)


def test_every_query_selects_and_groups_by_job_and_instance() -> None:
    for expr in exprs():
        for selector in SELECTOR.findall(expr):
            assert 'job=~"$job"' in selector, expr
            assert 'instance=~"$instance"' in selector, expr
        groups = GROUPING.findall(expr)
        assert groups, expr
        for group in groups:
            labels = {label.strip() for label in group.split(",")}
            assert {"job", "instance"} <= labels, expr


def test_rooms_are_counted_once_on_decodes_side() -> None:
    (expr,) = exprs("Rooms ended")
    assert 'role="decode"' in expr
    assert expr.startswith("max by ("), expr  # the ranks of one room's side: not summed
    assert "role" not in GROUPING.findall(expr)[0]


def test_the_ring_is_decodes_and_never_divided_by_zero() -> None:
    in_use, reserved = exprs("ring use")
    assert "staging_contracts_ring_in_use_bytes{" in in_use
    assert "staging_contracts_ring_reserved_bytes{" in reserved
    for expr in (in_use, reserved):
        assert expr.count('role="decode"') == 2
        assert "staging_contracts_ring_capacity_bytes{" in expr
        assert re.search(r"ring_capacity_bytes\{[^}]*\} > 0\)", expr), expr
