"""One long-running prefill or decode rank of a soak, as an OS process of its own.

Started by :func:`staging_contracts._cluster.soak.run_soak` (``multiprocessing`` spawn), one
process per rank, and started again after the soak kills it. Unlike a
:mod:`~staging_contracts._cluster.rank` process, which runs a fixed list of requests and exits,
a soak rank serves rooms until it is told to stop: the driver sends it commands and it
reports events (:mod:`._messages`; commands on the rank's PULL socket, bound on loopback).

**Commands.** ``Peers``: the current ranks of the other side; the rank trusts their
listeners by the CURVE keys they published, decode points its per-request layer at them,
prefill adds the decode engines it does not know yet; it answers ``PeersTaken``, and only
then is it sent rooms. ``OpenRoom``: decode zeroes the request's pages and registers the
room, prefill opens it and queues every chunk; a thread per room waits for its end (bounded
by :attr:`RankSettings.room_bound_s`) and answers ``RoomEnded`` (``ok``, ``failed`` or
``hung``). A room that comes before the peers waits for them up to
:attr:`RankSettings.peers_wait_s`, then fails; one that cannot be opened fails with the
error (and a ``RankError``): every ``OpenRoom`` is answered by one ``RoomEnded``.
``AskStatus``: answered by the rank's counters (``RankStatus``). ``Trust``: a participant to
trust, as one learned from the bootstrap would be (the authenticated ``flood``'s sender).
``Stop``: close the backend and exit.

**Events** besides those answers: ``Serving`` (its ``RankInfo`` and command endpoint, once
up), ``RankError`` (a command that raised; the rank lives on), ``ListenerDown`` (its control
listener thread ended), ``Metrics`` and ``Exit``.

**Fault ``drop``:** with :attr:`RankSettings.drop_share` above 0, the rank's
``PeerSockets.send`` drops that share of its outgoing control messages (a seeded draw): every
message between ranks, ``PING`` and ``PONG`` included, can be lost.

The rank exits by itself when the driver's process is gone (its parent changed).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Final, Protocol

import torch
import zmq

from .._control.transport import PeerSockets
from .._decode.handler import PrefillPeer, peers_for
from .._prefill.writer import DecodeTarget, PrefillTimeouts
from .._run._codec import Message, bind_pull, decode, encode
from .._run._rank_body import BodyOptions, DecodeBody, PrefillBody, RankBody, freeze_heap
from .._run._rank_info import RankInfo
from .._run.workload import TransferConfig, request_plans, token_rows, verify_decode_pool
from ..backends._common import Role
from ..backends._kv_requests import DecodeTransfers, KVPoll
from ..backends._staging_setup import StagingBackend
from ..metrics import snapshot_of
from . import logformat
from ._messages import (
    AskStatus,
    Exit,
    ListenerDown,
    Metrics,
    OpenRoom,
    Peers,
    PeersTaken,
    RankError,
    RankStatus,
    RoomEnded,
    Serving,
    Stop,
    Trust,
)
from .metrics_relay import REPORT_EVERY_S
from .soak_memory import RssSampler
from .soak_ticker import Ticker

logger = logging.getLogger(__name__)

COMMAND_POLL_MS: Final = 100
"""Longest the rank's main loop waits for a command before it checks its listener and parent."""
CLOSE_TIMEOUT_S: Final = Stop().close_s
"""Longest the prefill worker gets to stop at ``stop``, unless the command says less."""
SOAK_PREFILL_TIMEOUTS: Final = PrefillTimeouts(answer_s=0.2, ready_s=0.2, deadline_s=10.0)
"""A soak prefill's chunk waits: quick re-requests (lost answers are part of the soak), and
a deadline well under the room bound."""
SOAK_BODY: Final = BodyOptions(
    liveness_timeout_s=3.0,
    stall_timeout_s=4.0,
    prefill_timeouts=SOAK_PREFILL_TIMEOUTS,
    meta_timeout_s=5.0,
    log_level=logging.ERROR,
)
"""A soak rank's backend set-up unless told otherwise: a peer silent 3 s is dead, a decode
room without progress 4 s fails, a prefill chunk waits 5 s for ``ROOM_META``."""


