"""The Grafana dashboard queries only series the collectors export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from staging_contracts._cluster.metrics_relay import UP_SERIES
from staging_contracts.metrics._collector import SERIES

DASHBOARD = (
    Path(__file__).resolve().parents[1] / "integrations" / "grafana" / "staging-contracts.json"
)
NAME = re.compile(r"\bstaging_contracts_[a-z_]+")


def queries(doc: object) -> list[str]:
    """Every ``expr`` and variable ``query``/``definition`` string in the dashboard."""
    found: list[str] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key in ("expr", "definition", "query") and isinstance(value, str):
                found.append(value)
            else:
                found.extend(queries(value))
    elif isinstance(doc, list):
        for item in doc:
            found.extend(queries(item))
    return found


def test_every_series_the_dashboard_names_is_exported() -> None:
    doc = json.loads(DASHBOARD.read_text())
    exprs = queries(doc)
    named = {name for expr in exprs for name in NAME.findall(expr)}
    assert len(doc["panels"]) >= 8
    assert named, "the dashboard queries nothing"
    # and the relay's own gauge (the CLI's --metrics-port)
    assert named <= SERIES | {UP_SERIES}, sorted(named - SERIES - {UP_SERIES})


def test_every_exported_series_is_on_the_dashboard() -> None:
    """Nothing the collectors export goes unseen (a histogram by its bucket, sum, count)."""
    named = {n for e in queries(json.loads(DASHBOARD.read_text())) for n in NAME.findall(e)}
    assert named >= SERIES, sorted(SERIES - named)


def test_every_panel_targets_prometheus_with_a_unique_id() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["datasource"]["type"] == "prometheus"
        assert panel["targets"], panel["title"]
