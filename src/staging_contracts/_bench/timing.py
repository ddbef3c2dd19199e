"""Timing helpers: medians of repeated measurements, interleaved with the anchor."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")


def in_turns(items: Sequence[T], rounds: int) -> Iterator[T]:
    """Each of ``items`` once a round for ``rounds`` rounds, the order reversed every other
    round, so that none always runs first or after the same neighbour and all share the
    machine's conditions (a loaded host, a warm cache)."""
    for index in range(rounds):
        yield from reversed(items) if index % 2 else items


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
    """Median nanoseconds per call of two loop bodies, measured :func:`in_turns` (which
    matters when the expected difference is a few percent).

    Each callable runs ``loops`` iterations of the operation when called with ``loops``.
    """
    ours(loops // 10 or 1)
    anchor(loops // 10 or 1)
    samples: dict[Callable[[int], object], list[float]] = {ours: [], anchor: []}
    for fn in in_turns((ours, anchor), repeats):
        start = time.perf_counter_ns()
        fn(loops)
        samples[fn].append((time.perf_counter_ns() - start) / loops)
    return statistics.median(samples[ours]), statistics.median(samples[anchor])


def alternating_seconds(
    functions: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    sync: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median wall time of each named function, after one warm-up call of each, all
    measured :func:`in_turns`. ``sync`` (e.g. ``torch.cuda.synchronize`` when the work is
    asynchronous) runs before each clock reading, so a time covers the work done, not only
    the work enqueued.

    Returns:
        Name -> median seconds of one call.
    """
    for fn in functions.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in functions}
    for name, fn in in_turns(list(functions.items()), repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}
