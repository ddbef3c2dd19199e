"""The transfer bench group against the real engines, in its quick mode: the rows' shape and
notes, and finite positive figures (no timing assertions: figures are for people)."""

from __future__ import annotations

import math
import os

import pytest

from staging_contracts._bench import ENGINES, BenchOptions, transfer_bench
from staging_contracts.engines import engine_available

AVAILABLE = [name for name in ENGINES if engine_available(name)[0]]


def missing_engines() -> dict[str, str]:
    """Each engine of the transfer group that does not import here, with the reason."""
    found = {name: engine_available(name) for name in ENGINES}
    return {name: why or "does not import" for name, (ok, why) in found.items() if not ok}


def require_engines(missing: dict[str, str], *, ci: bool) -> None:
    """In CI (env ``CI`` set), where every engine is installed, a missing one fails the
    test; elsewhere the test is skipped only when no engine imports at all. Either way the
    message names each missing engine and why."""
    if not missing:
        return
    named = "; ".join(f"{name}: {why}" for name, why in missing.items())
    if ci:
        pytest.fail(f"CI installs every transfer engine, but these do not import: {named}")
    if len(missing) == len(ENGINES):
        pytest.skip(f"no transfer engine imports here: {named}")


@pytest.mark.parametrize("ci", [True, False])
def test_require_engines_fails_in_ci_and_skips_elsewhere_naming_the_engines(ci: bool) -> None:
    """The guard of the live test: in CI a missing engine is a failure, elsewhere a skip
    only when none imports; the message names the engines and reasons."""
    every = {name: f"no {name} wheel" for name in ENGINES}
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(outcome) as raised:
        require_engines(every, ci=ci)
    for name in ENGINES:
        assert f"{name}: no {name} wheel" in str(raised.value)
    one = dict(list(every.items())[:1])
    if ci:
        with pytest.raises(pytest.fail.Exception, match=f"{next(iter(one))}: no "):
            require_engines(one, ci=True)
    else:
        require_engines(one, ci=False)  # the other engine runs: no skip
    require_engines({}, ci=ci)  # every engine imports: nothing to say


def test_quick_transfer_group_measures_ours_and_both_anchors_on_every_engine() -> None:
    """Every importable engine gets its two rows, measured through the rank processes in one
    round; quick rows have no goal; each note states both sides' processes, warm-up, bytes,
    tokens and what each role's ranks held at the done barrier."""
    require_engines(missing_engines(), ci=bool(os.environ.get("CI")))
    rows = transfer_bench.run(BenchOptions(quick=True))
    assert [row.name for row in rows] == [
        f"transfer.{engine}.{name}" for engine in AVAILABLE for name in ("vs-raw", "vs-per-token")
    ]
    for row in rows:
        assert row.unit == "GB/s"
        assert row.goal == ""
        for value in (row.ours, row.anchor, row.ratio):
            assert math.isfinite(value)
            assert value > 0
        assert row.ratio == pytest.approx(row.ours / row.anchor)
        anchor = "raw" if row.name.endswith("vs-raw") else "per-token"
        assert row.note.startswith(
            "quick: smoke only; both: 4 writer -> 2 receiver processes, 1 warm-up request"
            " first, 1 round; ratio per round "
        )
        assert "staged: 8 MiB (512 tokens x 4 layers), peak RSS to done: prefill <= " in row.note
        assert "ring reserved peak" in row.note
        assert f"; {anchor}: 8 MiB (512 tokens x 4 layers), peak RSS to done: prefill <= " in (
            row.note
        )