@dataclass(frozen=True, slots=True)
class RankSettings:
    """What every rank process of a soak is started with (picklable, the same for all)."""

    transfer: TransferConfig
    """Geometry, TP sizes, backend and seeded requests (rooms pick a request by index)."""
    body: BodyOptions = SOAK_BODY
    """Where the backend binds (the command socket is always on loopback), its peer liveness,
    stall and chunk bounds, integrity check and log level."""
    room_bound_s: float = 45.0
    """A room not ended on this rank this long after its ``room`` command is reported
    ``hung`` (and released)."""
    peers_wait_s: float = 5.0
    """Longest a ``room`` command that came before the rank knew its peers waits for them;
    then the room is reported ``failed``."""
    drop_share: float = 0.0
    """Share of outgoing control messages the ``drop`` fault discards (0: none)."""
    seed: int = 0
    """Seeds the ``drop`` draws (mixed with the role, rank and process id)."""
    metrics: bool = False
    """Send a ``metrics`` event every second, and before each ``status`` (``--metrics-port``)."""


@dataclass
class DropCounter:
    """What the ``drop`` fault did in one process (read from any thread)."""

    sent: int = 0
    """Control messages the rank tried to send."""
    dropped: int = 0
    """Of those, dropped by the fault."""


def install_drop(peers: PeerSockets, share: float, rng: random.Random) -> DropCounter:
    """Make ``peers.send`` drop ``share`` of the messages it is given (a fault injection).

    The instance's ``send`` is replaced, so everything that holds this ``PeerSockets`` (the
    manager, peer liveness, the decode handler, the prefill writer) loses messages alike. A
    dropped message is reported as sent (``True``), as a message lost on the network would be.

    **Called by:** the rank, before its listener starts. **Thread-safety:** the replacement
    may be called from any thread.

    Raises:
        ValueError: ``share`` is not in ``[0, 1)``.
    """
    if not 0.0 <= share < 1.0:
        raise ValueError(f"drop share {share!r} must be in [0, 1)")
    counter = DropCounter()
    original = peers.send
    lock = threading.Lock()

    def send(endpoint: str, frames: Sequence[bytes]) -> bool:
        with lock:
            counter.sent += 1
            drop = rng.random() < share
            counter.dropped += drop
        return True if drop else original(endpoint, frames)

    peers.send = send  # type: ignore[method-assign]  # the fault: this instance only
    return counter


def soak_rank_main(role: str, rank: int, settings: RankSettings, driver: str) -> None:
    """Process entry point: serve the driver's commands until ``stop``; never raise.

    **Blocking:** until ``stop``, or until the driver's process is gone.

    Args:
        role: ``"prefill"`` or ``"decode"``.
        rank: the rank's attention-TP rank.
        settings: the soak's rank settings.
        driver: the driver's PULL endpoint, where events go.
    """
    logformat.install(
        role=role,
        rank=rank,
        label=f"soak {role}{rank} pid {os.getpid()}",
        level=settings.body.log_level,
    )
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's C++ info and warning logs
    torch.set_num_threads(1)
    parent = os.getppid()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    events = _Events(ctx, driver, role, rank)
    server: _RankServer | None = None
    try:
        server = (_DecodeServer if role == "decode" else _PrefillServer)(rank, settings, events)
        server.serve(ctx, parent)
    except BaseException as exc:  # the driver hears of every failure, even KeyboardInterrupt
        logger.exception("soak rank failed")
        events.send(Exit(False, f"{type(exc).__name__}: {exc}"))
    else:
        events.send(Exit(True))
    finally:
        if server is not None:
            server.close()
        events.close()


class EventSink(Protocol):
    """Where a rank's events go (the driver's socket; a list in tests)."""

    def send(self, event: Message) -> None:
        """Send one event; never raises (a lost event is logged)."""


