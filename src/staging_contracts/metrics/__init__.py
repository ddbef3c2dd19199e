"""Prometheus metrics of a staging rank, read from the library's own counters at scrape time.

:func:`snapshot_of` reads one manager's counters into a :class:`MetricsSnapshot` (a frozen,
typed record that also travels between processes as JSON); :func:`register` adds a collector
to a ``prometheus_client`` registry that takes such snapshots when scraped, so the hot path
does no metrics work at all. ``prometheus_client`` is the optional extra ``metrics``: only
:func:`register` and :mod:`.collector` need it. See ``docs/observability.md``.

May import: everything below backends, and backends.
Imported by: _cluster, cli, and hosts that export metrics.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Final

from ._snapshot import (
    ControlCount,
    MetricsSnapshot,
    RoomCount,
    engine_name,
    snapshot_of,
)

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from ..backends._common import CommonKVManager
    from ..backends._kv_requests import PrefillTransfers
    from ._collector import StagingCollector

__all__ = [
    "ControlCount",
    "MetricsSnapshot",
    "RoomCount",
    "engine_name",
    "register",
    "snapshot_of",
]

INSTALL_HINT: Final = "pip install 'staging-contracts[metrics]'"
"""How to install what :func:`register` needs."""

_lock = threading.Lock()
_collectors: weakref.WeakKeyDictionary[object, StagingCollector] = weakref.WeakKeyDictionary()
"""Registry -> its one staging collector (every manager registered there shares it)."""


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
    (``enable_decode_staging`` / ``enable_prefill_staging``) and, on prefill, after the
    ``PrefillTransfers`` were made (its rooms are counted there: found from the manager when
    ``transfers`` is not given). Several managers may share a registry: it gets one collector
    that exports one family per series, a sample per manager (registering a manager again
    replaces its labels).

    **Side:** either. **Called by:** the host, once, on any thread; the collector then runs on
    the thread that serves the scrape (``prometheus_client``'s HTTP thread), reading the
    counters without blocking the listener (the handler's lock is held for a copy only).

    Args:
        manager: the rank's manager (a ``CommonKVManager`` with its staging set up).
        registry: where to register; ``prometheus_client.REGISTRY`` if ``None``.
        transfers: the prefill side's ``PrefillTransfers`` (rooms ended, latency).
        role: the ``role`` label; the manager's role if ``None``.
        rank: the ``rank`` label; the manager's engine rank if ``None``.
        engine: the ``engine`` label; the engine's name (``"local"``, ``"mooncake"``,
            ``"nixl"``, as the CLI's relay labels it) if ``None``.

    Returns:
        The registry's staging collector, shared by the managers registered there
        (``collector.remove(manager)`` stops exporting one).

    Raises:
        ImportError: ``prometheus_client`` is not installed (the message says
            ``pip install 'staging-contracts[metrics]'``).
        ValueError: a prefill manager with no ``transfers`` given and no ``PrefillTransfers``
            made for it yet (its rooms and latency would never be exported).
    """
    try:
        from ._collector import StagingCollector  # noqa: PLC0415 - the optional extra
    except ImportError as exc:
        raise ImportError(
            f"staging_contracts.metrics.register needs prometheus_client: {INSTALL_HINT}"
        ) from exc
    if transfers is None and manager.role.value == "prefill":
        transfers = _transfers_of(manager)

    def read() -> list[MetricsSnapshot]:
        return [snapshot_of(manager, transfers=transfers, role=role, rank=rank, engine=engine)]

    if registry is None:
        from prometheus_client import REGISTRY  # noqa: PLC0415 - the optional extra

        registry = REGISTRY
    with _lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = _collectors[registry] = StagingCollector()
            registry.register(collector)
        collector.add(manager, read)
    return collector


def _transfers_of(manager: CommonKVManager) -> PrefillTransfers:
    """The ``PrefillTransfers`` made for a prefill manager (it joined the drain gate)."""
    from ..backends._kv_requests import PrefillTransfers  # noqa: PLC0415 - prefill only

    found = [book for book in manager.drain_gate.books if isinstance(book, PrefillTransfers)]
    if len(found) != 1:
        raise ValueError(
            f"register(prefill manager): {len(found)} PrefillTransfers made for it; make them "
            "first or pass transfers= (a prefill's rooms and latency are counted there)"
        )
    return found[0]
