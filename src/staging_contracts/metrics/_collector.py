"""The ``prometheus_client`` collector: metric families built from snapshots at scrape time.

:class:`StagingCollector` asks its source for the current :class:`~.snapshot.MetricsSnapshot`
of every rank it serves (one for :func:`~staging_contracts.metrics.register`, the latest of
each rank for a driver's relay) and turns them into the families of :data:`SERIES`, one family
per name whatever the number of sources, each sample labelled ``role``, ``rank`` and
``engine``. A series that does not apply to a side is not exported for it (decode stages no
bytes, prefill has no ring). Needs the ``metrics`` extra.

**Threads:** :meth:`StagingCollector.collect` runs on the thread that serves the scrape.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..outcomes import FailureReason
from ..stats import LATENCY_BUCKETS_S
from ._snapshot import MetricsSnapshot

__all__ = ["LABELS", "PREFIX", "SERIES", "Source", "StagingCollector", "reason_label"]

PREFIX: Final = "staging_contracts_"
LABELS: Final = ("role", "rank", "engine")
"""The labels of every sample (``rooms_ended`` adds ``outcome`` and ``reason``,
``control_messages`` adds ``kind``)."""

_PREFILL: Final = frozenset({"prefill"})
_DECODE: Final = frozenset({"decode"})
_BOTH: Final = _PREFILL | _DECODE

_SIMPLE: Final = (
    # (name as exposed, type, snapshot field, help, the sides it applies to)
    (
        "staged_bytes_total",
        "counter",
        "staged_bytes",
        "Bytes prefill wrote into decode rings.",
        _PREFILL,
    ),
    (
        "scattered_bytes_total",
        "counter",
        "scattered_bytes",
        "Ring bytes decode scattered into its KV pool.",
        _DECODE,
    ),
    (
        "chunks_total",
        "counter",
        "chunks",
        "Chunks staged (prefill) or scattered (decode).",
        _BOTH,
    ),
    (
        "malformed_messages_total",
        "counter",
        "malformed",
        "Control messages the listener dropped as malformed.",
        _BOTH,
    ),
    (
        "unauthorized_messages_total",
        "counter",
        "unauthorized",
        "Control messages an authoriser refused.",
        _BOTH,
    ),
    (
        "dropped_messages_total",
        "counter",
        "dropped",
        "Well-formed staging messages dropped (no handler, unknown room or chunk).",
        _BOTH,
    ),
    (
        "peers_declared_dead_total",
        "counter",
        "peers_declared_dead",
        "Peers declared dead by the liveness check.",
        _BOTH,
    ),
    (
        "ring_in_use_bytes",
        "gauge",
        "ring_in_use_bytes",
        "Decode ring bytes in use (regions their writers may write); at most the capacity.",
        _DECODE,
    ),
    (
        "ring_reserved_bytes",
        "gauge",
        "ring_reserved_bytes",
        "Decode ring bytes reserved (assigned, not freed); overcommits: may exceed capacity.",
        _DECODE,
    ),
    (
        "ring_capacity_bytes",
        "gauge",
        "ring_capacity_bytes",
        "Decode ring size in bytes.",
        _DECODE,
    ),
    (
        "fences_outstanding",
        "gauge",
        "fences_outstanding",
        "Rooms whose ring regions wait for fence answers.",
        _DECODE,
    ),
)

_LATENCY_HELP: Final = (
    "Seconds a successful room took: decode from its first STAGING_REQ to its last scatter, "
    "prefill from KVSender.init to its last chunk's write."
)

SERIES: Final = frozenset(
    {PREFIX + name for name, *_ in _SIMPLE}
    | {
        PREFIX + "rooms_ended_total",
        PREFIX + "control_messages_total",
        PREFIX + "room_latency_seconds_bucket",
        PREFIX + "room_latency_seconds_sum",
        PREFIX + "room_latency_seconds_count",
    }
)
"""Every sample name the collector exposes."""


def _labels(snap: MetricsSnapshot) -> list[str]:
    return [snap.role, str(snap.rank), snap.engine]


def reason_label(reason: str) -> str:
    """The ``reason`` label of a snapshot's reason (a :class:`FailureReason` value):
    :attr:`FailureReason.label` (``peer_dead``); ``""`` stays ``""`` (a success)."""
    if not reason:
        return ""
    try:
        return FailureReason(reason).label
    except ValueError:  # not one of ours (a newer rank's): snake case it the same way
        return reason.lower().replace(" ", "_")


def _applies(snap: MetricsSnapshot, sides: frozenset[str]) -> bool:
    return not snap.side or snap.side in sides


Source = Callable[[], Iterable[MetricsSnapshot]]
"""Returns the current snapshot of every rank it serves (called per scrape)."""


class StagingCollector(Collector):
    """Builds the staging series from its sources' snapshots at each scrape, one family
    per name over all of them (so several managers share one registry).

    Args:
        source: returns the current snapshot of every rank to expose (called per scrape;
            it must not block for long: it runs on the scrape's thread). More are added with
            :meth:`add`.

    **Threads:** :meth:`add` and :meth:`remove` on any thread; :meth:`collect` on the
    scrape's.
    """

    def __init__(self, source: Source | None = None) -> None:
        self._lock = threading.Lock()
        self._sources: dict[object, Source] = {}
        if source is not None:
            self._sources[source] = source

    def add(self, key: object, source: Source) -> None:
        """Serve ``source``'s snapshots too, under ``key`` (one per key: a second replaces)."""
        with self._lock:
            self._sources[key] = source

    def remove(self, key: object) -> None:
        """Stop serving the source added under ``key`` (unknown keys are ignored)."""
        with self._lock:
            self._sources.pop(key, None)

    def describe(self) -> Iterable[Metric]:
        """Nothing: the registry then calls :meth:`collect` on each scrape only."""
        return ()

    def collect(self) -> Iterator[Metric]:
        """The families, one sample per rank (per outcome and reason, per kind)."""
        with self._lock:
            sources = list(self._sources.values())
        snaps = [snap for source in sources for snap in source()]
        for name, kind, attr, doc, sides in _SIMPLE:
            if kind == "counter":
                family: Metric = CounterMetricFamily(
                    PREFIX + name.removesuffix("_total"), doc, labels=LABELS
                )
            else:
                family = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            for snap in snaps:
                if _applies(snap, sides):
                    family.add_metric(_labels(snap), getattr(snap, attr))  # type: ignore[attr-defined]
            yield family
        rooms = CounterMetricFamily(
            PREFIX + "rooms_ended",
            "Rooms ended on a rank, by outcome and failure reason.",
            labels=(*LABELS, "outcome", "reason"),
        )
        control = CounterMetricFamily(
            PREFIX + "control_messages",
            "Authorised control messages the listener handed on, by frame-0 type.",
            labels=(*LABELS, "kind"),
        )
        latency = HistogramMetricFamily(
            PREFIX + "room_latency_seconds",
            _LATENCY_HELP,
            labels=LABELS,
        )
        for snap in snaps:
            labels = _labels(snap)
            for room in snap.rooms:
                rooms.add_metric([*labels, room.outcome, reason_label(room.reason)], room.count)
            for item in snap.control:
                control.add_metric([*labels, item.kind], item.count)
            cumulative, buckets = 0, []
            for bound, count in zip(
                (*LATENCY_BUCKETS_S, float("inf")), snap.latency_buckets, strict=True
            ):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            latency.add_metric(labels, buckets, snap.latency_sum_s)
        yield rooms
        yield control
        yield latency
