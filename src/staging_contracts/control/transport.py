"""ZMQ plumbing for the control plane: peer sockets that never block, and a listener thread.

One ZMQ context per process (``zmq.Context.instance()``); one PUSH socket per peer endpoint,
created on first use; one PULL socket per listener, bound to loopback by default. A listener
thread drains its socket and hands each multipart message to a dispatch function; bad input
(:class:`~.wire.MalformedMessage`) is counted and logged and the thread keeps
serving, and so is any other exception a dispatch raises.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import zmq

from .wire import MalformedMessage

__all__ = ["Listener", "ListenerStats", "PeerSockets", "open_socket_count"]

logger = logging.getLogger(__name__)

DEFAULT_SEND_HWM: Final = 4096
"""Messages queued per peer before sends to it are dropped (a dead or stalled peer)."""

_NOBLOCK: Final = int(zmq.NOBLOCK)
_NOBLOCK_MORE: Final = int(zmq.NOBLOCK) | int(zmq.SNDMORE)

_open_sockets = 0
_open_lock = threading.Lock()


def _opened(delta: int) -> None:
    global _open_sockets  # noqa: PLW0603 - a process-wide count, for leak checks
    with _open_lock:
        _open_sockets += delta


def open_socket_count() -> int:
    """Sockets this module opened and has not closed yet, in this process (for leak checks)."""
    with _open_lock:
        return _open_sockets


class PeerSockets:
    """PUSH sockets to peers, one per endpoint, created on first use.

    **Thread-safety:** safe to call from any thread; each socket has its own lock.
    **Blocking:** never: a send to a peer whose queue is full (dead, stalled, not yet
    reachable beyond ``hwm`` messages) is dropped and counted, and ``send`` returns ``False``.

    Args:
        hwm: messages queued per peer before further sends to it are dropped.
        context: the ZMQ context (default: the process-wide instance).
    """

    def __init__(
        self, *, hwm: int = DEFAULT_SEND_HWM, context: zmq.Context[zmq.Socket[bytes]] | None = None
    ) -> None:
        self._context = context or zmq.Context.instance()
        self._hwm = hwm
        self._lock = threading.Lock()
        self._sockets: dict[str, tuple[zmq.Socket[bytes], threading.Lock]] = {}
        self._closed = False
        self._dropping: set[str] = set()
        self.dropped = 0
        """Messages dropped because a peer's queue was full."""

    def _socket(self, endpoint: str) -> tuple[zmq.Socket[bytes], threading.Lock]:
        with self._lock:
            if self._closed:
                raise RuntimeError("PeerSockets is closed")
            entry = self._sockets.get(endpoint)
            if entry is None:
                sock = self._context.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, self._hwm)
                sock.connect(endpoint)
                _opened(+1)
                entry = (sock, threading.Lock())
                self._sockets[endpoint] = entry
            return entry

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool:
        """Queue one multipart message for ``endpoint``; ``False`` if it was dropped.

        Raises:
            RuntimeError: after :meth:`close`.
        """
        sock, lock = self._socket(endpoint)
        with lock:
            try:
                # Frame by frame with plain int flags: pyzmq's send_multipart builds Frame
                # objects and combines enum flags per frame, several times the cost for the
                # small control messages. ZMQ refuses a multipart message at its first frame
                # or not at all, so a full queue never leaves half a message behind.
                last = len(frames) - 1
                for index, frame in enumerate(frames):
                    sock.send(frame, _NOBLOCK_MORE if index < last else _NOBLOCK)
            except zmq.Again:
                self.dropped += 1
                if endpoint not in self._dropping:
                    self._dropping.add(endpoint)
                    logger.warning("peer %s is not keeping up: dropping its messages", endpoint)
                return False
            if endpoint in self._dropping:
                self._dropping.discard(endpoint)
                logger.info("peer %s takes messages again", endpoint)
        return True

    def forget(self, endpoint: str) -> None:
        """Close the socket to one peer (e.g. a failed one); a later send reconnects."""
        with self._lock:
            entry = self._sockets.pop(endpoint, None)
        if entry is not None:
            with entry[1]:
                entry[0].close(linger=0)
            _opened(-1)

    def close(self) -> None:
        """Close every socket; safe to call twice."""
        with self._lock:
            entries = list(self._sockets.values())
            self._sockets.clear()
            self._closed = True
        for sock, lock in entries:
            with lock:
                sock.close(linger=0)
            _opened(-1)


