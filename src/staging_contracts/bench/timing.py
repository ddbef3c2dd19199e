"""Timing helpers: medians of repeated measurements, interleaved with the anchor."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["interleaved_ns_per_call", "median_seconds"]


def median_seconds(fn: Callable[[], object], *, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def interleaved_ns_per_call(
    ours: Callable[[int], object],
    anchor: Callable[[int], object],
    *,
    loops: int,
    repeats: int,
) -> tuple[float, float]:
    """Median nanoseconds per call of two loop bodies, measured alternately.

    Each callable runs ``loops`` iterations of the operation when called with ``loops``.
    Alternating the two in every repeat puts both under the same machine conditions, which
    matters when the expected difference is a few percent.
    """
    ours(loops // 10 or 1)
    anchor(loops // 10 or 1)
    ours_samples: list[float] = []
    anchor_samples: list[float] = []
    for index in range(repeats):
        order = (ours, anchor) if index % 2 == 0 else (anchor, ours)
        for fn in order:
            start = time.perf_counter_ns()
            fn(loops)
            elapsed = (time.perf_counter_ns() - start) / loops
            (ours_samples if fn is ours else anchor_samples).append(elapsed)
    return statistics.median(ours_samples), statistics.median(anchor_samples)
