"""Mooncake transfer engine (``mooncake.engine.TransferEngine``): TCP here, RDMA on clusters.

Peers find each other by P2P handshake: no metadata server, a session id is
``"host:rpc_port"`` and the first write to a session connects to it. Arrival is not signalled
by this engine (``supports_notifications`` is ``False``): the caller sends ``CHUNK_READY`` over
its own ZMQ socket after ``write`` returned.

**Exposure.** Mooncake cannot be confined to ``host``: whatever address it is given, it
binds its P2P handshake listener to ``0.0.0.0`` and its TCP data listener to ``[::]`` (dual
stack), both on ports drawn from ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT`` (default
15000-17000); ``MC_TCP_BIND_ADDRESS`` only names the address advertised in metadata-server
mode. Whoever reaches the data port can read and write this engine's registered memory, with
no authentication. The engine lists the listeners Mooncake opened at start-up
(:attr:`MooncakeEngine.listening`) and warns about each one beyond ``host``; confine such a
process with a firewall or a network namespace (docs/security.md).

**Device memory.** The wheel the ``mooncake`` extra installs here,
``mooncake-transfer-engine-non-cuda``, is built without CUDA: it reads and writes host memory
only. :func:`host_memory_only` says so (from the installed distribution's name), and
``register`` refuses a range of CUDA device memory under such a build (:func:`is_cuda_memory`
asks the CUDA driver, where there is one) instead of letting the TCP transport read a device
address as a host one.

Requires the ``mooncake`` extra: ``pip install 'staging-contracts[mooncake]'``.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import logging
import threading
import time
from collections.abc import Sequence
from typing import Final

from mooncake.engine import TransferEngine as _NativeEngine

from ..protocols import Notification, Transfer, TransferError
from ._common import InflightGate, RegionTable, format_problems, transfer_problems
from ._netif import is_wildcard, resolve_host, unconfined, watch_listeners

__all__ = ["NON_CUDA_DISTRIBUTION", "MooncakeEngine", "host_memory_only", "is_cuda_memory"]

logger = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"
"""Mooncake's metadata-server setting for peer-to-peer handshakes (no etcd, no HTTP server)."""

_SPIN_S: Final = 50e-6
"""A single-range write polls without sleeping this long (short writes finish in it)."""
_MAX_SLEEP_S: Final = 1e-3
"""Longest sleep between two polls of a single-range write."""
_SECONDS_PER_BYTE: Final = 1e-9
"""Time a write may take per byte on top of ``write_timeout_s`` (1 GB/s, as Mooncake's own
synchronous calls allow)."""
_CLOSE_POLL_S: Final = 0.005
"""Pause between two looks at given-up writes while ``close`` waits for them."""

# Answers of ``transfer_check_status``. Mooncake frees the batch id when it answers DONE or
# FAILED, and only then: an id answered RUNNING or TIMED_OUT must be asked again until it
# ends, and an id must never be asked about after it was freed.
_DONE: Final = 1
_RUNNING: Final = 0
_FAILED: Final = -1
_TIMED_OUT: Final = -2
"""Mooncake's own timeout (RDMA, after ``MC_SLICE_TIMEOUT``): the batch still runs, and
its id is not freed."""


NON_CUDA_DISTRIBUTION: Final = "mooncake-transfer-engine-non-cuda"
"""The Mooncake wheel built without CUDA (host memory only)."""

_CU_POINTER_ATTRIBUTE_MEMORY_TYPE: Final = 2
_CU_MEMORYTYPE_DEVICE: Final = 2


@functools.cache
def host_memory_only() -> str | None:
    """Why the installed Mooncake cannot move CUDA device memory, in words; ``None`` where it
    may (a CUDA build, or one whose build cannot be told from its distribution).

    Read from the name of the distribution that installed the ``mooncake`` package:
    :data:`NON_CUDA_DISTRIBUTION` is built without CUDA. **Thread:** any (cached).
    """
    names = importlib.metadata.packages_distributions().get("mooncake", [])
    found = {name.lower().replace("_", "-") for name in names}
    if found and found <= {NON_CUDA_DISTRIBUTION}:
        return (
            f"the installed Mooncake wheel ({NON_CUDA_DISTRIBUTION}) is built without CUDA"
            " and moves host memory only"
        )
    return None


