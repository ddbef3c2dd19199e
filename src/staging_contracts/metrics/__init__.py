"""Prometheus metrics of a staging rank, read from the library's own counters at scrape time.

:func:`snapshot_of` reads one manager's counters into a :class:`MetricsSnapshot` (a frozen,
typed record that also travels between processes as JSON); :func:`register` adds a collector
to a ``prometheus_client`` registry that takes such snapshots when scraped, so the hot path
does no metrics work at all. ``prometheus_client`` is the optional extra ``metrics``: only
:func:`register` and :mod:`.collector` need it. See ``docs/observability.md``.

May import: everything below backends, and backends.
Imported by: cluster, cli, and hosts that export metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .snapshot import (
    SCHEMA,
    ControlCount,
    MetricsSnapshot,
    RoomCount,
    snapshot_of,
)

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from ..backends.common import CommonKVManager
    from ..backends.kv_requests import PrefillTransfers
    from .collector import StagingCollector

__all__ = [
    "SCHEMA",
    "ControlCount",
    "MetricsSnapshot",
    "RoomCount",
    "register",
    "snapshot_of",
]


def register(
    manager: CommonKVManager,
    registry: CollectorRegistry | None = None,
    *,
    transfers: PrefillTransfers | None = None,
    role: str | None = None,
    rank: int | None = None,
    engine: str | None = None,
) -> StagingCollector:
    """Export ``manager``'s counters on ``registry`` (the default one unless given).

    Nothing is counted for the metrics: each scrape reads the counters the library keeps
    anyway (:func:`snapshot_of`). Call it once per manager, after the staging set-up
    (``enable_decode_staging`` / ``enable_prefill_staging``); on prefill pass the
    ``PrefillTransfers`` too, whose rooms are counted there.

    **Side:** either. **Called by:** the host, once, on any thread; the collector then runs on
    the thread that serves the scrape (``prometheus_client``'s HTTP thread), reading the
    counters without blocking the listener (the handler's lock is held for a copy only).

    Args:
        manager: the rank's manager (a ``CommonKVManager`` with its staging set up).
        registry: where to register; ``prometheus_client.REGISTRY`` if ``None``.
        transfers: the prefill side's ``PrefillTransfers`` (rooms ended, latency).
        role: the ``role`` label; the manager's role if ``None``.
        rank: the ``rank`` label; the manager's engine rank if ``None``.
        engine: the ``engine`` label; the engine's class name if ``None``.

    Returns:
        The collector (``registry.unregister(collector)`` removes it).

    Raises:
        ImportError: ``prometheus_client`` is not installed (``pip install
            staging-contracts[metrics]``).
    """
    from .collector import StagingCollector  # noqa: PLC0415 - the optional extra

    def read() -> list[MetricsSnapshot]:
        return [snapshot_of(manager, transfers=transfers, role=role, rank=rank, engine=engine)]

    collector = StagingCollector(read)
    if registry is None:
        from prometheus_client import REGISTRY  # noqa: PLC0415 - the optional extra

        registry = REGISTRY
    registry.register(collector)
    return collector
