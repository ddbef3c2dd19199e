"""The soak's memory check: each rank samples its own resident set size, the driver judges.

A rank process keeps a bounded list of ``(time.monotonic(), rss_bytes)`` samples
(:class:`RssSampler`, read from ``/proc/self/statm``) and sends it with every ``status``
answer. At the end the driver (:func:`judge_memory`) looks, per process, at the samples taken
after the warm-up (the first :data:`WARMUP_SHARE` of the soak, at most :data:`WARMUP_MAX_S`)
and calls memory **flat** when the median of their second half exceeds the median of their
first half by at most :data:`GROWTH_BOUND_BYTES` or :data:`GROWTH_BOUND_SHARE` of it,
whichever is larger (:data:`RULE`). Medians, not peaks: a transient spike (a burst of rooms,
a flood) is not growth; a steady leak of ``G`` bytes over the soak shows as about ``G / 2``.
A process with fewer than :data:`MIN_SAMPLES` samples after the warm-up (killed early, or a
short soak) is not judged.

**Thread-safety:** a sampler is used by its rank's main loop only.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

SAMPLE_EVERY_S: Final = 1.0
"""A rank samples its RSS this often at first (less often once its list was thinned)."""

MAX_SAMPLES: Final = 256
"""Most samples a rank keeps: past it every second one goes and the interval doubles."""

WARMUP_SHARE: Final = 0.25
"""The first quarter of the soak is warm-up (pools, imports, caches filling)."""

WARMUP_MAX_S: Final = 20.0
"""The warm-up lasts at most this long."""

MIN_SAMPLES: Final = 6
"""A process is judged only with at least this many samples after the warm-up."""

GROWTH_BOUND_BYTES: Final = 16 << 20
"""Memory is flat if it grew by at most this much (or :data:`GROWTH_BOUND_SHARE`)."""

GROWTH_BOUND_SHARE: Final = 0.05
"""... or by at most this share of the first half's median."""

RULE: Final = (
    "flat: per process, after the warm-up, median RSS of the second half <= that of the first "
    f"half + max({GROWTH_BOUND_BYTES >> 20} MiB, {GROWTH_BOUND_SHARE:.0%})"
)
"""The rule, as the summary states it."""

_PAGE: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_rss() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``; 0 where there is
    none). **Blocking:** one small file read."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            fields = statm.read().split()
    except OSError:
        return 0
    return int(fields[1]) * _PAGE if len(fields) > 1 and fields[1].isdigit() else 0


class RssSampler:
    """A bounded list of a process's RSS samples.

    Args:
        every_s: time between two samples (doubled each time the list is thinned).
        capacity: most samples kept.
    """

    def __init__(self, every_s: float = SAMPLE_EVERY_S, capacity: int = MAX_SAMPLES) -> None:
        if capacity < 2:
            raise ValueError(f"capacity={capacity!r} must be >= 2")
        self._every = every_s
        self._capacity = capacity
        self._samples: list[tuple[float, int]] = []

    def maybe_sample(self, now: float, rss: int | None = None) -> bool:
        """Take a sample (``rss``, else :func:`read_rss`) if the last one is ``every_s`` old;
        whether it did."""
        if self._samples and now - self._samples[-1][0] < self._every:
            return False
        self._samples.append((now, read_rss() if rss is None else rss))
        if len(self._samples) > self._capacity:
            self._samples = self._samples[::2]
            self._every *= 2
        return True

    @property
    def samples(self) -> list[tuple[float, int]]:
        """The samples kept, oldest first."""
        return list(self._samples)


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """One rank process's RSS after the warm-up."""

    role: str
    rank: int
    pid: int
    samples: int
    """Samples after the warm-up."""
    first: int
    last: int
    peak: int
    growth: int
    """Median of the second half minus median of the first half, in bytes."""
    bound: int
    """The growth allowed to it (see :data:`RULE`)."""

    @property
    def judged(self) -> bool:
        """Whether it had enough samples to be judged."""
        return self.samples >= MIN_SAMPLES

    @property
    def flat(self) -> bool:
        """Judged and within its bound (a process not judged is not counted against)."""
        return not self.judged or self.growth <= self.bound


@dataclass(frozen=True, slots=True)
class MemoryVerdict:
    """The memory of every rank process of a soak."""

    processes: tuple[ProcessMemory, ...]
    warmup_s: float

    @property
    def judged(self) -> int:
        """Processes with enough samples to be judged."""
        return sum(p.judged for p in self.processes)

    @property
    def grown(self) -> tuple[ProcessMemory, ...]:
        """Processes whose memory grew past their bound."""
        return tuple(p for p in self.processes if not p.flat)

    @property
    def flat(self) -> bool:
        """No judged process grew past its bound."""
        return not self.grown

    def by_role(self) -> dict[str, ProcessMemory]:
        """Per role, its judged process that grew most (any, where none was judged)."""
        out: dict[str, ProcessMemory] = {}
        for process in self.processes:
            held = out.get(process.role)
            key = (process.judged, process.growth)
            if held is None or key > (held.judged, held.growth):
                out[process.role] = process
        return out


def judge_memory(
    statuses: Mapping[int, tuple[str, int, Sequence[tuple[float, int]]]],
    start: float,
    elapsed_s: float,
) -> MemoryVerdict:
    """Judge every rank process's RSS samples, from its latest ``status``.

    Args:
        statuses: process id -> its role, rank and RSS samples (its latest status's).
        start: when the soak started (``time.monotonic()``, the ranks' clock too).
        elapsed_s: the soak's length.
    """
    warmup = min(WARMUP_MAX_S, elapsed_s * WARMUP_SHARE)
    processes = []
    for pid, (role, rank, samples) in sorted(statuses.items()):
        kept = [int(rss) for t, rss in samples if t >= start + warmup and rss > 0]
        if not kept:
            continue
        half = len(kept) // 2
        base = int(statistics.median(kept[:half] or kept))
        growth = int(statistics.median(kept[half:])) - base
        bound = max(GROWTH_BOUND_BYTES, int(base * GROWTH_BOUND_SHARE))
        processes.append(
            ProcessMemory(role, rank, pid, len(kept), kept[0], kept[-1], max(kept), growth, bound)
        )
    return MemoryVerdict(tuple(processes), warmup)


def memory_rows(verdict: MemoryVerdict) -> list[tuple[str, str]]:
    """The summary's memory lines: one per role, then the verdict with its rule."""

    def mib(value: int) -> str:
        return f"{value / (1 << 20):.1f} MiB"

    rows = []
    for role, p in sorted(verdict.by_role().items()):
        count = sum(q.role == role for q in verdict.processes)
        rows.append(
            (
                f"memory {role}",
                f"{role} {p.rank} (pid {p.pid}, the most grown of {count}): first {mib(p.first)}, "
                f"last {mib(p.last)}, peak {mib(p.peak)}, grew {mib(p.growth)} "
                f"({p.samples} samples after {verdict.warmup_s:.1f} s warm-up)",
            )
        )
    if not verdict.judged:
        rows.append(("memory", f"not judged: too few samples after the warm-up ({RULE})"))
    elif verdict.flat:
        rows.append(("memory", f"flat ({verdict.judged} processes judged; {RULE})"))
    else:
        grown = ", ".join(f"{p.role} {p.rank} +{mib(p.growth)}" for p in verdict.grown)
        rows.append(("memory", f"GROWING: {grown} ({RULE})"))
    return rows
