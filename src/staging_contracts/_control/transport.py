"""ZMQ plumbing for the control plane: peer sockets that never block, and a listener thread.

One ZMQ context per process (``zmq.Context.instance()``); one PUSH socket per peer endpoint,
created on first use, at most :data:`DEFAULT_MAX_PEER_SOCKETS` of them (the least recently
used is closed past that, and any unused for :data:`DEFAULT_PEER_IDLE_S` is reaped); one PULL
socket per listener, bound to loopback by default. A listener thread drains its socket in
bounded batches and hands each multipart message to a dispatch function; between batches it
runs its idle work, so a flood of messages delays that work by at most
:data:`IDLE_INTERVAL_S`. Bad input (:class:`~.wire.MalformedMessage`) is counted and logged and
the thread keeps serving, and so is any other exception a dispatch raises; the logging is
rate-limited (:class:`LogThrottle`), the counts are exact (:class:`ListenerStats`).

Size limits hold before any byte reaches Python: a listener's socket sets ``ZMQ_MAXMSGSIZE``
(:data:`MAX_FRAME_BYTES`), so ZMQ drops a larger frame, and the connection that sent it, while
reading its header; and a message of more than :data:`MAX_FRAMES` frames is discarded frame by
frame without being copied. (ZMQ itself holds a multipart message whole before it hands over
the first frame, so many frames of allowed size still cost ZMQ their memory, once.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple

import zmq

from .wire import MAX_MESSAGE_BYTES, MalformedMessage

if TYPE_CHECKING:
    from .security import ControlSecurity

__all__ = [
    "DEFAULT_MAX_PEER_SOCKETS",
    "DEFAULT_PEER_IDLE_S",
    "DEFAULT_SEND_HWM",
    "DRAIN_BATCH",
    "IDLE_INTERVAL_S",
    "LOG_BURST",
    "LOG_INTERVAL_S",
    "MAX_FRAMES",
    "MAX_FRAME_BYTES",
    "Listener",
    "ListenerStats",
    "LogThrottle",
    "PeerSockets",
    "Received",
    "SocketsClosed",
    "open_socket_count",
    "recv_frames",
]

logger = logging.getLogger(__name__)

DEFAULT_SEND_HWM: Final = 4096
"""Messages queued per peer before sends to it are dropped (a dead or stalled peer)."""

DEFAULT_MAX_PEER_SOCKETS: Final = 512
"""Most sockets a :class:`PeerSockets` keeps open at once; past it, the least recently used one
is closed (a later send to it reconnects). Well under ZMQ's default of 1023 sockets per context,
so that endpoints named by messages (a ``PING``'s ``reply_to`` without a secret) can never use
the context up; a rank talks to far fewer peers."""

DEFAULT_PEER_IDLE_S: Final = 60.0
"""A socket not used for this long is closed (reaped) at the next send to any peer."""

MAX_FRAME_BYTES: Final = 2 * MAX_MESSAGE_BYTES
"""Largest frame a listener's socket accepts (``ZMQ_MAXMSGSIZE``), 8 KiB: the codec's limit on
a whole message (:data:`~.wire.MAX_MESSAGE_BYTES`, 4 KiB; a valid message is under 450 bytes)
with as much again for margin. ZMQ drops a larger frame while reading its header, before it
allocates it, and disconnects its sender (a PUSH peer reconnects by itself); it is not counted
in :class:`ListenerStats`, since ZMQ does not report it."""

MAX_FRAMES: Final = 32
"""Most frames a listener accepts in one message (a valid control message has at most 6).
The frames of a longer message are discarded without being copied; it counts as malformed."""

DRAIN_BATCH: Final = 128
"""Most messages a listener dispatches between two runs of its idle work."""

IDLE_INTERVAL_S: Final = 0.01
"""Longest a listener spends dispatching before it runs its idle work again, however many
messages wait (the check is made after each message, so one slow dispatch can add to it)."""

LOG_BURST: Final = 5
"""Log lines a :class:`LogThrottle` writes per interval for one kind of event."""

LOG_INTERVAL_S: Final = 10.0
"""The interval of a :class:`LogThrottle`; each ends with a summary of what was not logged."""

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


class LogThrottle:
    """Rate-limits the log lines of one kind of event, and summarises the rest.

    At most ``burst`` events are logged one by one per ``interval_s``; the others are only
    counted, and once the interval has passed one summary line says how many were not logged.
    So a flood of bad input costs at most ``burst + 1`` lines per interval.

    **Thread-safety:** none; one thread owns it (a listener's or a server's loop).

    Args:
        log: the logger the summary goes to (the caller logs the admitted events itself).
        what: names the events in the summary, e.g. ``"listener-3: malformed messages"``.
        burst: events logged one by one per interval.
        interval_s: length of an interval.
        clock: monotonic time in seconds (tests pass their own).
    """

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        *,
        burst: int = LOG_BURST,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 0 or not interval_s > 0:
            raise ValueError(f"burst={burst} must be >= 0 and interval_s={interval_s} > 0")
        self._log = log
        self._what = what
        self._burst = burst
        self._interval_s = interval_s
        self._clock = clock
        self._start = clock()
        self._logged = 0
        self.suppressed = 0
        """Events not logged since the last summary."""

    def admit(self) -> bool:
        """Count one event; ``True`` if the caller may log it now, ``False`` to stay quiet."""
        now = self._clock()
        if now - self._start >= self._interval_s:
            self._roll(now)
        if self._logged < self._burst:
            self._logged += 1
            return True
        self.suppressed += 1
        return False

    def tick(self) -> None:
        """Write the summary if the interval has passed (call it from the owner's loop)."""
        if self.suppressed:
            now = self._clock()
            if now - self._start >= self._interval_s:
                self._roll(now)

    def flush(self) -> None:
        """Write the summary now, if anything was not logged (e.g. when the owner stops)."""
        self._roll(self._clock())

    def _roll(self, now: float) -> None:
        if self.suppressed:
            self._log.warning(
                "%s: %d more not logged one by one in the last %.1fs",
                self._what,
                self.suppressed,
                now - self._start,
            )
            self.suppressed = 0
        self._start = now
        self._logged = 0


class Received(NamedTuple):
    """One multipart message as :func:`recv_frames` read it."""

    frames: list[bytes]
    """Its first frames (at most ``max_frames``)."""
    dropped: int
    """How many more frames it had (0 for a message within the bound)."""
    user_id: str | None = None
    """The ``User-Id`` ZMQ gave it (CURVE: the sender's public key), when asked for."""
    peer: str | None = None
    """The sender's IP address (ZMQ's ``Peer-Address``), when asked for."""


def recv_frames(
    sock: zmq.Socket[bytes],
    *,
    max_frames: int = MAX_FRAMES,
    flags: int = 0,
    user_id: bool = False,
    peer_address: bool = False,
) -> Received:
    """Receive one multipart message, keeping at most ``max_frames`` of its frames.

    **Thread-safety:** the socket's owner thread only (ZMQ sockets are not thread-safe).

    Args:
        sock: the socket to read.
        max_frames: most frames copied into ``bytes``; the rest of a longer message is
            received as ZMQ frames (no copy into Python) and dropped.
        flags: for the first frame (e.g. ``zmq.NOBLOCK``); the rest are already there.
        user_id: also read the message's ``User-Id`` property (set by ZAP authentication).
        peer_address: also read the message's ``Peer-Address`` property (the sender's IP).

    Returns:
        The first ``max_frames`` frames, how many more the message had (0 for a message
        within the bound), its ``User-Id`` and its sender's address when asked for.

    Raises:
        zmq.Again: with ``zmq.NOBLOCK``, no message was waiting.
    """
    user = peer = None
    if user_id or peer_address:
        first = sock.recv(flags, copy=False)
        frames = [first.bytes]
        if user_id:
            value = first.get("User-Id")
            user = value if isinstance(value, str) and value else None
        if peer_address:
            value = first.get("Peer-Address")
            peer = value if isinstance(value, str) and value else None
    else:
        frames = [sock.recv(flags)]
    while sock.getsockopt(zmq.RCVMORE):
        if len(frames) < max_frames:
            frames.append(sock.recv())
            continue
        dropped = 0
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv(copy=False)
            dropped += 1
        return Received(frames, dropped, user, peer)
    return Received(frames, 0, user, peer)


class _PeerSocket:
    """One peer's socket, its lock and when it was last used."""

    __slots__ = ("closed", "lock", "sock", "used")

    def __init__(self, sock: zmq.Socket[bytes], used: float) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.used = used
        self.closed = False
        """Set (under ``lock``) once evicted, reaped or forgotten: a sender that took the
        entry just before must open a new one."""

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.sock.close(linger=0)
        _opened(-1)


class SocketsClosed(RuntimeError):
    """A send on :class:`PeerSockets` after its :meth:`~PeerSockets.close`: the manager is
    shutting down, and nothing more goes out. Best-effort senders (a failure notice, an
    acknowledgement) catch it; anything else is a bug of the caller's."""


class PeerSockets:
    """PUSH sockets to peers, one per endpoint, created on first use.

    **Thread-safety:** safe to call from any thread; each socket has its own lock.
    **Blocking:** never: a send to a peer whose queue is full (dead, stalled, not yet
    reachable beyond ``hwm`` messages) is dropped and counted, and ``send`` returns ``False``.

    **Bounded.** At most ``max_sockets`` sockets are open at once: opening one more closes the
    least recently used (counted in :attr:`evicted`; what it still queued is dropped, and a later
    send to that peer reconnects). A socket not used for ``idle_s`` is closed by a later send
    to any peer (they are looked for every ``idle_s / 4``, so within ``1.25 * idle_s``). So
    endpoints that arrive in messages (without a secret, anyone on the machine can name any)
    cost at most ``max_sockets`` sockets, never ZMQ's whole context.

    With ``security``, every socket is a CURVE client of its peer, with the peer's key from
    the security's directory; a message to a peer whose key is unknown is never sent in the
    clear: it is dropped, counted in ``untrusted`` and logged once per peer.

    Args:
        hwm: messages queued per peer before further sends to it are dropped.
        context: the ZMQ context (default: the process-wide instance).
        security: this participant's CURVE keys and trusted peers (``None``: plain TCP).
        max_sockets: most sockets open at once (>= 1).
        idle_s: a socket unused for this long is reaped (> 0).
        clock: monotonic clock (tests pass a fake one).

    Raises:
        ValueError: ``max_sockets < 1`` or ``idle_s <= 0``.
    """

    def __init__(
        self,
        *,
        hwm: int = DEFAULT_SEND_HWM,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        security: ControlSecurity | None = None,
        max_sockets: int = DEFAULT_MAX_PEER_SOCKETS,
        idle_s: float = DEFAULT_PEER_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sockets < 1 or not idle_s > 0:
            raise ValueError(f"max_sockets={max_sockets} must be >= 1 and idle_s={idle_s} > 0")
        self._context = context or zmq.Context.instance()
        self._hwm = hwm
        self._lock = threading.Lock()
        self._sockets: OrderedDict[str, _PeerSocket] = OrderedDict()
        """Endpoint -> its socket, least recently used first."""
        self._closed = False
        self._dropping: set[str] = set()
        self._security = security
        self.max_sockets = max_sockets
        """Most sockets open at once."""
        self.idle_s = idle_s
        """Seconds unused after which a socket is reaped."""
        self._clock = clock
        self._next_reap = float("-inf")
        """When idle sockets are looked for next (at most every ``idle_s / 4``)."""
        self.dropped = 0
        """Messages dropped because a peer's queue was full."""
        self.untrusted = 0
        """Messages not sent because the peer's CURVE key is unknown (with ``security``)."""
        self.evicted = 0
        """Sockets closed to stay within ``max_sockets`` (least recently used first)."""
        self.reaped = 0
        """Sockets closed for being unused for ``idle_s``."""
        self.peak = 0
        """The most sockets open at once so far (at most ``max_sockets``)."""

    @property
    def open_count(self) -> int:
        """Sockets open now."""
        with self._lock:
            return len(self._sockets)

    def _socket(self, endpoint: str) -> _PeerSocket | None:
        closing: list[_PeerSocket] = []
        try:
            with self._lock:
                if self._closed:
                    raise SocketsClosed("PeerSockets is closed")
                now = self._clock()
                if now >= self._next_reap:
                    self._next_reap = now + self.idle_s / 4
                    self._reap(now, closing)
                entry = self._sockets.get(endpoint)
                if entry is not None:
                    entry.used = now
                    self._sockets.move_to_end(endpoint)
                    return entry
                sock = self._context.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, self._hwm)
                if self._security is not None and not self._security.connect(sock, endpoint):
                    sock.close(linger=0)
                    return None
                while len(self._sockets) >= self.max_sockets:
                    old, victim = self._sockets.popitem(last=False)
                    self._dropping.discard(old)
                    closing.append(victim)
                    self.evicted += 1
                sock.connect(endpoint)
                _opened(+1)
                entry = self._sockets[endpoint] = _PeerSocket(sock, now)
                self.peak = max(self.peak, len(self._sockets))
                return entry
        finally:
            for victim in closing:
                victim.close()

    def _reap(self, now: float, closing: list[_PeerSocket]) -> None:
        """Take out the sockets unused for ``idle_s`` (lock held; closed by the caller)."""
        sockets = self._sockets
        while sockets:
            endpoint, oldest = next(iter(sockets.items()))
            if now - oldest.used < self.idle_s:
                return
            del sockets[endpoint]
            self._dropping.discard(endpoint)
            closing.append(oldest)
            self.reaped += 1

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool:
        """Queue one multipart message for ``endpoint``; ``False`` if it was dropped.

        Raises:
            SocketsClosed: after :meth:`close`.
        """
        entry = self._socket(endpoint)
        if entry is not None:
            with entry.lock:
                if not entry.closed:
                    return self._send_on(entry.sock, endpoint, frames)
            entry = self._socket(endpoint)  # closed under us (evicted, reaped): reopen once
            if entry is not None:
                with entry.lock:
                    return not entry.closed and self._send_on(entry.sock, endpoint, frames)
        self.untrusted += 1
        if endpoint not in self._dropping and len(self._dropping) < self.max_sockets:
            self._dropping.add(endpoint)
            logger.warning("no CURVE key known for peer %s: not sending to it", endpoint)
        return False

    def _send_on(self, sock: zmq.Socket[bytes], endpoint: str, frames: Sequence[bytes]) -> bool:
        """Send on a peer's socket (its lock held)."""
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
            self._dropping.discard(endpoint)
        if entry is not None:
            entry.close()

    def close(self) -> None:
        """Close every socket; safe to call twice."""
        with self._lock:
            entries = list(self._sockets.values())
            self._sockets.clear()
            self._dropping.clear()
            self._closed = True
        for entry in entries:
            entry.close()


@dataclass(frozen=True, slots=True)
class ListenerStats:
    """What a listener has seen so far (exact counts, whatever the logs left out)."""

    received: int
    """Multipart messages received (a frame ZMQ dropped for its size never is)."""
    malformed: int
    """Messages the dispatch rejected with ``MalformedMessage``, or of too many frames."""
    errors: int
    """Dispatches and idle runs that raised anything else (bugs; logged with a traceback)."""


class Listener:
    """A PULL socket bound to an endpoint, drained by a thread of its own.

    The thread waits up to ``poll_interval_s`` for messages, dispatches at most
    ``drain_batch`` of them and for at most ``idle_interval_s``, then runs ``idle``, and
    again. So ``idle`` runs at least every ``max(poll_interval_s, idle_interval_s)`` plus the
    time of one dispatch and of ``idle`` itself, whatever the traffic: a flood delays neither
    idle work nor the messages of other peers (ZMQ queues each peer's messages apart and reads
    them in turn).

    Malformed messages (``dispatch`` raised :class:`~.wire.MalformedMessage`, or more than
    ``max_frames`` frames), failed dispatches and failed idle runs are each counted exactly in
    :meth:`stats` and logged through a :class:`LogThrottle` (``log_burst`` lines per
    ``log_interval_s`` each, then a summary). A frame over ``max_frame_bytes`` never reaches
    the thread: ZMQ drops it with its connection (see :data:`MAX_FRAME_BYTES`).

    **Thread-safety:** ``dispatch`` and ``idle`` run on the listener thread only; ``start``,
    ``stop`` and ``stats`` may be called from any thread.

    Args:
        dispatch: called with each multipart message (a list of frames) on the listener thread.
        name: the thread's name (shows in logs and thread dumps).
        host: address to bind (loopback by default).
        port: port to bind; 0 picks a free one.
        idle: called after every wake-up of the loop and between batches (for work that needs
            polling, such as an engine's notifications).
        poll_interval_s: longest wait for a message before ``idle`` runs again.
        drain_batch: most messages dispatched between two runs of ``idle``.
        idle_interval_s: longest time spent dispatching between two runs of ``idle``.
        max_frame_bytes: ``ZMQ_MAXMSGSIZE`` of the socket.
        max_frames: most frames of an accepted message.
        log_burst: log lines per ``log_interval_s`` for each kind of failure.
        log_interval_s: the interval of the log throttles.
        context: the ZMQ context (default: the process-wide instance).
        security: CURVE server keys and the trusted peers; only they can connect, and
            :attr:`sender` names each message's sender (``None``: plain TCP, no sender).

    Raises:
        ValueError: a bound is not positive.
        zmq.ZMQError: the endpoint cannot be bound (e.g. the port is taken).
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
        drain_batch: int = DRAIN_BATCH,
        idle_interval_s: float = IDLE_INTERVAL_S,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_frames: int = MAX_FRAMES,
        log_burst: int = LOG_BURST,
        log_interval_s: float = LOG_INTERVAL_S,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        security: ControlSecurity | None = None,
    ) -> None:
        if drain_batch < 1 or max_frame_bytes < 1 or max_frames < 1:
            raise ValueError(
                f"drain_batch={drain_batch}, max_frame_bytes={max_frame_bytes} and "
                f"max_frames={max_frames} must be >= 1"
            )
        if not (poll_interval_s > 0 and idle_interval_s > 0):
            raise ValueError(
                f"poll_interval_s={poll_interval_s} and idle_interval_s={idle_interval_s} "
                "must be > 0"
            )
        self._dispatch = dispatch
        self._idle = idle
        self._poll_ms = max(1, round(poll_interval_s * 1000))
        self._drain_batch = drain_batch
        self._idle_interval_s = idle_interval_s
        self._max_frames = max_frames
        self._malformed_log = LogThrottle(
            logger, f"{name}: malformed messages", burst=log_burst, interval_s=log_interval_s
        )
        self._error_log = LogThrottle(
            logger, f"{name}: failed dispatches", burst=log_burst, interval_s=log_interval_s
        )
        self._idle_log = LogThrottle(
            logger, f"{name}: failed idle runs", burst=log_burst, interval_s=log_interval_s
        )
        ctx = context or zmq.Context.instance()
        self._socket = ctx.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self._security = security
        if security is not None:
            security.serve(self._socket)
        self.sender: str | None = None
        """The endpoint of the peer whose message is being dispatched (with ``security``;
        ``None`` otherwise). Valid on the listener thread, during ``dispatch`` only."""
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
        throttles = (self._malformed_log, self._error_log, self._idle_log)
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                if poller.poll(self._poll_ms):
                    self._drain(started + self._idle_interval_s)
                if self._idle is not None:
                    self._run_idle(self._idle)
                for throttle in throttles:
                    throttle.tick()
        finally:
            for throttle in throttles:
                throttle.flush()
            self._socket.close(linger=0)
            self._closed = True
            _opened(-1)

    def _drain(self, until: float) -> None:
        """Dispatch up to a batch of waiting messages, stopping early at ``until``."""
        for _ in range(self._drain_batch):
            if self._stop.is_set():
                return
            try:
                frames, dropped, user, _ = recv_frames(
                    self._socket,
                    max_frames=self._max_frames,
                    flags=_NOBLOCK,
                    user_id=self._security is not None,
                )
            except zmq.Again:
                return
            if self._security is not None:
                self.sender = self._security.sender(user)
            self._received += 1
            if dropped:
                self._malformed += 1
                if self._malformed_log.admit():
                    logger.warning(
                        "%s: malformed message dropped: more than %d frames",
                        self._thread.name,
                        self._max_frames,
                    )
            else:
                self._handle(frames)
            if time.monotonic() >= until:
                return

    def _handle(self, frames: list[bytes]) -> None:
        try:
            self._dispatch(frames)
        except MalformedMessage as exc:
            self._malformed += 1
            if self._malformed_log.admit():
                logger.warning("%s: malformed message dropped: %s", self._thread.name, exc)
        except Exception:
            self._errors += 1
            if self._error_log.admit():
                logger.exception(
                    "%s: dispatch failed; the listener keeps serving", self._thread.name
                )

    def _run_idle(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            self._errors += 1
            if self._idle_log.admit():
                logger.exception(
                    "%s: idle work failed; the listener keeps serving", self._thread.name
                )
