"""``--metrics-port``: every rank's counters, relayed to the driver and served on loopback.

A rank process sends a ``metrics`` event with its :class:`~staging_contracts.metrics.
MetricsSnapshot` (as JSON) every :data:`REPORT_EVERY_S` to the driver's inbox: a soak rank
from its command loop (a ``soak_ticker.Ticker`` says when one is due), a demo rank from a
thread of its own with a socket of its own (:class:`MetricsPusher`: the demo rank's main
thread alone uses its report socket). The driver keeps the latest snapshot of each
``(role, rank)`` in a :class:`MetricsRelay`, whose collector serves them all at
``http://127.0.0.1:PORT/metrics``, labelled ``role``, ``rank`` and ``engine``. A rank that
restarts starts its counters again from zero (Prometheus reads that as a counter reset).

Whether each rank is alive is served too: ``staging_contracts_rank_up`` is 1 while its
snapshots arrive, 0 once none came for :data:`STALE_AFTER_S` (its last values are still
served, marked so) or once the driver knows it dead (:meth:`MetricsRelay.mark_dead`: a kill,
or a process that exited; its other series are dropped, so that a dead rank's last values
are not read as current). A new snapshot of that rank (its new process) brings it back.

**Threads:** :meth:`MetricsRelay.update` on the driver's thread, the scrape on
``prometheus_client``'s HTTP server thread (a lock guards the latest snapshots).
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Final

import zmq

from .._run._codec import encode
from ..metrics import MetricsSnapshot, snapshot_of
from ._messages import Metrics

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.core import Metric

    from ..backends._common import CommonKVManager
    from ..backends._kv_requests import PrefillTransfers


logger = logging.getLogger(__name__)

REPORT_EVERY_S: Final = 1.0
"""Seconds between two ``metrics`` events of a rank."""
STALE_AFTER_S: Final = 3.0
"""A rank whose last snapshot is older than this is served with ``rank_up`` 0 (three
missed reports)."""
UP_SERIES: Final = "staging_contracts_rank_up"
"""The gauge: 1 while a rank's snapshots arrive, 0 once it is stale or known dead."""
METRICS_EXTRA_HINT: Final = (
    "--metrics-port needs prometheus-client: pip install 'staging-contracts[metrics]'"
)


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

    def __init__(
        self, *, stale_after_s: float = STALE_AFTER_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._lock = threading.Lock()
        self._latest: dict[tuple[str, int], MetricsSnapshot] = {}
        self._heard: dict[tuple[str, int], float] = {}
        """When each rank's latest snapshot came (``clock``)."""
        self._dead: set[tuple[str, int]] = set()
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        """The port served on (``None`` until :meth:`serve`)."""

    def update(self, snapshot: MetricsSnapshot) -> None:
        """Keep ``snapshot`` as its rank's latest. **Called by:** the driver, per event."""
        key = (snapshot.role, snapshot.rank)
        with self._lock:
            self._latest[key] = snapshot
            self._heard[key] = self._clock()
            self._dead.discard(key)

    def mark_dead(self, role: str, rank: int) -> None:
        """The rank's process is gone (killed, or exited): serve ``rank_up`` 0 and drop its
        other series until a new snapshot of it comes. **Called by:** the driver."""
        with self._lock:
            self._dead.add((role, rank))

    def up(self) -> dict[tuple[str, int], bool]:
        """Every rank heard from -> whether it is up (not known dead, heard from within
        ``stale_after_s``)."""
        now = self._clock()
        with self._lock:
            return {
                key: key not in self._dead and now - self._heard[key] <= self._stale_after_s
                for key in sorted(self._latest)
            }

    def served(self) -> list[MetricsSnapshot]:
        """The snapshots the scrape serves: every rank heard from but those known dead."""
        with self._lock:
            return [self._latest[key] for key in sorted(self._latest) if key not in self._dead]

    def snapshots(self) -> list[MetricsSnapshot]:
        """The latest snapshot of every rank heard from, by role and rank (a dead one's
        included: the last thing it said)."""
        with self._lock:
            return [self._latest[key] for key in sorted(self._latest)]

    def serve(self, port: int) -> None:
        """Serve the snapshots at ``http://127.0.0.1:port/metrics`` (loopback only), on a
        registry of their own, from a daemon thread.

        Raises:
            ImportError: ``prometheus_client`` is not installed (the ``metrics`` extra).
            OSError: the port cannot be bound.
        """
        try:
            from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415
        except ImportError as exc:
            raise ImportError(METRICS_EXTRA_HINT) from exc

        from ..metrics._collector import StagingCollector  # noqa: PLC0415 - the extra

        registry = CollectorRegistry()
        registry.register(StagingCollector(self.served))
        registry.register(self)  # collect(): the rank_up gauge
        try:
            server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on 127.0.0.1:{port}: {exc}") from exc
        self._server, self._thread = server, thread
        self.port = server.server_port

    def collect(self) -> Iterable[Metric]:
        """``staging_contracts_rank_up`` of every rank heard from. **Called by:** the scrape
        (``prometheus_client``'s thread)."""
        from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415 - the extra

        family = GaugeMetricFamily(
            UP_SERIES,
            "1 while the rank's snapshots reach the driver; 0 once it is known dead or "
            f"silent for {STALE_AFTER_S:g} s.",
            labels=("role", "rank", "engine"),
        )
        engines = {(s.role, s.rank): s.engine for s in self.snapshots()}
        for (role, rank), alive in self.up().items():
            family.add_metric([role, str(rank), engines.get((role, rank), "")], 1 if alive else 0)
        return [family]

    @property
    def url(self) -> str | None:
        """``http://127.0.0.1:PORT/metrics`` once serving (the real port when 0 was asked)."""
        return None if self.port is None else f"http://127.0.0.1:{self.port}/metrics"

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


def metrics_port(text: str) -> int:
    """``--metrics-port``'s value: a port number, 0..65535 (0: any free port).

    Raises:
        argparse.ArgumentTypeError: not a whole number in that range (a usage error).
    """
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0..65535)")
    return port


def check_metrics_available() -> None:
    """Refuse ``--metrics-port`` without the ``metrics`` extra, before any process starts.

    Raises:
        ValueError: :data:`METRICS_EXTRA_HINT`.
    """
    try:
        import prometheus_client  # noqa: F401, PLC0415 - only whether it imports
    except ImportError:
        raise ValueError(METRICS_EXTRA_HINT) from None


def add_metrics_port_argument(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port PORT`` (for ``demo`` and ``soak``)."""
    parser.add_argument(
        "--metrics-port",
        type=metrics_port,
        default=None,
        metavar="PORT",
        help=(
            "serve every rank's Prometheus metrics at http://127.0.0.1:PORT/metrics while "
            "running, 0 for any free port (the URL is printed once serving; needs the "
            "'metrics' extra: pip install 'staging-contracts[metrics]')"
        ),
    )
