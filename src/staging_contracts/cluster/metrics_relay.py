"""``--metrics-port``: every rank's counters, relayed to the driver and served on loopback.

A rank process sends a ``metrics`` event with its :class:`~staging_contracts.metrics.
MetricsSnapshot` (as JSON) every :data:`REPORT_EVERY_S` to the driver's inbox: a soak rank
from its command loop (:class:`RankReporter` says when one is due), a demo rank from a
thread of its own with a socket of its own (:class:`MetricsPusher`: the demo rank's main
thread alone uses its report socket). The driver keeps the latest snapshot
of each ``(role, rank)`` in a :class:`MetricsRelay`, whose collector serves them all at
``http://127.0.0.1:PORT/metrics``, labelled ``role``, ``rank`` and ``engine``. A rank that
restarts starts its counters again from zero (Prometheus reads that as a counter reset).

**Threads:** :meth:`MetricsRelay.update` on the driver's thread, the scrape on
``prometheus_client``'s HTTP server thread (a lock guards the latest snapshots).
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Final

import zmq

from ..metrics import MetricsSnapshot, snapshot_of
from ._messages import Metrics, encode

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from ..backends.common import CommonKVManager
    from ..backends.kv_requests import PrefillTransfers

__all__ = [
    "REPORT_EVERY_S",
    "MetricsPusher",
    "MetricsRelay",
    "RankReporter",
    "add_metrics_port_argument",
    "serving",
]

logger = logging.getLogger(__name__)

REPORT_EVERY_S: Final = 1.0
"""Seconds between two ``metrics`` events of a rank."""


class RankReporter:
    """When a rank's next ``metrics`` event is due (every :data:`REPORT_EVERY_S`).

    **Threads:** the rank's main loop only.
    """

    def __init__(self, every_s: float = REPORT_EVERY_S) -> None:
        self.every_s = every_s
        self._last = float("-inf")

    def due(self, now: float) -> bool:
        """Whether one is due at ``now`` (``time.monotonic()``); if so, the clock restarts."""
        if now - self._last < self.every_s:
            return False
        self._last = now
        return True


class MetricsPusher:
    """A rank's thread that sends its snapshot to the driver every ``every_s``, and once more
    when stopped, over a PUSH socket it opens, uses and closes itself.

    **Threads:** :meth:`start` and :meth:`stop` on the rank's main thread; the sends on the
    pusher's own (a daemon); every send is bounded (``SNDTIMEO``), a lost one is logged.

    Args:
        ctx: the process's ZMQ context.
        endpoint: the driver's inbox (``tcp://127.0.0.1:port``).
        role: the rank's role (the event's and the series' ``role``).
        rank: its rank number.
        engine: the ``engine`` label (the backend spec).
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        role: str,
        rank: int,
        engine: str,
        every_s: float = REPORT_EVERY_S,
    ) -> None:
        self._ctx = ctx
        self._endpoint = endpoint
        self._labels = (role, rank, engine)
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, manager: CommonKVManager, transfers: PrefillTransfers | None = None) -> None:
        """Start sending ``manager``'s counters (``transfers``: prefill's rooms and bytes)."""
        role, rank, engine = self._labels

        def read() -> MetricsSnapshot:
            return snapshot_of(manager, transfers=transfers, role=role, rank=rank, engine=engine)

        self._thread = threading.Thread(
            target=self._run, args=(read,), name=f"metrics-{role}-{rank}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send the last snapshot and end the thread (bounded); safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self, read: Callable[[], MetricsSnapshot]) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDTIMEO, 1000)
        try:
            sock.connect(self._endpoint)
            while True:
                stopping = self._stop.wait(self._every_s)
                try:
                    sock.send(encode(Metrics(read()), self._labels[0], self._labels[1]))
                except zmq.ZMQError as exc:  # the driver takes none now: the next one goes
                    logger.warning("metrics snapshot not sent: %s", exc)
                except Exception:  # a counter that could not be read: the rank goes on
                    logger.exception("metrics snapshot failed")
                if stopping:
                    return
        finally:
            sock.close()


class MetricsRelay:
    """The latest snapshot of each rank, and the HTTP server that exposes them.

    **Thread-safety:** any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[tuple[str, int], MetricsSnapshot] = {}
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        """The port served on (``None`` until :meth:`serve`)."""

    def update(self, snapshot: MetricsSnapshot) -> None:
        """Keep ``snapshot`` as its rank's latest. **Called by:** the driver, per event."""
        with self._lock:
            self._latest[(snapshot.role, snapshot.rank)] = snapshot

    def snapshots(self) -> list[MetricsSnapshot]:
        """The latest snapshot of every rank heard from, by role and rank."""
        with self._lock:
            return [self._latest[key] for key in sorted(self._latest)]

    def serve(self, port: int) -> None:
        """Serve the snapshots at ``http://127.0.0.1:port/metrics`` (loopback only), on a
        registry of their own, from a daemon thread.

        Raises:
            ImportError: ``prometheus_client`` is not installed (the ``metrics`` extra).
            OSError: the port cannot be bound.
        """
        from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415

        from ..metrics.collector import StagingCollector  # noqa: PLC0415 - the extra

        registry = CollectorRegistry()
        registry.register(StagingCollector(self.snapshots))
        try:
            server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on 127.0.0.1:{port}: {exc}") from exc
        self._server, self._thread = server, thread
        self.port = server.server_port

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the HTTP server (bounded); safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout_s)


@contextmanager
def serving(port: int | None) -> Iterator[MetricsRelay | None]:
    """A relay serving on ``port`` for the block (``None``: no relay, nothing served)."""
    if port is None:
        yield None
        return
    relay = MetricsRelay()
    relay.serve(port)
    try:
        yield relay
    finally:
        relay.close()


def add_metrics_port_argument(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port PORT`` (for ``demo`` and ``soak``)."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help=(
            "serve every rank's Prometheus metrics at http://127.0.0.1:PORT/metrics while "
            "running (needs the 'metrics' extra: prometheus-client)"
        ),
    )
