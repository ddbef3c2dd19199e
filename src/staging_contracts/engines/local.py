"""Same-process transfer engine: ``ctypes.memmove`` between registered CPU memory.

The embedded default for single-process use and for tests: every engine of the process is
found by its session id in a process-wide registry (weakly held, and left explicitly by
``close``), so two ``LocalEngine`` objects behave like a prefill and a decode rank whose
transfers are plain memory copies.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Sequence

from ..protocols import Notification, Transfer, TransferError
from ._common import RegionTable, format_problems, transfer_problems

__all__ = ["LocalEngine"]

logger = logging.getLogger(__name__)

_registry: weakref.WeakValueDictionary[str, LocalEngine] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()
_names = itertools.count(1)


def _lookup(session_id: str) -> LocalEngine | None:
    with _registry_lock:
        return _registry.get(session_id)


class LocalEngine:
    """A :class:`~staging_contracts.protocols.TransferEngine` for peers in the same process.

    Copies run on the calling thread with ``ctypes.memmove`` (CPU memory only: a CUDA
    pointer would crash the process, so register host memory only). Notifications are
    queued on the peer after the bytes were copied.

    **Thread-safety:** every method may be called from any thread. A write holds the
    registration locks of both engines while it checks and copies, so a concurrent
    ``deregister`` or ``close`` waits for it; it never holds them while delivering the
    notification.

    Args:
        name: Session id of this engine, unique among the live local engines of the
            process; default ``local-<pid>-<n>``.

    Raises:
        ValueError: ``name`` is already used by a live engine.
    """

    def __init__(self, name: str | None = None) -> None:
        session_id = name if name is not None else f"local-{os.getpid()}-{next(_names)}"
        with _registry_lock:
            if session_id in _registry:
                raise ValueError(f"a local engine named {session_id!r} already exists")
            _registry[session_id] = self
        self._session_id = session_id
        self._lock = threading.Lock()
        self._regions = RegionTable()
        self._peers: set[str] = set()
        self._notes: deque[Notification] = deque()
        self._closed = False
        logger.debug("local engine %r created", session_id)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._regions)} regions"
        return f"LocalEngine({self._session_id!r}, {state})"

    @property
    def registered_regions(self) -> int:
        """Memory ranges registered now (0 after every ``deregister`` and after ``close``)."""
        return len(self._regions)

    @property
    def session_id(self) -> str:
        """The name peers pass to ``write`` (the ``name`` given at construction)."""
        return self._session_id

    @property
    def supports_notifications(self) -> bool:
        """Always ``True``: ``notify`` payloads are queued on the peer after the copy."""
        return True

    def metadata(self) -> bytes:
        """The session id, UTF-8 encoded (all a same-process peer needs)."""
        return self._session_id.encode()

    def add_peer(self, session_id: str, metadata: bytes) -> None:
        """Make the live local engine ``session_id`` a target of ``write`` (idempotent).

        Raises:
            ValueError: ``metadata`` is not what that engine's ``metadata()`` returns.
            TransferError: no live local engine has that name, or this one is closed.
        """
        if metadata != session_id.encode():
            raise ValueError(
                f"metadata {metadata!r} does not belong to local engine {session_id!r}"
            )
        if _lookup(session_id) is None:
            raise TransferError(f"no live local engine named {session_id!r} in this process")
        with self._lock:
            self._check_open()
            self._peers.add(session_id)

    def register(self, ptr: int, length: int) -> None:
        """Allow transfers from and into ``[ptr, ptr + length)`` (host memory).

        Registering the same range again does nothing.

        Raises:
            ValueError: bad address or length, or ``ptr`` is registered with another length.
            TransferError: the engine is closed.
        """
        with self._lock:
            self._check_open()
            self._regions.add(ptr, length)

    def deregister(self, ptr: int) -> None:
        """Forget the range registered at ``ptr`` (unknown addresses are ignored).

        **Blocking:** waits for a write that is copying from or into this engine.
        """
        with self._lock:
            self._regions.remove(ptr)

    def write(self, peer: str, transfers: Sequence[Transfer], notify: bytes | None = None) -> None:
        """Copy every transfer into ``peer``'s memory, then queue ``notify`` there.

        **Blocking:** for the copies (on the calling thread).

        Raises:
            TransferError: ``peer`` was not added or no longer exists, this engine is closed,
                or a range lies outside registered memory (every bad range is listed;
                nothing was copied).
        """
        if peer not in self._peers:
            raise TransferError(
                f"unknown peer {peer!r} of local engine {self._session_id!r}; call add_peer first"
            )
        target = _lookup(peer)
        if target is None:
            raise TransferError(f"peer {peer!r} of local engine {self._session_id!r} is gone")
        # Both locks, always in the same (address) order, so crossing writes cannot deadlock.
        first, second = (self, target) if id(self) <= id(target) else (target, self)
        with first._lock:
            if second is not first:
                second._lock.acquire()
            try:
                self._check_open()
                if target._closed:
                    raise TransferError(f"peer {peer!r} of {self._session_id!r} is closed")
                problems = transfer_problems(transfers, local=self._regions, remote=target._regions)
                if problems:
                    raise TransferError(
                        format_problems(
                            f"local engine {self._session_id!r} cannot write to {peer!r}:",
                            problems,
                        )
                    )
                for transfer in transfers:
                    ctypes.memmove(transfer.remote, transfer.local, transfer.length)
            finally:
                if second is not first:
                    second._lock.release()
        if notify is not None:
            target._notes.append(Notification(self._session_id, bytes(notify)))

    def poll_notifications(self) -> list[Notification]:
        """Notifications queued since the last call, oldest first (never blocks)."""
        notes: list[Notification] = []
        while True:
            try:
                notes.append(self._notes.popleft())
            except IndexError:
                return notes

    def close(self) -> None:
        """Leave the process registry and forget registrations and peers; safe to call twice.

        **Blocking:** waits for a write that is copying from or into this engine.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._regions.clear()
            self._peers.clear()
            self._notes.clear()
        with _registry_lock:
            if _registry.get(self._session_id) is self:
                del _registry[self._session_id]
        logger.debug("local engine %r closed", self._session_id)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"local engine {self._session_id!r} is closed")
