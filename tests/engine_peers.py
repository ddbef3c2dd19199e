"""Child-process entry points for the two-process engine tests (started with ``spawn``).

A receiver registers a zeroed uint8 tensor and sends ``(session_id, metadata, address)`` to
the writer over a pipe; the writer registers seeded random bytes, writes a plan of transfers
in one bulk call (with a notification where the engine has them), and tells the receiver the
plan; the receiver checks every byte (at the moment the notification arrives, where there is
one) and reports to the parent. Each side closes its engine and returns, so the process
exits 0 by itself; any failure raises, so it exits 1, after reporting the error.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from staging_contracts.engines import load_engine_class
from staging_contracts.protocols import Notification, Transfer, TransferEngine, TransferError

__all__ = [
    "PLAN",
    "BatchLedger",
    "PeerJob",
    "closing_writer_main",
    "expected_buffer",
    "failing_poll_main",
    "receiver_main",
    "seeded_bytes",
    "stopped_receiver_main",
    "stopped_writer_main",
    "threaded_main",
    "writer_main",
]

BUFFER_BYTES = 1 << 20
SEED = 1234
PLAN: tuple[tuple[int, int, int], ...] = (
    # (source offset, destination offset, length)
    (0, 0, 4096),
    (10_000, 65_536, 1),
    (123_457, 200_003, 77_777),
    (500_000, BUFFER_BYTES - 12_345, 12_345),
)
NOTIFY = b"chunk-7-ready"


def seeded_bytes(size: int, seed: int = SEED) -> torch.Tensor:
    """``size`` random bytes, the same in every process for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)


def expected_buffer(plan: tuple[tuple[int, int, int], ...] = PLAN) -> torch.Tensor:
    """What the receiver's buffer holds after the writer carried out ``plan``."""
    source = seeded_bytes(BUFFER_BYTES)
    expected = torch.zeros(BUFFER_BYTES, dtype=torch.uint8)
    for src, dst, length in plan:
        expected[dst : dst + length] = source[src : src + length]
    return expected


@dataclass(frozen=True, slots=True)
class PeerJob:
    """What a child process runs: which engine, how to build it, and its bounds."""

    engine: str
    """Registry name of the engine."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Constructor options of the engine."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment set in the child before the engine is built (e.g. ``UCX_TLS``)."""
    timeout_s: float = 40.0
    """Bound on everything the child waits for."""
    bad_first: bool = False
    """Writer only: try writes outside the peer's memory first, expecting TransferError."""
    stall_s: float = 0.0
    """Receiver: drive no progress for this long after sending its metadata; the writer
    expects its first write to time out (its ``write_timeout_s`` must be shorter)."""
    slice_timeout_s: float | None = None
    """Mooncake writers only: build the engine on a :class:`BatchLedger` native engine; with a
    value, that engine also answers ``-2`` (timed out) for a batch running longer, as
    Mooncake's RDMA transport does after ``MC_SLICE_TIMEOUT`` (``None``: it never does)."""
    ledger: bool = False
    """Mooncake writers only: build the engine on a :class:`BatchLedger` native engine and
    report the ledger's summary."""


@dataclass(slots=True)
class BatchLedger:
    """The life of every batch id the real Mooncake engine of a process allocated for
    ``transfer_submit_write``.

    Mooncake frees a batch id inside ``transfer_check_status`` when it answers ``1`` (done)
    or ``-1`` (failed), and never otherwise: an id that never gets one of those answers leaks,
    and asking about an id after it was freed reads freed memory. The ledger counts both.

    ``slice_timeout_s`` makes the engine a **fake** in one respect: Mooncake's TCP transport
    never reports a timeout (its slices carry no timestamp), its RDMA transport does (after
    ``MC_SLICE_TIMEOUT``): a batch still running after ``slice_timeout_s`` is answered ``-2``,
    and, as Mooncake does, not freed. ``None`` turns that off (the network is healthy again).
    """

    slice_timeout_s: float | None = None
    submitted: int = 0
    freed: int = 0
    timeouts_reported: int = 0
    sync_calls: int = 0
    """Synchronous batch writes (Mooncake allocates and frees their ids itself)."""
    checked_after_free: int = 0
    live: dict[int, float] = field(default_factory=dict)
    """Allocated, not yet freed batch ids -> when they were submitted."""

    def summary(self) -> dict[str, int]:
        """Counts for the parent process (a pipe carries plain data)."""
        return {
            "submitted": self.submitted,
            "freed": self.freed,
            "never_freed": len(self.live),
            "checked_after_free": self.checked_after_free,
            "timeouts_reported": self.timeouts_reported,
            "sync_calls": self.sync_calls,
        }