class _Events:
    """The rank's PUSH socket to the driver; ``send`` may be called from any thread."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], driver: str, role: str, rank: int):
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.SNDTIMEO, 2000)
        self._sock.connect(driver)
        self._lock = threading.Lock()
        self._sender = (role, rank)

    def send(self, event: Message) -> None:
        with self._lock:
            try:
                self._sock.send(encode(event, *self._sender))
            except (zmq.ZMQError, TypeError, ValueError) as exc:  # zmq.Again, closed, or a bug
                logger.error("%s event dropped: %s", type(event).__name__, exc)

    def close(self) -> None:
        with self._lock:
            self._sock.close()


class CommandLoop:
    """A soak rank's command handling, apart from its backend (the module's docstring says
    what each command does, and how every ``OpenRoom`` is answered by one ``RoomEnded``; an
    exception while a room's thread waits for its end fails the room too). Subclasses
    supply the side: :meth:`peers_known`, :meth:`on_peers`, :meth:`open_room`,
    :meth:`status` and :meth:`trust_one`.

    **Threads:** :meth:`command` and :meth:`expire` are called on the rank's main thread;
    the room threads only call ``events.send`` (thread-safe). ``clock`` is
    ``time.monotonic`` unless a test gives its own.
    """

    def __init__(
        self,
        events: EventSink,
        settings: RankSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.events = events
        self.settings = settings
        self.clock = clock
        self.threads: list[threading.Thread] = []
        self.waiting_rooms: list[tuple[int, int, float]] = []
        """Rooms that came before the peers: ``(room, index, deadline)``, in order."""
        self.room_instance: dict[int, int] = {}
        """Room -> the prefill instance it comes from (``room`` commands' ``instance``;
        decode reads it when it opens the room)."""
        self.close_s = CLOSE_TIMEOUT_S
        """How long the prefill worker gets at close (the ``stop`` command says)."""

    # ------------------------------------------------------------------ to override

    def peers_known(self) -> bool:
        """Whether a ``peers`` command was taken (rooms can open)."""
        raise NotImplementedError

    def on_peers(self, ranks: list[RankInfo]) -> None:
        raise NotImplementedError

    def open_room(self, room: int, index: int) -> Callable[[], RoomEnded]:
        """Start a room; returns the function its thread calls to wait, report and release."""
        raise NotImplementedError

    def status(self, ask: AskStatus) -> RankStatus:
        raise NotImplementedError

    def trust_one(self, endpoint: str, key: str) -> None:
        """Trust the participant with CURVE public ``key`` (Z85) at ``endpoint``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ commands

    def command(self, raw: bytes) -> bool:
        """Run one command; ``False`` on ``stop``. A failing command is reported, not fatal."""
        try:
            command = decode(raw).message
            if isinstance(command, Stop):
                self.close_s = command.close_s
                return False
            if isinstance(command, Peers):
                self.on_peers(list(command.ranks))
                self.events.send(PeersTaken(len(command.ranks)))
                waiting, self.waiting_rooms = self.waiting_rooms, []
                for room, index, _ in waiting:
                    self._start(room, index)
            elif isinstance(command, OpenRoom):
                self.room_instance[command.room] = command.instance
                if self.peers_known():
                    self._start(command.room, command.index)
                else:
                    deadline = self.clock() + self.settings.peers_wait_s
                    self.waiting_rooms.append((command.room, command.index, deadline))
            elif isinstance(command, AskStatus):
                self.events.send(self.status(command))
            elif isinstance(command, Trust):
                self.trust_one(command.endpoint, command.key)
            else:
                raise ValueError(f"not a command: {type(command).__name__}")
        except Exception as exc:  # a bad command or a failing call: report, keep serving
            logger.exception("command failed")
            self.events.send(RankError(f"{type(exc).__name__}: {exc}", raw[:200].hex()))
        return True

    def expire(self) -> None:
        """Fail the rooms that waited for peers longer than ``peers_wait_s``."""
        now = self.clock()
        due = [item for item in self.waiting_rooms if item[2] <= now]
        if not due:
            return
        self.waiting_rooms = [item for item in self.waiting_rooms if item[2] > now]
        for room, index, _ in due:
            self.room_instance.pop(room, None)
            reason = f"no peers known {self.settings.peers_wait_s:g} s after the room came"
            self.events.send(RoomEnded(room, index, "failed", now, reason))

    def _start(self, room: int, index: int) -> None:
        try:
            finish = self.open_room(room, index)
        except Exception as exc:  # the room fails with the error; the rank lives on
            logger.exception("room %d: opening it failed", room, extra={"room": room})
            error = f"{type(exc).__name__}: {exc}"
            self.events.send(RankError(f"room {room}: {error}"))
            reason = f"rank error: opening the room failed: {error}"
            self.events.send(RoomEnded(room, index, "failed", self.clock(), reason))
            return

        def run() -> None:
            try:
                ended = finish()
            except Exception as exc:  # the room's end could not be read: say so
                logger.exception("room %d: waiting for its end failed", room, extra={"room": room})
                reason = f"rank error: {type(exc).__name__}: {exc}"
                ended = RoomEnded(room, index, "failed", time.monotonic(), reason)
            self.events.send(ended)

        thread = threading.Thread(target=run, name=f"soak-room-{room}", daemon=True)
        thread.start()
        self.threads = [t for t in self.threads if t.is_alive()]
        self.threads.append(thread)


