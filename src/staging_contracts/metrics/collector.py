"""The ``prometheus_client`` collector: metric families built from snapshots at scrape time.

:class:`StagingCollector` asks its source for the current :class:`~.snapshot.MetricsSnapshot`
of every rank it serves (one for :func:`~staging_contracts.metrics.register`, the latest of
each rank for a driver's relay) and turns them into the families of :data:`SERIES`, each
sample labelled ``role``, ``rank`` and ``engine``. Needs the ``metrics`` extra.

**Threads:** :meth:`StagingCollector.collect` runs on the thread that serves the scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..stats import LATENCY_BUCKETS_S
from .snapshot import MetricsSnapshot

__all__ = ["LABELS", "PREFIX", "SERIES", "StagingCollector"]

PREFIX: Final = "staging_contracts_"
LABELS: Final = ("role", "rank", "engine")
"""The labels of every sample (``rooms_ended`` adds ``outcome`` and ``reason``,
``control_messages`` adds ``kind``)."""

_SIMPLE: Final = (
    # (name as exposed, type, snapshot field, help)
    ("staged_bytes_total", "counter", "staged_bytes", "Bytes prefill wrote into decode rings."),
    (
        "scattered_bytes_total",
        "counter",
        "scattered_bytes",
        "Ring bytes decode scattered into its KV pool.",
    ),
    ("chunks_total", "counter", "chunks", "Chunks staged (prefill) or scattered (decode)."),
    (
        "malformed_messages_total",
        "counter",
        "malformed",
        "Control messages the listener dropped as malformed.",
    ),
    (
        "unauthorized_messages_total",
        "counter",
        "unauthorized",
        "Control messages an authoriser refused.",
    ),
    (
        "dropped_messages_total",
        "counter",
        "dropped",
        "Well-formed staging messages dropped (no handler, unknown room or chunk).",
    ),
    (
        "peers_declared_dead_total",
        "counter",
        "peers_declared_dead",
        "Peers declared dead by the liveness check.",
    ),
    ("ring_bytes_in_use", "gauge", "ring_bytes_in_use", "Decode ring bytes assigned, not freed."),
    ("ring_capacity_bytes", "gauge", "ring_capacity_bytes", "Decode ring size in bytes."),
    (
        "fences_outstanding",
        "gauge",
        "fences_outstanding",
        "Rooms whose ring regions wait for fence answers.",
    ),
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


class StagingCollector(Collector):
    """Builds the staging series from ``source()``'s snapshots at each scrape.

    Args:
        source: returns the current snapshot of every rank to expose (called per scrape;
            it must not block for long: it runs on the scrape's thread).
    """

    def __init__(self, source: Callable[[], Iterable[MetricsSnapshot]]) -> None:
        self._source = source

    def describe(self) -> Iterable[Metric]:
        """Nothing: the registry then calls :meth:`collect` on each scrape only."""
        return ()

    def collect(self) -> Iterator[Metric]:
        """The families, one sample per rank (per outcome and reason, per kind)."""
        snaps = list(self._source())
        for name, kind, attr, doc in _SIMPLE:
            if kind == "counter":
                family: Metric = CounterMetricFamily(
                    PREFIX + name.removesuffix("_total"), doc, labels=LABELS
                )
            else:
                family = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            for snap in snaps:
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
            "Seconds from a room's first STAGING_REQ to its success.",
            labels=LABELS,
        )
        for snap in snaps:
            labels = _labels(snap)
            for room in snap.rooms:
                rooms.add_metric([*labels, room.outcome, room.reason], room.count)
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