def _install_batch_ledger(job: PeerJob) -> BatchLedger:
    """Make this process's :class:`MooncakeEngine` use a real native engine that keeps a
    :class:`BatchLedger` (the patch lasts as long as the child process)."""
    from mooncake.engine import TransferEngine as NativeEngine

    from staging_contracts.engines import mooncake as mooncake_engine

    ledger = BatchLedger(job.slice_timeout_s)

    class LedgerEngine(NativeEngine):
        def transfer_submit_write(
            self,
            target_hostname: str,
            buffer: int,
            peer_buffer_address: int,
            length: int,
            transport_hint: str = "",
        ) -> int:
            batch = super().transfer_submit_write(
                target_hostname, buffer, peer_buffer_address, length, transport_hint
            )
            if batch > 0:
                ledger.submitted += 1
                ledger.live[batch] = time.monotonic()
            return batch

        def transfer_check_status(self, batch_id: int, /) -> int:
            submitted = ledger.live.get(batch_id)
            if submitted is None:
                ledger.checked_after_free += 1
                return -1  # never hand a freed id to Mooncake
            state = super().transfer_check_status(batch_id)
            if state in (1, -1):
                del ledger.live[batch_id]
                ledger.freed += 1
            elif (
                state == 0
                and ledger.slice_timeout_s is not None
                and time.monotonic() - submitted > ledger.slice_timeout_s
            ):
                ledger.timeouts_reported += 1
                return -2
            return state

        def batch_transfer_sync_write(
            self,
            target_hostname: str,
            buffers: list[int],
            peer_buffer_addresses: list[int],
            lengths: list[int],
            transport_hint: str = "",
        ) -> int:
            ledger.sync_calls += 1
            return super().batch_transfer_sync_write(
                target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint
            )

    pytest.MonkeyPatch().setattr(mooncake_engine, "_NativeEngine", LedgerEngine)
    return ledger


def _make(job: PeerJob) -> TransferEngine:
    os.environ.update(job.env)
    engine_class = load_engine_class(job.engine)
    made: TransferEngine = engine_class(**job.options)
    return made


@contextmanager
def _child_engine(job: PeerJob, parent: Connection) -> Iterator[TransferEngine]:
    """The child's engine, closed on the way out; a failure is reported to the parent first,
    then raised, so the child exits 1."""
    made: TransferEngine | None = None
    try:
        made = _make(job)
        yield made
    except BaseException:
        parent.send(("error", traceback.format_exc()))
        raise
    finally:
        if made is not None:
            made.close()


def _recv(conn: Connection, deadline: float, engine: TransferEngine) -> Any:
    """Receive one message, driving ``engine`` while waiting (NIXL needs target progress)."""
    while not conn.poll(0.001):
        engine.poll_notifications()
        if time.monotonic() > deadline:
            raise TimeoutError("peer process sent nothing in time")
    return conn.recv()


def receiver_main(job: PeerJob, peer: Connection, parent: Connection) -> None:
    """Receive the writer's plan into a registered buffer and verify every byte."""
    deadline = time.monotonic() + job.timeout_s
    with _child_engine(job, parent) as made:
        buffer = torch.zeros(BUFFER_BYTES, dtype=torch.uint8)
        made.register(buffer.data_ptr(), BUFFER_BYTES)
        peer.send((made.session_id, made.metadata(), buffer.data_ptr()))
        time.sleep(job.stall_s)
        notes: list[Notification] = []
        seen_at_note: torch.Tensor | None = None
        done = None
        while done is None or (made.supports_notifications and not notes):
            arrived = made.poll_notifications()
            if arrived and not notes:
                seen_at_note = buffer.clone()  # the data must be there when the note is
            notes.extend(arrived)
            if done is None and peer.poll(0.001):
                done = peer.recv()
            if time.monotonic() > deadline:
                raise TimeoutError(f"receiver timed out (done={done!r}, notes={notes!r})")
        expected = expected_buffer()
        if not torch.equal(buffer, expected):
            wrong = int((buffer != expected).sum())
            raise AssertionError(f"{wrong} bytes differ from the plan")
        if made.supports_notifications:
            if seen_at_note is None or not torch.equal(seen_at_note, expected):
                raise AssertionError("the notification arrived before the data")
            writer_session = done[1]
            if notes != [Notification(writer_session, NOTIFY)]:
                raise AssertionError(f"unexpected notifications {notes!r}")
        peer.send("verified")
        parent.send(("ok", len(notes)))


