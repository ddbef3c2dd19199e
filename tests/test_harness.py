"""``run_transfer``: a staged transfer through a backend, verified page by page, and diagnosed.

The working backend is ``LocalKVManager``; the broken ones are small variants of it, each
missing one piece of wiring a backend author can forget (the idle hook, the routing of
``CHUNK_READY``), or an engine that moves the wrong bytes. Each must fail with a diagnosis that
names that piece.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence

import pytest

from staging_contracts import (
    ArrivalMode,
    DecodeStagingContext,
    KVArgs,
    PrefillStagingContext,
    StagingHandler,
    StagingManagerMixin,
)
from staging_contracts._control.transport import open_socket_count
from staging_contracts._control.wire import ChunkReady
from staging_contracts.backends._common import CommonKVManager, Role
from staging_contracts.backends._kv_requests import KVPoll
from staging_contracts.backends._staging_setup import staging_idle
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.engines.local import LocalEngine
from staging_contracts.protocols import Transfer
from staging_contracts.testing import (
    IDLE_HOOK_HINT,
    ManagerFactory,
    TransferGeometry,
    TransferManager,
    TransferReport,
    run_transfer,
)

SHORT_S = 2.0
"""Timeout of the runs that must fail: they end by timing out."""


class IdleHookless(LocalKVManager):
    """The issue's "bad_g": ``_on_idle`` does not call ``staging_idle``, so the engine's
    arrival notifications are never delivered."""

    def _on_idle(self) -> None:
        pass


class _NoNotifyEngine(LocalEngine):
    """A LocalEngine that signals arrival with ``CHUNK_READY`` (no notifications)."""

    @property
    def supports_notifications(self) -> bool:
        return False


class ChunkReadyKVManager(StagingManagerMixin, CommonKVManager):
    """A backend whose engine has no notifications: arrivals come as ``CHUNK_READY``.

    It leaves out the optional ``kv_buffer_tensors``: the staging set-up gives it the pool.
    """

    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"

    def __init__(self, kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> None:
        super().__init__(kv_args, role=role, attn_tp_size=attn_tp_size, engine=_NoNotifyEngine())

    def _on_message(self, frames: list[bytes]) -> None:
        if not self._dispatch_staging(frames):
            super()._on_message(frames)

    def _on_idle(self) -> None:
        staging_idle(self)


class ChunkReadyDropped(ChunkReadyKVManager):
    """Routes every staging message but ``CHUNK_READY`` to the mixin (drops that one)."""

    def _on_message(self, frames: list[bytes]) -> None:
        if frames and frames[0] == ChunkReady.WIRE_TYPE:
            return
        super()._on_message(frames)


class _CorruptingEngine(LocalEngine):
    """Writes every transfer, then flips the first byte it wrote."""

    def write(self, peer: str, transfers: Sequence[Transfer], notify: bytes | None = None) -> None:
        super().write(peer, transfers, notify=None)
        for transfer in transfers[:1]:
            import ctypes

            target = ctypes.c_uint8.from_address(transfer.remote)
            target.value ^= 0xFF
        if notify is not None:
            super().write(peer, [], notify=notify)


class Corrupting(LocalKVManager):
    """A LocalKVManager whose engine corrupts a byte of every write."""

    def __init__(self, kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> None:
        super().__init__(kv_args, role=role, attn_tp_size=attn_tp_size)
        self.engine.close()
        self.engine = _CorruptingEngine()


def _leak_free() -> tuple[set[int | None], int]:
    return {thread.ident for thread in threading.enumerate()}, open_socket_count()


def _assert_nothing_leaked(before: tuple[set[int | None], int]) -> None:
    threads, sockets = before
    assert open_socket_count() == sockets
    assert {thread.ident for thread in threading.enumerate()} <= threads


# --------------------------------------------------------------------------- working backends


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2), (4, 2), (1, 4)], ids=str
)
def test_every_room_lands_bit_for_bit(prefill_tp: int, decode_tp: int) -> None:
    """Every room succeeds, with one arrival per chunk, decode rank and writer of that rank."""
    before = _leak_free()
    report = run_transfer(LocalKVManager, prefill_tp=prefill_tp, decode_tp=decode_tp, rooms=3)
    assert report.ok, report.summary()
    assert report.diagnosis() is None
    writers_per_decode_rank = max(1, prefill_tp // decode_tp)
    assert [room.arrivals for room in report.rooms] == [3 * decode_tp * writers_per_decode_rank] * 3
    assert all(room.expected_arrivals == room.arrivals for room in report.rooms)
    assert all(room.chunks == room.chunks_verified == 3 for room in report.rooms)
    assert all(room.reason is None for room in report.rooms)
    assert report.stray_pages == 0
    assert report.notifications
    assert (report.prefill_tp, report.decode_tp) == (prefill_tp, decode_tp)
    assert report.backend == "staging_contracts.backends.local.LocalKVManager"
    assert sum(stats.arrivals for stats in report.decode_stats) == 9 * writers_per_decode_rank * (
        decode_tp
    )
    _assert_nothing_leaked(before)


def test_chunk_ready_backend_lands_every_room() -> None:
    """An engine without notifications: arrivals by CHUNK_READY, every room lands (and a
    host that leaves out kv_buffer_tensors is given its pool)."""
    report = run_transfer(ChunkReadyKVManager, prefill_tp=2, decode_tp=1, rooms=2)
    assert report.ok, report.summary()
    assert not report.notifications
    assert [room.arrivals for room in report.rooms] == [6, 6]


def test_a_factory_function_is_called_once_per_rank() -> None:
    """Any ManagerFactory will do; it is called with each rank's KV arguments and role."""
    calls: list[tuple[Role, int, int]] = []

    def factory(kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> TransferManager:
        calls.append((role, kv_args.engine_rank, attn_tp_size))
        return LocalKVManager(kv_args, role=role, attn_tp_size=attn_tp_size)

    geometry = TransferGeometry(room_pages=5, chunk_pages=2, pool_pages=32)
    report = run_transfer(factory, prefill_tp=1, decode_tp=2, rooms=2, geometry=geometry)
    assert report.ok, report.summary()
    assert sorted(calls, key=lambda c: (c[0].value, c[1])) == [
        (Role.DECODE, 0, 2),
        (Role.DECODE, 1, 2),
        (Role.PREFILL, 0, 1),
    ]
    assert all(room.chunks == room.chunks_verified == 3 for room in report.rooms)
    assert report.backend.endswith("factory")


# --------------------------------------------------------------------------- broken backends


def test_idle_hookless_backend_fails_pointing_at_the_idle_hook() -> None:
    """The issue's bad_g: writes land, no arrival is delivered; the diagnosis says why."""
    before = _leak_free()
    started = time.monotonic()
    report = run_transfer(IdleHookless, prefill_tp=2, decode_tp=1, rooms=3, timeout_s=SHORT_S)
    # Bounded: an unbounded wait would never return; the margin only absorbs a loaded machine.
    assert time.monotonic() - started < SHORT_S + 60.0
    assert not report.ok
    diagnosis = report.diagnosis()
    assert diagnosis is not None
    assert diagnosis.startswith("no arrivals were delivered at all (ring regions were allocated): ")
    assert IDLE_HOOK_HINT in diagnosis
    assert "is the listener's idle hook wired to staging_idle? (arrivals by engine " in diagnosis
    assert len(report.failed) == 3
    for room in report.rooms:
        assert room.arrivals == 0
        assert room.chunks_verified == 0
        assert room.decode_states == (KVPoll.Transferring,)
        assert room.reason is not None
        assert room.reason.startswith(f"timed out after {SHORT_S:g}s (decode 0 Transferring")
        assert room.line() in diagnosis
    _assert_nothing_leaked(before)


def test_dropped_chunk_ready_fails_pointing_at_the_message_routing() -> None:
    """CHUNK_READY never reaches the mixin: the diagnosis names _on_message and CHUNK_READY."""
    report = run_transfer(ChunkReadyDropped, prefill_tp=1, decode_tp=2, rooms=2, timeout_s=SHORT_S)
    diagnosis = report.diagnosis()
    assert diagnosis is not None
    assert diagnosis.splitlines()[0] == (
        "no CHUNK_READY arrived (ring regions were allocated): does the decode "
        "manager's _on_message hand CHUNK_READY to self._dispatch_staging?"
    )
    assert IDLE_HOOK_HINT not in diagnosis


def test_wrong_bytes_fail_the_room_though_every_rank_reports_success() -> None:
    """An engine that flips a byte: ranks report success, the pages do not verify."""
    report = run_transfer(Corrupting, prefill_tp=2, decode_tp=1, rooms=2, timeout_s=10.0)
    assert not report.ok
    for room in report.rooms:
        assert room.decode_states == (KVPoll.Success,)
        assert room.chunks_verified == 0
        assert room.reason == (
            "every rank reported success but 3 chunk(s) do not hold the staged bytes"
        )
    diagnosis = report.diagnosis()
    assert diagnosis is not None
    assert "reported success but their decode pages do not hold the staged bytes" in diagnosis


def test_report_without_rooms_done_is_not_ok() -> None:
    """A report is ok only when every room succeeded and nothing stray was written."""
    report = TransferReport(
        backend="x",
        prefill_tp=1,
        decode_tp=1,
        notifications=True,
        rooms=(),
        decode_stats=(),
        prefill_stats=(),
        stray_pages=1,
        elapsed_s=0.0,
        timeout_s=1.0,
    )
    assert not report.ok
    assert report.diagnosis() == (
        "decode's staging handler got no message at all: is the decode listener started, and "
        "does its _on_message hand staging messages to self._dispatch_staging?\n"
        "1 decode page(s) outside every room were written"
    )


# --------------------------------------------------------------------------- arguments


def test_factory_errors_propagate_after_closing_what_was_built() -> None:
    """A factory that fails on the third rank: the error propagates; the others are closed."""
    built: list[LocalKVManager] = []

    def factory(kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> TransferManager:
        if len(built) == 2:
            raise RuntimeError("no third manager")
        manager = LocalKVManager(kv_args, role=role, attn_tp_size=attn_tp_size)
        built.append(manager)
        return manager

    before = _leak_free()
    with pytest.raises(RuntimeError, match="no third manager"):
        run_transfer(factory, prefill_tp=2, decode_tp=1)
    assert all(manager._closed for manager in built)
    _assert_nothing_leaked(before)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill_tp": 3, "decode_tp": 2}, "3"),
        ({"rooms": 0}, "rooms=0 must be >= 1"),
        ({"timeout_s": 0.0}, "timeout_s=0.0 > 0"),
        ({"rooms": 6}, "6 rooms of 6 pages need 72 pool pages"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_built(
    kwargs: dict[str, int | float], message: str
) -> None:
    """Bad sizes raise ValueError, and no manager is built."""
    calls: list[int] = []

    def factory(kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> TransferManager:
        calls.append(1)
        return LocalKVManager(kv_args, role=role, attn_tp_size=attn_tp_size)

    with pytest.raises(ValueError, match=message):
        run_transfer(factory, **kwargs)  # type: ignore[arg-type]  # mixed int/float values
    assert calls == []


def test_geometry_refuses_non_positive_sizes() -> None:
    """Every size of TransferGeometry must be positive."""
    with pytest.raises(ValueError, match=r"TransferGeometry.chunk_pages=0 must be >= 1"):
        TransferGeometry(chunk_pages=0)


# ------------------------------------------------------- classes and callables are resolved


class Positional(LocalKVManager):
    """A constructor that takes kv_args only positionally and role too."""

    def __init__(self, kv_args: KVArgs, role: Role, /, *, attn_tp_size: int) -> None:
        super().__init__(kv_args, role=role, attn_tp_size=attn_tp_size)


class AbstractBase(StagingManagerMixin, CommonKVManager, abstract=True):
    """An intermediate base."""


def returns_an_object(kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> TransferManager:
    """A factory of the wrong thing."""
    return object()  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        (Positional, "Positional cannot be called as (kv_args, *, role=..., attn_tp_size=...)"),
        (AbstractBase, "AbstractBase is declared abstract=True"),
        (CommonKVManager, "is not a staging backend"),
    ],
)
@pytest.mark.parametrize("processes", [False, True])
def test_a_class_is_refused_like_its_spec_before_anything_is_built(
    backend: type, message: str, processes: bool
) -> None:
    """A class given as an object goes through the checks of MODULE:CLASS: one ValueError,
    before any manager is built or any rank spawned (processes=True included)."""
    before = _leak_free()
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        run_transfer(backend, prefill_tp=1, decode_tp=1, rooms=1, processes=processes)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)
    _assert_nothing_leaked(before)


def test_a_factory_returning_the_wrong_type_is_named() -> None:
    """A callable returning something else: a TypeError naming it, not an AttributeError."""
    with pytest.raises(TypeError, match=r"returns_an_object: the factory returned an object, "):
        run_transfer(returns_an_object, prefill_tp=1, decode_tp=1, rooms=1)


# ------------------------------------------------------- no progress possible: the run ends early


class Deaf(LocalKVManager):
    """Hands no listener message to the mixin: decode never hears of a staging request."""

    def _on_message(self, frames: list[bytes]) -> None:
        CommonKVManager._on_message(self, frames)


LONG_S = 120.0
"""A bound the runs below must not reach: the rooms' reasons say whether they did."""


@pytest.mark.parametrize(
    ("backend", "why", "cause"),
    [
        (
            IdleHookless,
            "every write was done 0.5s ago and no arrival reached decode",
            "no arrivals were delivered at all",
        ),
        (Deaf, "decode got no staging message", "decode's staging handler got no message at all"),
    ],
)
def test_a_run_that_cannot_progress_stops_before_its_timeout(
    backend: ManagerFactory, why: str, cause: str
) -> None:
    """With stall_s, a run in which no progress is possible ends with that reason (not
    'timed out after 120s'); the diagnosis is the same as at the timeout."""
    before = _leak_free()
    report = run_transfer(
        backend, prefill_tp=2, decode_tp=1, rooms=2, timeout_s=LONG_S, stall_s=0.5
    )
    assert report.stopped is not None, report.summary()
    assert why in report.stopped, report.summary()
    for room in report.rooms:
        assert room.reason is not None, room
        assert room.reason.startswith("stopped after "), room
        assert why in room.reason
    diagnosis = report.diagnosis()
    assert diagnosis is not None
    assert diagnosis.startswith(cause), diagnosis
    _assert_nothing_leaked(before)


def test_the_summary_lists_each_room_once() -> None:
    """summary(): each failed room once, then the likely cause (not the rooms again)."""
    report = run_transfer(IdleHookless, prefill_tp=1, decode_tp=1, rooms=2, timeout_s=SHORT_S)
    summary = report.summary()
    assert summary.count("room 1000:") == 1, summary
    assert summary.splitlines()[-1].startswith("diagnosis: no arrivals were delivered"), summary