@functools.cache
def _cuda_driver() -> ctypes.CDLL | None:
    """The CUDA driver library, or ``None`` where there is none (no GPU driver installed)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    driver.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    driver.cuPointerGetAttribute.restype = ctypes.c_int
    return driver


def is_cuda_memory(ptr: int) -> bool:
    """Whether ``ptr`` is CUDA device memory, as the CUDA driver of this process sees it.

    ``False`` where there is no driver, where CUDA was never initialised in this process (no
    device memory can exist then), and for host memory, pinned or not. **Thread:** any.
    """
    driver = _cuda_driver()
    if driver is None:
        return False
    kind = ctypes.c_uint(0)
    status = driver.cuPointerGetAttribute(
        ctypes.byref(kind), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr
    )
    return status == 0 and kind.value == _CU_MEMORYTYPE_DEVICE


def _addresses_of(host: str) -> list[str]:
    """``host`` as a numeric address, in a list (empty when it does not resolve)."""
    try:
        return [resolve_host(host)]
    except OSError:
        return []


class MooncakeEngine:
    """A :class:`~staging_contracts.protocols.TransferEngine` over Mooncake.

    **Thread-safety:** every method may be called from any thread; ``write`` calls may run
    concurrently (Mooncake batches are independent). ``close`` waits for running writes.

    **Exposure:** Mooncake listens on every interface whatever ``host`` is (see the module
    docstring); the engine warns at start-up about each listener beyond ``host``.

    Args:
        host: Address peers reach this process at (its session id), e.g. ``"127.0.0.1"``
            for one machine or the NIC's address on a cluster. Mooncake's listeners do not
            bind it: they listen on every interface.
        protocol: Mooncake transport: ``"tcp"`` (default, works everywhere) or ``"rdma"``.
        device_name: RDMA device(s) for ``protocol="rdma"``, e.g. ``"mlx5_0"``; empty lets
            Mooncake discover the topology.
        close_timeout_s: How long ``close`` waits for running writes before it gives up
            and leaks the native engine rather than free it under them.
        write_timeout_s: How long ``write`` waits for completion (plus one second per GB)
            before it gives up.

    Raises:
        TransferError: Mooncake failed to initialize (bad host, transport unavailable).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        protocol: str = "tcp",
        device_name: str = "",
        close_timeout_s: float = 30.0,
        write_timeout_s: float = 30.0,
    ) -> None:
        native = _NativeEngine()
        with watch_listeners() as opened:
            status = native.initialize(host, P2P_HANDSHAKE, protocol, device_name)
        if status != 0:
            raise TransferError(
                f"mooncake failed to initialize on host {host!r} with protocol {protocol!r}"
                f" (device {device_name!r}): status {status}"
            )
        self._native: _NativeEngine | None = native
        self._session_id = f"{host}:{native.get_rpc_port()}"
        self._protocol = protocol
        self._close_timeout_s = close_timeout_s
        self._write_timeout_s = write_timeout_s
        self._stuck: dict[int, Transfer] = {}
        """Batches given up (at the write's deadline, or timed out by Mooncake) that Mooncake
        has not reported ended: batch id -> the range it reads. Each id stays here until
        ``transfer_check_status`` answers done or failed, which frees it."""
        self._lock = threading.Lock()
        self._regions = RegionTable()
        self._peers: set[str] = set()
        self._gate = InflightGate(f"mooncake engine {self._session_id!r}")
        self._listening = tuple(str(item) for item in sorted(opened))
        logger.info(
            "mooncake engine %s ready (protocol %s), listening on %s",
            self._session_id,
            protocol,
            ", ".join(self._listening) or "(unknown)",
        )
        exposed = [] if is_wildcard(host) else unconfined(opened, _addresses_of(host))
        if exposed:
            logger.warning(
                "mooncake engine %s listens beyond its host %r, on %s: Mooncake binds its"
                " handshake and TCP data listeners to every interface, and whoever reaches"
                " the data port can read and write the registered memory; confine this"
                " process with a firewall or a network namespace (docs/security.md)",
                self._session_id,
                host,
                ", ".join(map(str, exposed)),
            )

    def __repr__(self) -> str:
        state = "closed" if self._gate.closed else f"{len(self._regions)} regions"
        return f"MooncakeEngine({self._session_id!r}, {self._protocol!r}, {state})"

    @property
    def registered_regions(self) -> int:
        """Memory ranges registered now (0 after every ``deregister`` and after ``close``)."""
        return len(self._regions)

    @property
    def unfinished_writes(self) -> int:
        """Ranges of writes given up (timed out) that Mooncake had not reported ended when
        last asked: their source memory is still read, and their batch ids are freed once
        they end (asked at every ``write`` and while ``close`` waits)."""
        with self._lock:
            return len(self._stuck)

    @property
    def listening(self) -> tuple[str, ...]:
        """The TCP listeners Mooncake opened at start-up, as ``"address:port"`` (IPv6 in
        brackets), sorted; empty where ``/proc`` cannot be read."""
        return self._listening

    @property
    def session_id(self) -> str:
        """``"host:rpc_port"``, as Mooncake names this engine's segment."""
        return self._session_id

    @property
    def supports_notifications(self) -> bool:
        """Always ``False``: signal arrival separately (``CHUNK_READY``) after ``write``."""
        return False

    def metadata(self) -> bytes:
        """The session id, UTF-8 encoded: the P2P handshake needs nothing else."""
        return self._session_id.encode()

    def add_peer(self, session_id: str, metadata: bytes) -> None:
        """Accept ``session_id`` as a target of ``write`` (idempotent).

        Nothing is sent: Mooncake connects on the first write to a session.

        Raises:
            ValueError: ``metadata`` is not that peer's ``metadata()``.
            TransferError: the engine is closed.
        """
        if metadata != session_id.encode():
            raise ValueError(
                f"metadata {metadata!r} does not belong to mooncake session {session_id!r}"
            )
        with self._gate.entered(), self._lock:
            self._peers.add(session_id)

    def register(self, ptr: int, length: int) -> None:
        """Register ``[ptr, ptr + length)`` (host or, with RDMA, device memory) with Mooncake.

        **Blocking:** for the registration (milliseconds; RDMA pins pages). Registering the
        same range again does nothing.

        Raises:
            ValueError: bad address or length, or ``ptr`` is registered with another length.
            TransferError: Mooncake refused the registration, the engine is closed, or the
                range is CUDA device memory and this Mooncake build moves host memory only
                (:func:`host_memory_only`).
        """
        reason = host_memory_only()
        if reason is not None and is_cuda_memory(ptr):
            raise TransferError(
                f"mooncake engine {self._session_id!r} cannot register [{ptr:#x},"
                f" {ptr + length:#x}): it is CUDA device memory, and {reason}; keep the"
                " memory on the CPU, or use an engine that moves GPU memory (nixl)"
            )
        with self._gate.entered(), self._lock:
            if not self._regions.add(ptr, length):
                return
            status = self._require().register_memory(ptr, length)
            if status != 0:
                self._regions.remove(ptr)
                raise TransferError(
                    f"mooncake engine {self._session_id!r} failed to register"
                    f" [{ptr:#x}, {ptr + length:#x}): status {status}"
                )

    def deregister(self, ptr: int) -> None:
        """Unregister the range registered at ``ptr`` (unknown addresses are ignored).

        A failure is logged, not raised: the range is forgotten either way.
        """
        with self._lock:
            if self._regions.remove(ptr) is None or self._native is None:
                return
            status = self._native.unregister_memory(ptr)
        if status != 0:
            logger.warning(
                "mooncake engine %s failed to unregister %#x: status %d",
                self._session_id,
                ptr,
                status,
            )

    def write(self, peer: str, transfers: Sequence[Transfer], notify: bytes | None = None) -> None:
        """Write every transfer into ``peer``'s memory.

        Local ranges are checked here (Mooncake's TCP transport would read any address);
        remote ranges are checked by the peer, which fails the ranges outside its memory.

        Each range is submitted asynchronously as a Mooncake batch of its own, and all are
        polled together, with sleeps that grow to 1 ms, so the waiting thread leaves the CPU
        to Mooncake's own threads (Mooncake's synchronous calls spin on the status for the
        whole transfer). Every batch id is freed exactly once: Mooncake frees it when it
        reports the batch done or failed; a batch given up before that (at the deadline, or
        timed out by Mooncake itself) is kept and asked again at later writes and at
        ``close`` until it ends.

        **Blocking:** until Mooncake reports every range ended; the source memory may be
        reused then. Gives up after ``write_timeout_s`` (plus one second per GB); the
        ranges still running then, and any Mooncake timed out, count as in use until
        Mooncake reports them ended.

        Raises:
            ValueError: ``notify`` was given (this engine has no notifications).
            TransferError: ``peer`` was not added, a local range lies outside registered
                memory or is still read by a write given up earlier, the engine is closed,
                the write timed out, or Mooncake reported a failure (unreachable peer,
                remote range not registered there); nothing is known about the bytes.
        """
        if notify is not None:
            raise ValueError(
                "the mooncake engine does not deliver notifications; signal arrival separately"
            )
        if not transfers:
            return
        with self._gate.entered():
            with self._lock:
                if peer not in self._peers:
                    raise TransferError(
                        f"unknown peer {peer!r} of mooncake engine {self._session_id!r};"
                        " call add_peer first"
                    )
                problems = transfer_problems(transfers, local=self._regions, remote=None)
            if problems:
                raise TransferError(
                    format_problems(
                        f"mooncake engine {self._session_id!r} cannot write to {peer!r}:",
                        problems,
                    )
                )
            status = self._write_all(self._require(), peer, transfers)
        if status != 0:
            logger.debug("mooncake write to %s failed: status %d", peer, status)
            cause = (
                "Mooncake's transfer timeout; the source stays in use until the write ends"
                if status == _TIMED_OUT
                else "peer unreachable, or a remote range not registered there"
            )
            raise TransferError(
                f"mooncake engine {self._session_id!r} failed to write {len(transfers)}"
                f" transfers ({sum(t.length for t in transfers)} bytes) to {peer!r}:"
                f" status {status} ({cause})"
            )

    def poll_notifications(self) -> list[Notification]:
        """Always empty: this engine delivers no notifications."""
        return []

    def close(self) -> None:
        """Unregister all memory and release the native engine; safe to call twice.

        **Blocking:** waits up to ``close_timeout_s`` in all for running writes, then for
        writes given up earlier that Mooncake still runs (each one's batch id is freed as it
        ends). If some still run after that, the native engine is leaked (logged) rather
        than freed under them.
        """
        deadline = time.monotonic() + self._close_timeout_s
        drained = self._gate.close(self._close_timeout_s)
        if drained is None:
            return
        running = self._await_stuck(deadline) if drained else len(self._stuck)
        with self._lock:
            native, regions = self._native, self._regions.clear()
            self._peers.clear()
            if not drained or running:
                logger.error(
                    "mooncake engine %s closed with writes still running (%s); leaking it",
                    self._session_id,
                    f"{running} given up earlier" if drained else "a write call has not returned",
                )
                return
            self._native = None
        if native is None:
            return
        if regions:
            status = native.batch_unregister_memory([ptr for ptr, _ in regions])
            if status != 0:
                logger.warning(
                    "mooncake engine %s failed to unregister %d regions: status %d",
                    self._session_id,
                    len(regions),
                    status,
                )
        del native
        logger.info("mooncake engine %s closed", self._session_id)

    def _write_all(self, native: _NativeEngine, peer: str, transfers: Sequence[Transfer]) -> int:
        """Submit every range as a batch of its own and poll them all to the end, or to the
        deadline; Mooncake's status (0 on success, else the first failure's).

        Raises:
            TransferError: a range is still read by a write given up earlier, or the
                deadline passed (the batches still running are kept in ``_stuck``).
        """
        self._reap_stuck(native, transfers)
        running: dict[int, Transfer] = {}
        status = 0
        try:
            for index, transfer in enumerate(transfers):
                batch = native.transfer_submit_write(
                    peer, transfer.local, transfer.remote, transfer.length
                )
                if batch <= 0:
                    # Submission failed (peer unreachable?): the synchronous call checks the
                    # peer's segment and drops a dead connection, so the next write
                    # reconnects; Mooncake allocates and frees that call's batch itself.
                    rest = transfers[index:]
                    status = native.batch_transfer_sync_write(
                        peer,
                        [t.local for t in rest],
                        [t.remote for t in rest],
                        [t.length for t in rest],
                    )
                    break
                running[batch] = transfer
            status = self._await(native, peer, transfers, running) or status
        finally:
            if running:  # only on an exception: keep every id still running, to free later
                with self._lock:
                    self._stuck.update(running)
        return status

    def _await(
        self,
        native: _NativeEngine,
        peer: str,
        transfers: Sequence[Transfer],
        running: dict[int, Transfer],
    ) -> int:
        """Poll the ``running`` batches until each ended (removing it), or the deadline.

        A batch Mooncake times out leaves ``running`` for ``_stuck``: it still runs.

        Returns:
            0 if every batch completed, else the first failure's status.

        Raises:
            TransferError: the deadline passed; the batches still running stay in
                ``running`` (the caller keeps them).
        """
        total = sum(t.length for t in transfers)
        now = time.monotonic()
        limit = self._write_timeout_s + total * _SECONDS_PER_BYTE
        deadline = now + limit
        spin_until = now + _SPIN_S
        pause = 0.0
        status = 0
        while running:
            for batch in list(running):
                state = native.transfer_check_status(batch)
                if state == _RUNNING:
                    continue
                transfer = running.pop(batch)
                if state == _TIMED_OUT:  # Mooncake gave up waiting; the id is not freed
                    with self._lock:
                        self._stuck[batch] = transfer
                if state != _DONE:
                    status = status or state
            if not running:
                break
            now = time.monotonic()
            if now > deadline:
                count = len(running)
                ranges = (
                    "its source range stays" if count == 1 else f"its {count} source ranges stay"
                )
                raise TransferError(
                    f"mooncake write of {total} bytes to {peer!r} timed out after"
                    f" {limit:.1f} s; {ranges} in use until Mooncake reports it ended"
                )
            if now > spin_until:
                pause = min(_MAX_SLEEP_S, pause * 2 or 1e-5)
                time.sleep(pause)
        return status

    def _reap_stuck(self, native: _NativeEngine, transfers: Sequence[Transfer] = ()) -> None:
        """Forget given-up writes that ended (which frees their batch ids); refuse to read a
        range one still reads.

        Raises:
            TransferError: a range of ``transfers`` is still read by a given-up write.
        """
        with self._lock:
            for batch, earlier in list(self._stuck.items()):
                if native.transfer_check_status(batch) in (_DONE, _FAILED):
                    del self._stuck[batch]  # ended, and Mooncake freed the id
                    continue
                for transfer in transfers:
                    if (
                        earlier.local < transfer.local + transfer.length
                        and transfer.local < earlier.local + earlier.length
                    ):
                        raise TransferError(
                            f"mooncake engine {self._session_id!r}: source range"
                            f" [{transfer.local:#x}, {transfer.local + transfer.length:#x})"
                            " is still read by a write that timed out"
                        )

    def _await_stuck(self, deadline: float) -> int:
        """Wait until every given-up write ended (freeing its id) or ``deadline``; how many
        still run then. Called by ``close`` once no ``write`` runs."""
        native = self._native
        if native is None:
            return 0
        while True:
            self._reap_stuck(native)
            with self._lock:
                running = len(self._stuck)
            if not running or time.monotonic() >= deadline:
                return running
            time.sleep(_CLOSE_POLL_S)

    def _require(self) -> _NativeEngine:
        native = self._native
        if native is None:
            raise TransferError(f"mooncake engine {self._session_id!r} is closed")
        return native