def writer_main(job: PeerJob, peer: Connection, parent: Connection) -> None:
    """Write the plan in one bulk call; with ``bad_first``, rejected writes come first."""
    deadline = time.monotonic() + job.timeout_s
    with _child_engine(job, parent) as made:
        source = seeded_bytes(BUFFER_BYTES)
        base = source.data_ptr()
        made.register(base, BUFFER_BYTES)
        session, metadata, remote = _recv(peer, deadline, made)
        made.add_peer(session, metadata)
        notify = NOTIFY if made.supports_notifications else None
        rejected: list[str] = []
        if job.bad_first:
            past_end = Transfer(base, remote + BUFFER_BYTES - 10, 100)
            unregistered = Transfer(base, remote + (1 << 32), 100)
            for bad in (past_end, unregistered):
                try:
                    made.write(session, [bad], notify=b"bad" if notify else None)
                except TransferError as exc:
                    rejected.append(str(exc))
                else:
                    raise AssertionError(f"a write outside the peer's memory was accepted: {bad}")
        transfers = [Transfer(base + src, remote + dst, n) for src, dst, n in PLAN]
        if job.stall_s:
            try:
                made.write(session, transfers)  # the same bytes, whenever they land
            except TransferError as exc:
                rejected.append(str(exc))
            else:
                raise AssertionError("a write to a stalled receiver did not time out")
            time.sleep(job.stall_s)  # the receiver drives progress again by then
        started = time.perf_counter()
        made.write(session, transfers, notify=notify)
        elapsed = time.perf_counter() - started
        peer.send(("done", made.session_id))
        if _recv(peer, deadline, made) != "verified":
            raise AssertionError("receiver did not verify")
        parent.send(("ok", {"rejected": rejected, "write_s": elapsed}))


def threaded_main(job: PeerJob, parent: Connection) -> None:
    """Two engines in one process: two threads write while a third polls notifications."""
    deadline = time.monotonic() + job.timeout_s
    writes_per_thread, chunk = 50, 4096
    engines: list[TransferEngine] = []
    try:
        source, target = _make(job), _make(job)
        engines += [source, target]
        data = seeded_bytes(2 * writes_per_thread * chunk)
        sink = torch.zeros_like(data)
        source.register(data.data_ptr(), data.numel())
        target.register(sink.data_ptr(), sink.numel())
        source.add_peer(target.session_id, target.metadata())
        notes: list[Notification] = []
        stop = threading.Event()
        failures: list[str] = []

        def poll() -> None:
            while not stop.is_set() and time.monotonic() < deadline:
                notes.extend(target.poll_notifications())
                time.sleep(0.0001)

        def write(thread: int) -> None:
            try:
                for index in range(writes_per_thread):
                    offset = (thread * writes_per_thread + index) * chunk
                    transfer = Transfer(data.data_ptr() + offset, sink.data_ptr() + offset, chunk)
                    payload = f"{thread}:{index}".encode()
                    note = payload if source.supports_notifications else None
                    source.write(target.session_id, [transfer], notify=note)
            except (TransferError, ValueError):
                failures.append(traceback.format_exc())

        poller = threading.Thread(target=poll, name="poller")
        writers = [threading.Thread(target=write, args=(n,), name=f"writer-{n}") for n in (0, 1)]
        for thread in (poller, *writers):
            thread.start()
        for thread in writers:
            thread.join(max(0.0, deadline - time.monotonic()))
        expected = 2 * writes_per_thread if source.supports_notifications else 0
        if source.supports_notifications:  # notifications without data, and empty ones
            whole = Transfer(data.data_ptr(), sink.data_ptr(), chunk)
            source.write(target.session_id, [], notify=b"bare")
            source.write(target.session_id, [whole], notify=b"")
            expected += 2
        while len(notes) < expected and time.monotonic() < deadline:
            time.sleep(0.001)
        stop.set()
        poller.join(max(0.0, deadline - time.monotonic()))
        if failures or any(t.is_alive() for t in (poller, *writers)):
            raise AssertionError("".join(failures) or "a thread did not finish in time")
        if not torch.equal(sink, data):
            raise AssertionError("the threaded writes did not land exactly")
        for writer_index in (0, 1):
            prefix = f"{writer_index}:".encode()
            mine = [n.payload for n in notes if n.payload.startswith(prefix)]
            if mine != [prefix + str(index).encode() for index in range(len(mine))]:
                raise AssertionError(f"notes of writer {writer_index} out of order: {mine!r}")
        extra = [n.payload for n in notes if b":" not in n.payload]
        if source.supports_notifications and extra != [b"bare", b""]:
            raise AssertionError(f"unexpected bare or empty notifications: {extra!r}")
        if len(notes) != expected or {n.peer for n in notes} - {source.session_id}:
            raise AssertionError(f"expected {expected} notifications, got {len(notes)}")
        parent.send(("ok", len(notes)))
    except BaseException:
        parent.send(("error", traceback.format_exc()))
        raise
    finally:
        for made in engines:
            made.close()