class _RankServer(CommandLoop):
    """What both sides share: the body, the command loop, status, the room threads."""

    role: Role
    body: RankBody

    def __init__(
        self,
        rank: int,
        settings: RankSettings,
        events: _Events,
        body: Callable[[TransferConfig, int, BodyOptions], RankBody],
    ) -> None:
        super().__init__(events, settings)
        self.config = settings.transfer
        tp = self.config.prefill_tp if self.role is Role.PREFILL else self.config.decode_tp
        # Prefill ranks of every instance are numbered on: instance i's TP rank r is rank
        # i * prefill_tp + r (its events carry that number; its engine and pool, r).
        self.label_rank = rank
        """The rank's number in the soak (its events' and its metrics' ``rank``)."""
        self.rank = rank % tp
        self.drops = DropCounter()

        def drop(manager: StagingBackend) -> None:
            rng = random.Random(f"{settings.seed}-{self.role.value}-{self.rank}-{os.getpid()}")
            self.drops = install_drop(manager.peers, settings.drop_share, rng)

        options = replace(settings.body, prepare=drop if settings.drop_share > 0 else None)
        self.listener_reported = False
        self.memory = RssSampler()
        """This process's RSS samples, sent with every ``status`` (see ``soak_memory``)."""
        self.reporter = Ticker(float("-inf"), REPORT_EVERY_S) if settings.metrics else None
        self.plans = request_plans(self.config)
        """Each request's pages, by request index (``OpenRoom.index``)."""
        self.body = body(self.config, self.rank, options)
        self.body.common.start()

    # ------------------------------------------------------------------ to override

    def side_status(self, status: RankStatus) -> RankStatus:
        """``status`` with the side's counters."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the loop

    def serve(self, ctx: zmq.Context[zmq.Socket[bytes]], parent: int) -> None:
        commands, endpoint = bind_pull(ctx)
        try:
            freeze_heap()
            self.events.send(Serving(self.body.info(), endpoint))
            while True:
                if commands.poll(COMMAND_POLL_MS) and not self.command(commands.recv()):
                    return
                self.expire()
                if not self.listener_reported and not self.body.common.listener.alive:
                    self.listener_reported = True
                    logger.error("the control listener thread ended")
                    self.events.send(ListenerDown())
                self.memory.maybe_sample(time.monotonic())
                if self.reporter is not None and self.reporter.due(time.monotonic()):
                    self.send_metrics()
                if os.getppid() != parent:
                    logger.error("the soak driver is gone; exiting")
                    return
        finally:
            commands.close(linger=0)

    def send_metrics(self) -> None:
        """Send this rank's counters to the driver (a ``metrics`` event)."""
        snapshot = snapshot_of(
            self.body.common,
            transfers=self.body.transfers if isinstance(self.body, PrefillBody) else None,
            role=self.role.value,
            rank=self.label_rank,
            engine=self.config.backend,
        )
        self.events.send(Metrics(snapshot))

    def status(self, ask: AskStatus) -> RankStatus:
        if self.reporter is not None:  # ahead of the status: the driver's last word agrees
            self.send_metrics()
        stats = self.body.manager.staging_stats()
        listener = self.body.common.listener.stats()
        return self.side_status(
            RankStatus(
                ask.id,
                self.body.common.listener.alive,
                listener.received,
                listener.malformed,
                listener.errors,
                stats.malformed,
                stats.dropped,
                self.body.manager.unauthorized,
                self.drops.sent,
                self.drops.dropped,
                sum(t.is_alive() for t in self.threads),
                len(self.waiting_rooms),
                tuple((t, rss) for t, rss in self.memory.samples),
            )
        )

    def trust_one(self, endpoint: str, key: str) -> None:
        self.body.common.trust_peer(endpoint, key.encode("ascii") or None)

    def close(self) -> None:
        self.body.close()


