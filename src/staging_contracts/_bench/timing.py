"""Timing helpers: medians of repeated measurements, interleaved with the anchor."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

__all__ = ["alternating_seconds", "interleaved_ns_per_call", "median_seconds"]


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


def alternating_seconds(
    functions: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    sync: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median wall time of each named function, all measured in turns.

    After one warm-up call of each, every round calls each function once, the order reversed
    every other round, so that none of them always runs first or after the same neighbour
    and all share the machine's conditions (a loaded host, a warm cache). ``sync`` (e.g.
    ``torch.cuda.synchronize`` when the work is asynchronous) runs before each clock reading,
    so a time covers the work done, not only the work enqueued.

    Returns:
        Name -> median seconds of one call.
    """
    wait = sync if sync is not None else _no_wait
    for fn in functions.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in functions}
    for index in range(repeats):
        order = list(functions.items())
        if index % 2:
            order.reverse()
        for name, fn in order:
            wait()
            start = time.perf_counter()
            fn()
            wait()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def _no_wait() -> None:
    """Nothing to wait for: the work is done when the call returns (CPU)."""