STOPPED_BYTES = 64 << 20
"""Large enough that loopback socket buffers cannot absorb a write to a stopped process."""


def stopped_receiver_main(job: PeerJob, peer: Connection, parent: Connection) -> None:
    """Offer a buffer and this process's pid (the writer stops and resumes it); verify."""
    deadline = time.monotonic() + job.timeout_s
    with _child_engine(job, parent) as made:
        buffer = torch.zeros(STOPPED_BYTES, dtype=torch.uint8)
        made.register(buffer.data_ptr(), STOPPED_BYTES)
        peer.send((made.session_id, made.metadata(), buffer.data_ptr(), os.getpid()))
        if _recv(peer, deadline, made) != "done":
            raise AssertionError("writer did not finish")
        if not torch.equal(buffer, seeded_bytes(STOPPED_BYTES)):
            raise AssertionError("the write after the resume did not land exactly")
        peer.send("verified")
        parent.send(("ok", None))


def stopped_writer_main(job: PeerJob, peer: Connection, parent: Connection) -> None:
    """Write to a stopped receiver (times out), write the same range again (refused while
    the first write may still read it), resume the receiver, and write until it lands."""
    from staging_contracts.engines.mooncake import MooncakeEngine

    deadline = time.monotonic() + job.timeout_s
    ledger = _install_batch_ledger(job) if job.ledger else None
    with _child_engine(job, parent) as made:
        source = seeded_bytes(STOPPED_BYTES)
        made.register(source.data_ptr(), STOPPED_BYTES)
        session, metadata, remote, pid = _recv(peer, deadline, made)
        made.add_peer(session, metadata)
        whole = [Transfer(source.data_ptr(), remote, STOPPED_BYTES)]
        errors: list[str] = []
        made.write(session, [Transfer(source.data_ptr(), remote, 4096)])  # connected now
        os.kill(pid, signal.SIGSTOP)
        try:
            for _ in range(2):
                try:
                    made.write(session, whole)
                except TransferError as exc:
                    errors.append(str(exc))
            held = made.unfinished_writes if isinstance(made, MooncakeEngine) else None
        finally:
            os.kill(pid, signal.SIGCONT)
            if ledger is not None:
                ledger.slice_timeout_s = None  # the network is healthy again
        while True:
            try:
                made.write(session, whole)
                break
            except TransferError as exc:
                if "still read by a write that timed out" not in str(exc):
                    raise
                if time.monotonic() > deadline:
                    raise TimeoutError("the timed-out write never ended") from exc
                time.sleep(0.01)
        peer.send("done")
        if _recv(peer, deadline, made) != "verified":
            raise AssertionError("receiver did not verify")
        made.close()
        summary = ledger and ledger.summary()
        parent.send(("ok", {"errors": errors, "held": held, "ledger": summary}))