@dataclass(frozen=True, slots=True)
class ListenerStats:
    """What a listener has seen so far."""

    received: int
    """Multipart messages received."""
    malformed: int
    """Messages the dispatch rejected with ``MalformedMessage``."""
    errors: int
    """Messages whose dispatch raised anything else (a bug; logged with its traceback)."""


class Listener:
    """A PULL socket bound to an endpoint, drained by a thread of its own.

    **Thread-safety:** ``dispatch`` and ``idle`` run on the listener thread only; ``start``,
    ``stop`` and ``stats`` may be called from any thread.

    Args:
        dispatch: called with each multipart message (a list of frames) on the listener thread.
        name: the thread's name (shows in logs and thread dumps).
        host: address to bind (loopback by default).
        port: port to bind; 0 picks a free one.
        idle: called after every wake-up of the loop (for work that needs polling, such as an
            engine's notifications).
        poll_interval_s: longest wait for a message before ``idle`` runs again.
    """

    def __init__(
        self,
        dispatch: Callable[[list[bytes]], None],
        *,
        name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        idle: Callable[[], None] | None = None,
        poll_interval_s: float = 0.005,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self._dispatch = dispatch
        self._idle = idle
        self._poll_ms = max(1, round(poll_interval_s * 1000))
        ctx = context or zmq.Context.instance()
        self._socket = ctx.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            if port:
                self._socket.bind(f"tcp://{host}:{port}")
            else:
                self._socket.bind(f"tcp://{host}:*")
        except zmq.ZMQError:
            self._socket.close(linger=0)
            raise
        _opened(+1)
        last = self._socket.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint: str = last.decode() if isinstance(last, bytes) else str(last)
        """``tcp://host:port`` that peers connect their PUSH sockets to."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._received = 0
        self._malformed = 0
        self._errors = 0
        self._started = False
        self._closed = False

    def start(self) -> None:
        """Start the thread (once)."""
        if self._started:
            return
        self._started = True
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close the socket; safe to call twice.

        Raises:
            TimeoutError: the thread did not stop within ``timeout`` (a dispatch is stuck).
        """
        self._stop.set()
        if self._started:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"listener {self._thread.name} did not stop in {timeout}s")
        elif not self._closed:
            self._socket.close(linger=0)
            self._closed = True
            _opened(-1)

    @property
    def alive(self) -> bool:
        """True while the thread runs."""
        return self._thread.is_alive()

    def stats(self) -> ListenerStats:
        """Counts so far (read without locking; each value is current or slightly stale)."""
        return ListenerStats(self._received, self._malformed, self._errors)

    def __enter__(self) -> Listener:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(self._poll_ms):
                    self._drain()
                if self._idle is not None:
                    self._guarded(self._idle)
        finally:
            self._socket.close(linger=0)
            self._closed = True
            _opened(-1)

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._received += 1
            self._handle(frames)

    def _handle(self, frames: list[bytes]) -> None:
        try:
            self._dispatch(frames)
        except MalformedMessage as exc:
            self._malformed += 1
            logger.warning("%s: malformed message dropped: %s", self._thread.name, exc)
        except Exception:
            self._errors += 1
            logger.exception("%s: dispatch failed; the listener keeps serving", self._thread.name)

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            self._errors += 1
            logger.exception("%s: idle work failed; the listener keeps serving", self._thread.name)
