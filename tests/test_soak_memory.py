"""The soak's memory verdict: flat memory passes, steady growth fails the soak."""

from __future__ import annotations

from staging_contracts.cluster.soak_memory import RULE, RssSampler, judge_memory, memory_rows

MIB = 1 << 20


def statuses(growth_per_s: float) -> dict[int, dict[str, object]]:
    """Two processes sampled once a second for 120 s: decode grows, prefill jitters."""
    decode = [[t, int(400 * MIB + growth_per_s * t)] for t in range(120)]
    prefill = [[t, int(300 * MIB + (t % 3) * MIB)] for t in range(120)]
    return {
        1: {"role": "decode", "rank": 0, "rss": decode},
        2: {"role": "prefill", "rank": 0, "rss": prefill},
    }


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