def closing_writer_main(job: PeerJob, peer: Connection, parent: Connection) -> None:
    """Write two halves in one call to a stopped receiver (times out), then close the engine
    while the receiver resumes: ``close`` waits for the given-up write to end.

    Reports the write's error and duration, how long ``close`` took, and the ledger.
    """
    deadline = time.monotonic() + job.timeout_s
    ledger = _install_batch_ledger(job)
    with _child_engine(job, parent) as made:
        source = seeded_bytes(STOPPED_BYTES)
        base = source.data_ptr()
        made.register(base, STOPPED_BYTES)
        session, metadata, remote, pid = _recv(peer, deadline, made)
        made.add_peer(session, metadata)
        made.write(session, [Transfer(base, remote, 4096)])  # connected now
        half = STOPPED_BYTES // 2
        halves = [Transfer(base, remote, half), Transfer(base + half, remote + half, half)]
        os.kill(pid, signal.SIGSTOP)
        resume = threading.Timer(0.5, os.kill, (pid, signal.SIGCONT))
        try:
            started = time.monotonic()
            try:
                made.write(session, halves)
            except TransferError as exc:
                error = str(exc)
            else:
                raise AssertionError("a write to a stopped receiver did not time out")
            write_s = time.monotonic() - started
            resume.start()
            started = time.monotonic()
            made.close()  # the receiver resumes while this waits
            close_s = time.monotonic() - started
        finally:
            resume.cancel()
            os.kill(pid, signal.SIGCONT)
        peer.send("done")
        if _recv(peer, deadline, made) != "verified":
            raise AssertionError("receiver did not verify")
        result = {"error": error, "write_s": write_s, "close_s": close_s}
        parent.send(("ok", {**result, "ledger": ledger.summary()}))


class _Records(logging.Handler):
    """Keeps every record logged to it, formatted with its traceback."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def failing_poll_main(job: PeerJob, parent: Connection) -> None:
    """Two NIXL engines in one process; the receiver's agent fails one poll while it holds
    a notification fetched earlier and another waits in the agent.

    The failure is a **fake** (NIXL cannot be made to fail a poll on demand): the real
    agent's ``get_new_notifs`` raises once instead of fetching, so the fake itself loses
    nothing. Reports every payload the receiver returned, what its polls raised, and what
    the engine logged.
    """
    deadline = time.monotonic() + job.timeout_s
    engines: list[TransferEngine] = []
    records = _Records()
    logging.getLogger("staging_contracts.engines").addHandler(records)
    logging.getLogger("staging_contracts.engines").setLevel(logging.DEBUG)
    try:
        from staging_contracts.engines.nixl import NixlEngine

        source, target = _make(job), _make(job)
        engines += [source, target]
        if not isinstance(target, NixlEngine):
            raise TypeError(f"{job.engine!r} does not make a NixlEngine")
        data = seeded_bytes(4096)
        sink = torch.zeros_like(data)
        source.register(data.data_ptr(), data.numel())
        target.register(sink.data_ptr(), sink.numel())
        source.add_peer(target.session_id, target.metadata())
        agent = target._agent  # the real agent the fault goes into
        if agent is None:
            raise AssertionError("a new NIXL engine has no agent")
        real_poll = agent.get_new_notifs
        fetched: list[int] = []
        fail_next: list[str] = []

        def flaky_poll(backends: list[str] | None = None) -> dict[str, list[bytes]]:
            if fail_next:
                raise RuntimeError(fail_next.pop())
            arrived: dict[str, list[bytes]] = real_poll(backends or [])
            fetched.append(sum(len(payloads) for payloads in arrived.values()))
            return arrived

        pytest.MonkeyPatch().setattr(agent, "get_new_notifs", flaky_poll)
        whole = [Transfer(data.data_ptr(), sink.data_ptr(), data.numel())]
        source.write(target.session_id, whole, notify=b"first")
        while sum(fetched) < 1:  # fetched by the engine, not yet returned to anyone
            target.progress()
            if time.monotonic() > deadline:
                raise TimeoutError("the first notification never arrived")
        source.write(target.session_id, whole, notify=b"second")
        fail_next.append("injected: the agent failed to poll")
        payloads: list[bytes] = []
        raised: list[str] = []
        give_up = min(deadline, time.monotonic() + 5.0)  # both arrived long before
        while len(payloads) < 2 and time.monotonic() < give_up:
            try:
                payloads += [note.payload for note in target.poll_notifications()]
            except RuntimeError as exc:
                raised.append(repr(exc))
            time.sleep(0.001)
        report = {"payloads": payloads, "raised": raised, "logs": records.lines}
        parent.send(("ok", report))
    except BaseException:
        parent.send(("error", traceback.format_exc()))
        raise
    finally:
        for made in engines:
            made.close()