class _DecodeServer(_RankServer):
    role = Role.DECODE
    body: DecodeBody

    def __init__(self, rank: int, settings: RankSettings, events: _Events) -> None:
        super().__init__(rank, settings, events, DecodeBody)
        self.transfers: DecodeTransfers | None = None
        self.instance_peers: list[tuple[PrefillPeer, ...]] = []
        """Each prefill instance's peers for this rank (``peers_for``), by instance."""

    def on_peers(self, ranks: list[RankInfo]) -> None:
        self.body.trust(ranks)
        # The driver sends every instance's ranks, instance by instance, each in TP order.
        tp = self.config.prefill_tp
        endpoints = [info.endpoint for info in ranks]
        if not endpoints or len(endpoints) % tp:
            raise ValueError(f"{len(endpoints)} prefill ranks, expected a multiple of {tp}")
        groups = [endpoints[i : i + tp] for i in range(0, len(endpoints), tp)]
        # Rooms registered from now on go to the new prefill ranks; rooms in flight keep
        # the peers of their plan.
        self.instance_peers = [
            peers_for(group, tp, self.config.decode_tp, self.rank) for group in groups
        ]
        if self.transfers is None:
            self.transfers = DecodeTransfers(self.body.common, self.body.handler, groups[0])
        self.transfers.peers = self.instance_peers[0]

    def peers_known(self) -> bool:
        return self.transfers is not None

    def open_room(self, room: int, index: int) -> Callable[[], RoomEnded]:
        if self.transfers is None:  # CommandLoop holds rooms until the peers are known
            raise RuntimeError("a room before the prefill ranks are known")
        plan = self.plans[index]
        instance = self.room_instance.pop(room, 0)
        if not 0 <= instance < len(self.instance_peers):
            raise ValueError(f"room {room}: prefill instance {instance} is not known")
        # The command thread opens every room: the peers set here are the ones init reads.
        self.transfers.peers = self.instance_peers[instance]
        self._zero(plan.decode_pages)
        receiver = self.body.receive(self.transfers, room, plan.decode_pages)
        deadline = time.monotonic() + self.settings.room_bound_s

        def finish() -> RoomEnded:
            state = receiver.wait(max(0.0, deadline - time.monotonic()))
            ended = _ended(room, index, state, receiver.failure)
            if state is KVPoll.Success:
                problems = verify_decode_pool(self.body.pool, self.config, self.rank, {index})
                ended = replace(ended, verified=not problems, problems=tuple(problems[:3]))
            try:
                receiver.release()
            except TimeoutError as exc:
                ended = replace(ended, release_error=str(exc))
            return ended

        return finish

    def _zero(self, pages: tuple[int, ...]) -> None:
        """Zero a request's pages, so that a room that moves nothing cannot verify."""
        rows = token_rows(pages, self.config.page_size)
        for buffer in (*self.body.pool.k_buffers, *self.body.pool.v_buffers):
            buffer[rows] = 0

    def side_status(self, status: RankStatus) -> RankStatus:
        allocator, handler = self.body.handler.allocator, self.body.handler
        return replace(
            status,
            ring_live_count=allocator.live_count,
            ring_live_bytes=allocator.live_bytes,
            ring_size=allocator.total_size,
            fenced_rooms=len(handler.fenced_rooms),
            open_rooms=handler.live_rooms,
        )


class _PrefillServer(_RankServer):
    role = Role.PREFILL
    body: PrefillBody

    def __init__(self, rank: int, settings: RankSettings, events: _Events) -> None:
        super().__init__(rank, settings, events, PrefillBody)
        self.targets: list[DecodeTarget] = []
        self.open = 0
        self.lock = threading.Lock()

    def on_peers(self, ranks: list[RankInfo]) -> None:
        if len(ranks) != self.config.decode_tp:
            raise ValueError(f"{len(ranks)} decode ranks, expected {self.config.decode_tp}")
        self.targets = self.body.meet(ranks)

    def peers_known(self) -> bool:
        return bool(self.targets)

    def open_room(self, room: int, index: int) -> Callable[[], RoomEnded]:
        if not self.targets:  # CommandLoop holds rooms until the peers are known
            raise RuntimeError("a room before the decode ranks are known")
        sender = self.body.send(room, self.plans[index], self.targets)
        deadline = time.monotonic() + self.settings.room_bound_s
        with self.lock:
            self.open += 1

        def finish() -> RoomEnded:
            try:
                state = sender.wait(max(0.0, deadline - time.monotonic()))
                return _ended(room, index, state, sender.failure)
            finally:
                sender.release()
                with self.lock:
                    self.open -= 1

        return finish

    def side_status(self, status: RankStatus) -> RankStatus:
        with self.lock:
            open_rooms = self.open
        writer, transfers = self.body.writer, self.body.transfers
        return replace(
            status,
            open_rooms=open_rooms,
            bytes_written=writer.bytes_written,
            answers_held=writer.answers_held,
            answers_dropped=writer.answers_dropped,
            early_meta=transfers.early_meta_count,
            early_meta_held=transfers.early_meta_held,
            early_meta_dropped=transfers.early_meta_dropped,
        )

    def close(self) -> None:
        self.body.close_side(self.close_s)
        super().close()


def _ended(room: int, index: int, state: KVPoll, failure: Callable[[], str | None]) -> RoomEnded:
    """How a room ended on this rank, now: ``ok``, ``failed`` (``failure()``'s reason) or
    ``hung`` (still in ``state`` at its bound)."""
    end = time.monotonic()
    if state is KVPoll.Success:
        return RoomEnded(room, index, "ok", end)
    if state is KVPoll.Failed:
        return RoomEnded(room, index, "failed", end, failure() or "unknown")
    return RoomEnded(room, index, "hung", end, f"still {state.name}")
