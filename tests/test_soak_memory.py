"""The soak's memory verdict: flat memory passes, steady growth fails the soak."""

from __future__ import annotations

import re

import pytest

from staging_contracts._cluster.soak_memory import RULE, RssSampler, judge_memory, memory_rows

MIB = 1 << 20


def statuses(growth_per_s: float) -> dict[int, tuple[str, int, list[tuple[float, int]]]]:
    """Two processes sampled once a second for 120 s: decode grows, prefill jitters."""
    decode = [(float(t), int(400 * MIB + growth_per_s * t)) for t in range(120)]
    prefill = [(float(t), int(300 * MIB + (t % 3) * MIB)) for t in range(120)]
    return {1: ("decode", 0, decode), 2: ("prefill", 0, prefill)}


def test_flat_memory_passes_and_steady_growth_fails() -> None:
    flat = judge_memory(statuses(0.0), start=0.0, elapsed_s=120.0)
    assert flat.flat
    assert flat.judged == 2
    grown = judge_memory(statuses(1 * MIB), start=0.0, elapsed_s=120.0)  # +120 MiB
    assert not grown.flat
    assert [p.role for p in grown.grown] == ["decode"]
    rows = dict(memory_rows(grown))
    assert rows["memory"].startswith("GROWING: decode 0")
    assert RULE in rows["memory"]
    assert "first 420.0 MiB" in rows["memory decode"]


def test_the_sampler_is_bounded_and_thins_out() -> None:
    sampler = RssSampler(every_s=1.0, capacity=8)
    for t in range(100):
        sampler.maybe_sample(float(t), rss=t + 1)
    assert 2 <= len(sampler.samples) <= 8
    assert sampler.samples[0] == (0.0, 1)


def test_memory_that_grew_fails_the_soak_verdict_and_the_summary_says_so() -> None:
    from staging_contracts._cluster.soak_report import format_summary
    from tests.test_soak import passing_result

    grown = judge_memory(statuses(1 * MIB), start=0.0, elapsed_s=120.0)
    result = passing_result(memory=grown)
    assert not result.ok
    assert result.problems == ["memory grew in 1 rank processes"]
    lines = format_summary(result).splitlines()
    assert any(line.startswith("memory ") and "GROWING: decode 0" in line for line in lines)
    assert lines[-1].split()[:2] == ["verdict", "FAIL:"]
    assert "memory grew in 1 rank processes" in lines[-1]
    assert passing_result(memory=judge_memory(statuses(0.0), 0.0, 120.0)).ok


def test_a_short_real_soak_prints_each_roles_memory_and_a_flat_verdict(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``staging-contracts soak`` over real rank processes for a few seconds: the summary
    has a memory line per role (a rank process's first, last and peak RSS after the
    warm-up) and the memory verdict with its rule, and that verdict is part of PASS."""
    from staging_contracts import cli
    from staging_contracts._control.security import SECRET_ENV, SECRET_FILE_ENV

    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    # Long enough for MIN_SAMPLES samples per process after the warm-up (1 s apart).
    assert cli.main(["soak", "--faults", "none", "--duration", "8"]) == 0
    out = capsys.readouterr().out
    print(out)
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines() if "  " in line}
    for role in ("decode", "prefill"):
        line = rows[f"memory {role}"]
        assert re.search(rf"{role} \d+ \(pid \d+, the most grown of \d+\): first [\d.]+ MiB", line)
        assert re.search(r"peak [\d.]+ MiB, grew [\d.]+ MiB \(\d+ samples after", line)
    assert re.search(r"^memory +flat \(3 processes judged; ", out, re.M), out
    assert RULE in rows["memory"]
    assert out.splitlines()[-1].split() == ["verdict", "PASS"]
