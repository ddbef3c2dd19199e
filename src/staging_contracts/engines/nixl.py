"""NIXL transfer engine: a NIXL agent with the UCX backend, writes carry the notification.

**Progress.** The agent runs without NIXL's progress thread (on a small host it spins a
whole core per agent and slows a write round trip a thousandfold). So nothing moves
unless someone drives the agent: the writer does while ``write`` waits for completion; the
**receiving side must call** :meth:`NixlEngine.poll_notifications` (or
:meth:`NixlEngine.progress`) **regularly**, e.g. from its listener loop, for as long as peers
may write to it. Over transports that need the target (``UCX_TLS=tcp``, connection set-up)
a write waits until the receiver polls; unread notifications pile up in the agent until
polled. Local processes use UCX's kernel copy (CMA), which needs no target progress;
``UCX_TLS=tcp`` is the nearest stand-in for a network here.

**Shutdown.** Call :meth:`NixlEngine.close` before the process exits. On hosts that have the
system's ibverbs providers installed next to NIXL's bundled ``libibverbs``, a process that
loaded UCX's InfiniBand modules crashes (SIGSEGV in ``libnl-route``'s destructor) at exit,
whatever was released; ``load_ib_modules=False`` avoids it where there is no RDMA NIC.

**Exposure.** UCX's TCP transport listens on one address of each network device it uses
(by default every interface: the NIC's address and ``127.0.0.1``). ``host=`` confines it to
the interface holding that address (UCX's ``NET_DEVICES`` and ``TCP_AF_PRIO``, set for this
agent only, see :func:`ucx_confinement`); a ``UCX_NET_DEVICES`` in the environment is an
explicit setting and wins, as NIXL lets every ``UCX_*`` variable win. Since ``NET_DEVICES``
names every network device UCX may use, RDMA hosts list their HCA ports there themselves
(``UCX_NET_DEVICES=eth0,mlx5_0:1``). At start-up the engine lists the TCP listeners the
agent opened (:attr:`NixlEngine.listening`) and warns about each one beyond ``host`` (beyond
``UCX_NET_DEVICES``' interfaces); when neither is given it says (at ``INFO``) where beyond
loopback UCX listens.

Requires the ``nixl`` extra: ``pip install 'staging-contracts[nixl]'``.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Final, Literal, NamedTuple, TypeVar

from ..protocols import Notification, Transfer, TransferError
from ._common import InflightGate, RegionTable, format_problems, transfer_problems
from ._netif import (
    ListeningSocket,
    interface_addresses,
    interface_of,
    is_wildcard,
    resolve_host,
    unconfined,
    watch_listeners,
)

if TYPE_CHECKING:
    from nixl_cu12 import _api as nixl_api
    from nixl_cu12 import _bindings as nixl_bindings
else:
    # Importing NIXL runs logging.config.dictConfig, which also turns off
    # logging.raiseExceptions for the whole process; keep the process's own setting.
    _raise_exceptions = logging.raiseExceptions
    try:
        from nixl_cu12 import _api as nixl_api
        from nixl_cu12 import _bindings as nixl_bindings
    except ImportError as cu12_error:
        try:
            from nixl import _api as nixl_api
            from nixl import _bindings as nixl_bindings
        except ImportError:
            raise ImportError(
                f"neither nixl_cu12 nor nixl can be imported ({cu12_error})", name="nixl_cu12"
            ) from cu12_error
    finally:
        logging.raiseExceptions = _raise_exceptions

__all__ = ["NixlEngine", "memory_kind", "ucx_confinement"]

logger = logging.getLogger(__name__)

MemKind = Literal["DRAM", "VRAM"]
_T = TypeVar("_T")

_NIXL_ERRORS: Final[tuple[type[Exception], ...]] = (
    nixl_bindings.nixlBackendError,
    nixl_bindings.nixlCancelledError,
    nixl_bindings.nixlInvalidParamError,
    nixl_bindings.nixlMismatchError,
    nixl_bindings.nixlNotAllowedError,
    nixl_bindings.nixlNotFoundError,
    nixl_bindings.nixlNotPostedError,
    nixl_bindings.nixlNotSupportedError,
    nixl_bindings.nixlRemoteDisconnectError,
    nixl_bindings.nixlRepostActiveError,
    nixl_bindings.nixlUnknownError,
)
_START_ERRORS: Final[tuple[type[Exception], ...]] = (*_NIXL_ERRORS, RuntimeError)
_HEADER: Final = struct.Struct("<4sBBI")  # magic, version, memory kind, device id
_MAGIC: Final = b"SCNX"
_KINDS: Final[tuple[MemKind, ...]] = ("DRAM", "VRAM")
_SPIN_S: Final = 50e-6
_MAX_SLEEP_S: Final = 1e-3


def memory_kind(device: str) -> tuple[MemKind, int]:
    """NIXL's memory type and device id of memory on a torch device (``str(tensor.device)``).

    ``"cpu"`` is host memory (``("DRAM", 0)``); ``"cuda:N"`` is GPU ``N``'s memory
    (``("VRAM", N)``). A bare ``"cuda"`` is refused: it means whichever GPU is current, and
    registering another GPU's id than the memory's would fail or misdirect transfers.

    Raises:
        ValueError: another device type, a bare ``"cuda"`` or a malformed index.
    """
    kind, sep, index = device.partition(":")
    if kind == "cpu" and not sep:
        return "DRAM", 0
    if kind == "cuda" and index.isdigit():
        return "VRAM", int(index)
    raise ValueError(
        f"device {device!r}: NIXL registers 'cpu' (DRAM) or 'cuda:N' (VRAM of GPU N) memory"
    )


_NET_DEVICES_ENV: Final = "UCX_NET_DEVICES"
_LOOPBACK: Final = ("127.0.0.1", "::1")
_UNTOLD: Final = "no host= and no UCX_NET_DEVICES"


def ucx_confinement(host: str) -> dict[str, str]:
    """The UCX settings that confine UCX's TCP transport to the interface holding ``host``.

    Names are without the ``UCX_`` prefix: ``{"NET_DEVICES": <interface>, "TCP_AF_PRIO":
    "inet" | "inet6"}``; empty for a wildcard ``host`` (``0.0.0.0``, ``::``). Prefix them
    with ``UCX_`` to set them in a process's environment before its first agent starts.

    Raises:
        TransferError: ``host`` does not resolve, or no interface of this host holds it.
    """
    try:
        address = resolve_host(host)
        if is_wildcard(address):
            return {}
        name = interface_of(address)
    except OSError as exc:
        raise TransferError(f"cannot find the network interface of {host!r}: {exc}") from exc
    if name is None:
        raise TransferError(f"no network interface of this host holds {host!r}")
    return {"NET_DEVICES": name, "TCP_AF_PRIO": "inet6" if ":" in address else "inet"}


def _allowed_addresses(host: str | None) -> tuple[list[str] | None, str]:
    """Where the agent's listeners may be (``None``: anywhere) and why, in words."""
    if host is not None:
        if is_wildcard(host):
            return None, "host is a wildcard"
        try:
            return [resolve_host(host)], f"host {host!r}"
        except OSError:
            return [], f"host {host!r}"
    devices = os.environ.get(_NET_DEVICES_ENV)
    if devices is None:
        return list(_LOOPBACK), _UNTOLD
    names = {entry.strip() for entry in devices.split(",")}
    if "all" in names:
        return None, f"{_NET_DEVICES_ENV}=all"
    try:
        interfaces = interface_addresses()
    except OSError:
        return None, "the interfaces cannot be listed"
    allowed = [a for name, addresses in interfaces.items() if name in names for a in addresses]
    return allowed, f"{_NET_DEVICES_ENV}={devices}"


class _Peer(NamedTuple):
    metadata: bytes
    mem_type: MemKind
    device_id: int


def _parse_metadata(session_id: str, metadata: bytes) -> tuple[MemKind, int, bytes]:
    if len(metadata) <= _HEADER.size:
        raise ValueError(f"metadata of NIXL peer {session_id!r} is too short")
    magic, version, kind, device_id = _HEADER.unpack_from(metadata)
    if magic != _MAGIC or version != 1 or kind >= len(_KINDS):
        raise ValueError(f"metadata of NIXL peer {session_id!r} is not a NixlEngine's")
    return _KINDS[kind], device_id, metadata[_HEADER.size :]


class NixlEngine:
    """A :class:`~staging_contracts.protocols.TransferEngine` over a NIXL agent (UCX).

    **Progress:** the receiving side must call :meth:`poll_notifications` (or
    :meth:`progress`) regularly while peers may write to it; see the module docstring.

    **Thread-safety:** every method may be called from any thread; calls into the agent are
    serialized by one lock, which ``write`` releases between its completion checks, so a
    listener thread can poll notifications while a worker thread writes.

    **Exposure:** UCX listens where ``host`` (or ``UCX_NET_DEVICES``) says, on every
    interface otherwise; the engine warns at start-up about each listener beyond where it
    was told (see the module docstring).

    Args:
        name: Agent name, which is the session id; unique among the agents a peer knows.
            Default ``nixl-<host>-<pid>-<random>``.
        host: Address UCX's TCP transport listens on and advertises: UCX uses only the
            network interface holding it (:func:`ucx_confinement`; a ``UCX_NET_DEVICES``
            in the environment wins). ``None`` (default): UCX's own choice, every
            interface unless ``UCX_NET_DEVICES`` is set.
        mem_type: ``"DRAM"`` for host memory, ``"VRAM"`` for CUDA device memory. Every
            range this engine registers and writes from is of this type.
        device_id: CUDA device of the registered memory (``0`` for DRAM).
        device: The torch device of the memory this engine will register (``"cpu"``,
            ``"cuda:N"``), instead of ``mem_type`` and ``device_id``: they are set by
            :func:`memory_kind`, so a CUDA tensor's memory is registered as VRAM of its GPU.
        ucx_error_handling_mode: UCX backend's ``ucx_error_handling_mode``; ``"none"``
            halves the write round trip, ``"peer"`` detects dead peers.
        ucx_params: Further UCX backend parameters (e.g. ``{"num_workers": "2"}``).
        load_ib_modules: ``False`` sets ``UCX_MODULES=^ib`` (unless already set) before the
            agent loads UCX: for hosts without RDMA NICs, and against the crash at exit
            described in the module docstring. Only the process's first agent decides.
        write_timeout_s: How long ``write`` waits for completion before it gives up.
        close_timeout_s: How long ``close`` waits for running writes.
        notifications: ``False``: writes carry no notification (``supports_notifications``
            is ``False`` and ``write`` refuses a ``notify``), so a staging writer signals
            arrival with ``CHUNK_READY`` over ZMQ after the write, as the reference's NIXL
            path does. The agent still receives what peers attach to their writes
            (``poll_notifications``).

    Raises:
        TransferError: the UCX plugin is missing, the agent could not be created, or no
            interface holds ``host``.
        ValueError: a ``device`` :func:`memory_kind` refuses, or one that disagrees with an
            explicit ``mem_type``/``device_id``.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        host: str | None = None,
        mem_type: MemKind = "DRAM",
        device_id: int = 0,
        ucx_error_handling_mode: Literal["none", "peer"] = "none",
        ucx_params: Mapping[str, str] | None = None,
        load_ib_modules: bool = True,
        write_timeout_s: float = 30.0,
        close_timeout_s: float = 30.0,
        notifications: bool = True,
        device: str | None = None,
    ) -> None:
        if device is not None:
            kind, index = memory_kind(device)
            if (mem_type, device_id) not in (("DRAM", 0), (kind, index)):
                raise ValueError(
                    f"device={device!r} is {kind} of device {index}, but mem_type={mem_type!r}"
                    f" and device_id={device_id} were given too"
                )
            mem_type, device_id = kind, index
        session_id = name or f"nixl-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if not load_ib_modules:
            os.environ.setdefault("UCX_MODULES", "^ib")
        config = nixl_api.nixl_agent_config(enable_prog_thread=False, backends=[])
        params = {"ucx_error_handling_mode": ucx_error_handling_mode, **(ucx_params or {})}
        if host is not None:
            confinement = ",".join(f"{k}={v}" for k, v in ucx_confinement(host).items())
            if confinement:
                given = params.get("engine_config")
                params["engine_config"] = f"{given},{confinement}" if given else confinement
        opened: set[ListeningSocket] = set()
        try:
            agent = nixl_api.nixl_agent(session_id, config)
            plugins = agent.get_plugin_list()
            if "UCX" in plugins:
                with watch_listeners() as found:
                    agent.create_backend("UCX", params)
                opened = found
        except _START_ERRORS as exc:
            raise TransferError(f"NIXL agent {session_id!r} failed to start: {exc!r}") from exc
        if "UCX" not in plugins:
            raise TransferError(f"NIXL has no UCX plugin (found {plugins})")
        self._agent: nixl_api.nixl_agent | None = agent
        self._session_id = session_id
        self._mem_type: MemKind = mem_type
        self._device_id = device_id
        self._write_timeout_s = write_timeout_s
        self._close_timeout_s = close_timeout_s
        self._notifications = notifications
        self._lock = threading.Lock()
        self._regions = RegionTable()
        self._reg_lists: dict[int, nixl_bindings.nixlRegDList] = {}
        self._peers: dict[str, _Peer] = {}
        self._pending: list[Notification] = []
        """Notifications taken from the agent and not yet returned by ``poll_notifications``
        (NIXL hands each over once: whatever happens next, they must not be lost)."""
        self._poll_failures = 0
        """Failed fetches since the last one that worked (only the first is a warning)."""
        self._stuck: list[nixl_api.nixl_xfer_handle] = []
        self._gate = InflightGate(f"NIXL engine {session_id!r}")
        self._listening = tuple(str(item) for item in sorted(opened))
        logger.info(
            "NIXL engine %s ready (%s, UCX %s), listening on %s",
            session_id,
            mem_type,
            params,
            ", ".join(self._listening) or "(no TCP listener)",
        )
        self._check_exposure(host, opened)

    def __repr__(self) -> str:
        state = "closed" if self._gate.closed else f"{len(self._regions)} regions"
        return f"NixlEngine({self._session_id!r}, {self._mem_type!r}, {state})"

    @property
    def registered_regions(self) -> int:
        """Memory ranges registered now (0 after every ``deregister`` and after ``close``)."""
        return len(self._regions)

    @property
    def listening(self) -> tuple[str, ...]:
        """The TCP listeners UCX opened when the agent started, as ``"address:port"`` (IPv6
        in brackets), sorted; empty without a TCP transport or where ``/proc`` cannot be
        read."""
        return self._listening

    @property
    def session_id(self) -> str:
        """The agent name."""
        return self._session_id

    @property
    def supports_notifications(self) -> bool:
        """``True`` (unless created with ``notifications=False``): the payload travels with
        the write and arrives after the data."""
        return self._notifications

    def metadata(self) -> bytes:
        """The agent's metadata (with its registrations) behind a small header.

        Call it after ``register``: a peer only reaches memory registered before it loaded
        the metadata (send it again, and ``add_peer`` again, after registering more).

        Raises:
            TransferError: the engine is closed.
        """
        header = _HEADER.pack(_MAGIC, 1, _KINDS.index(self._mem_type), self._device_id)
        with self._gate.entered(), self._lock:
            return header + self._require().get_agent_metadata()

    def add_peer(self, session_id: str, metadata: bytes) -> None:
        """Load a peer's metadata so ``write`` can reach it (same metadata again: no-op).

        Raises:
            ValueError: the metadata is malformed or belongs to another agent.
            TransferError: NIXL rejected the metadata, or the engine is closed.
        """
        mem_type, device_id, agent_md = _parse_metadata(session_id, metadata)
        with self._gate.entered(), self._lock:
            known = self._peers.get(session_id)
            if known is not None and known.metadata == metadata:
                return
            agent = self._require()
            try:
                loaded = agent.add_remote_agent(agent_md).decode()
            except _NIXL_ERRORS as exc:
                raise TransferError(f"NIXL rejected metadata of {session_id!r}: {exc!r}") from exc
            if loaded != session_id:
                agent.remove_remote_agent(loaded)
                raise ValueError(f"metadata given for {session_id!r} belongs to {loaded!r}")
            self._peers[session_id] = _Peer(metadata, mem_type, device_id)

    def register(self, ptr: int, length: int) -> None:
        """Register ``[ptr, ptr + length)`` (of ``mem_type`` on ``device_id``) with UCX.

        **Blocking:** for the registration. Registering the same range again does nothing.

        Raises:
            ValueError: bad address or length, or ``ptr`` is registered with another length.
            TransferError: NIXL refused the registration, or the engine is closed.
        """
        with self._gate.entered(), self._lock:
            if not self._regions.add(ptr, length):
                return
            try:
                descs = [(ptr, length, self._device_id, "")]
                self._reg_lists[ptr] = self._require().register_memory(descs, self._mem_type)
            except _NIXL_ERRORS as exc:
                self._regions.remove(ptr)
                raise TransferError(
                    f"NIXL engine {self._session_id!r} failed to register"
                    f" [{ptr:#x}, {ptr + length:#x}): {exc!r}"
                ) from exc

    def deregister(self, ptr: int) -> None:
        """Deregister the range registered at ``ptr`` (unknown addresses are ignored).

        A failure is logged, not raised: the range is forgotten either way.
        """
        with self._lock:
            self._regions.remove(ptr)
            reg_list = self._reg_lists.pop(ptr, None)
            if reg_list is not None and self._agent is not None:
                self._release(partial(self._agent.deregister_memory, reg_list), "deregister")

    def write(self, peer: str, transfers: Sequence[Transfer], notify: bytes | None = None) -> None:
        """Write every transfer in one NIXL request, with ``notify`` as its notification.

        Local ranges are checked here; NIXL checks remote ranges against the peer's
        metadata. Without transfers, or with an empty ``notify`` (NIXL drops empty payloads
        of a transfer), the notification is sent on its own after the write.

        **Blocking:** until NIXL reports the request done, driving progress meanwhile; the
        source memory may be reused then. At most ``write_timeout_s``.

        Raises:
            ValueError: ``notify`` given to an engine created with ``notifications=False``.
            TransferError: ``peer`` was not added, a range lies outside registered memory,
                NIXL reported an error, the write timed out (the request is cancelled if
                NIXL can; nothing is known about the bytes), or the engine is closed.
        """
        if notify is not None and not self._notifications:
            raise ValueError(
                f"NIXL engine {self._session_id!r} was created with notifications=False;"
                " signal arrival another way (CHUNK_READY over ZMQ)"
            )
        with self._gate.entered():
            target = self._peers.get(peer)
            if target is None:
                raise TransferError(
                    f"unknown peer {peer!r} of NIXL engine {self._session_id!r};"
                    " call add_peer first"
                )
            with self._lock:
                problems = transfer_problems(transfers, local=self._regions, remote=None)
            if problems:
                raise TransferError(
                    format_problems(
                        f"NIXL engine {self._session_id!r} cannot write to {peer!r}:", problems
                    )
                )
            if transfers:
                self._write(peer, target, transfers, notify or b"")
            if notify is not None and not (transfers and notify):
                with self._lock:
                    self._call(partial(self._require().send_notif, peer, notify), peer)

    def progress(self) -> None:
        """Drive the agent once, keeping arrived notifications for ``poll_notifications``.

        **Blocking:** no. A closed engine does nothing. A failure to fetch notifications is
        logged with its cause, not raised (see ``poll_notifications``).
        """
        with self._lock:
            if self._agent is not None:
                self._fetch(self._agent)

    def poll_notifications(self) -> list[Notification]:
        """Drive the agent and return the notifications received since the last call.

        Per writer, in arrival order. **Blocking:** no. A closed engine returns ``[]``.

        Never loses a notification: NIXL hands each over once, so each is kept by the engine
        from the moment it is fetched until a call returns it. If fetching fails (or one
        notification cannot be read), that is logged with its cause (the first failure of a
        run as a warning) and not raised: this call still returns every notification fetched
        before, and the agent keeps the rest for the next call.
        """
        with self._lock:
            if self._agent is not None:
                self._fetch(self._agent)
            notes, self._pending = self._pending, []
        return notes

    def close(self) -> None:
        """Release requests, registrations, peers and the agent itself; safe to call twice.

        **Blocking:** waits up to ``close_timeout_s`` for running writes; if they do not
        finish, the agent is leaked (logged) rather than freed under them.
        """
        drained = self._gate.close(self._close_timeout_s)
        if drained is None:
            return
        if not drained:
            logger.error("NIXL engine %s closed with writes running; leaking it", self._session_id)
            return
        with self._lock:
            agent = self._agent
            if agent is None:
                return
            for handle in self._stuck:
                self._release(handle.release, "release a stuck request")
            for reg_list in self._reg_lists.values():
                self._release(partial(agent.deregister_memory, reg_list), "deregister")
            for peer in self._peers:
                self._release(partial(agent.remove_remote_agent, peer), "remove a peer")
            self._stuck.clear()
            self._reg_lists.clear()
            self._regions.clear()
            self._peers.clear()
            self._pending.clear()
            self._agent = None
        del agent  # the last reference: the native agent is destroyed here
        logger.info("NIXL engine %s closed", self._session_id)

    # ------------------------------------------------------------------ internals

    def _check_exposure(self, host: str | None, opened: set[ListeningSocket]) -> None:
        """Warn about each listener the agent opened beyond where it was told to listen."""
        allowed, why = _allowed_addresses(host)
        exposed = [] if allowed is None else unconfined(opened, allowed)
        if not exposed:
            return
        if why == _UNTOLD:  # UCX's own choice, as asked: said, not warned about
            logger.info(
                "NIXL engine %s: UCX listens on every interface it found, beyond loopback on"
                " %s; pass host= or set UCX_NET_DEVICES to confine it (docs/security.md)",
                self._session_id,
                ", ".join(map(str, exposed)),
            )
            return
        devices = os.environ.get(_NET_DEVICES_ENV)
        fix = (
            f"{_NET_DEVICES_ENV}={devices} in the environment wins over host="
            if host is not None and devices is not None
            else f"pass host= or set {_NET_DEVICES_ENV} to the interface peers reach"
        )
        logger.warning(
            "NIXL engine %s: UCX listens beyond where it was told (%s), on %s; %s"
            " (docs/security.md)",
            self._session_id,
            why,
            ", ".join(map(str, exposed)),
            fix,
        )

    def _write(self, peer: str, target: _Peer, transfers: Sequence[Transfer], note: bytes) -> None:
        deadline = time.monotonic() + self._write_timeout_s
        local = [(t.local, t.length, self._device_id) for t in transfers]
        remote = [(t.remote, t.length, target.device_id) for t in transfers]
        with self._lock:
            agent = self._require()
            local_descs = agent.get_xfer_descs(local, self._mem_type)
            remote_descs = agent.get_xfer_descs(remote, target.mem_type)
            if local_descs is None or remote_descs is None:
                raise TransferError(f"NIXL could not describe the write to {peer!r}")
            handle = self._call(
                lambda: agent.initialize_xfer("WRITE", local_descs, remote_descs, peer, note), peer
            )
            state = self._call(lambda: agent.transfer(handle), peer)
        pause = 0.0
        spin_until = time.monotonic() + _SPIN_S
        try:
            while state == "PROC":
                now = time.monotonic()
                if now > deadline:
                    raise TransferError(
                        f"NIXL write to {peer!r} timed out after {self._write_timeout_s} s"
                        " (does the peer poll its notifications?)"
                    )
                if now > spin_until:
                    pause = min(_MAX_SLEEP_S, pause * 2 or 1e-5)
                    time.sleep(pause)
                with self._lock:
                    state = self._call(lambda: agent.check_xfer_state(handle), peer)
        finally:
            with self._lock:
                if not self._release(handle.release, "release a request"):
                    self._stuck.append(handle)
        if state != "DONE":
            raise TransferError(
                f"NIXL write of {len(transfers)} transfers to {peer!r} failed (state {state})"
            )

    def _call(self, fn: Callable[[], _T], peer: str) -> _T:
        try:
            return fn()
        except _NIXL_ERRORS as exc:
            raise TransferError(
                f"NIXL engine {self._session_id!r} failed to write to {peer!r}: {exc!r}"
                " (is every remote range registered there, and was its metadata loaded after?)"
            ) from exc

    def _release(self, fn: Callable[[], object], what: str) -> bool:
        try:
            fn()
        except _NIXL_ERRORS as exc:
            logger.warning("NIXL engine %s failed to %s: %r", self._session_id, what, exc)
            return False
        return True

    def _fetch(self, agent: nixl_api.nixl_agent) -> None:
        """Move the agent's new notifications into ``_pending`` (the caller holds the lock).

        Each one goes to ``_pending`` as soon as it is read, so no failure, here or later,
        loses one already taken from the agent.
        """
        try:
            arrived = agent.get_new_notifs()
        except Exception as exc:  # logged with its cause; the poller must go on
            self._poll_failures += 1
            level = logging.WARNING if self._poll_failures == 1 else logging.DEBUG
            logger.log(
                level,
                "NIXL engine %s failed to fetch notifications (failure %d in a row; %d fetched"
                " earlier are kept): %r",
                self._session_id,
                self._poll_failures,
                len(self._pending),
                exc,
                exc_info=exc,
            )
            return
        if self._poll_failures:
            logger.info(
                "NIXL engine %s fetches notifications again after %d failures",
                self._session_id,
                self._poll_failures,
            )
            self._poll_failures = 0
        for peer, payloads in arrived.items():
            for payload in payloads:
                try:
                    self._pending.append(Notification(str(peer), bytes(payload)))
                except (TypeError, ValueError) as exc:
                    logger.warning(
                        "NIXL engine %s dropped an unreadable notification from %r: %r",
                        self._session_id,
                        peer,
                        exc,
                        exc_info=exc,
                    )

    def _require(self) -> nixl_api.nixl_agent:
        agent = self._agent
        if agent is None:
            raise TransferError(f"NIXL engine {self._session_id!r} is closed")
        return agent
