"""``run_transfer(..., processes=True)``: the staged transfer with every rank in its own process.

Over NIXL (the in-tree backend, by class and by spec string) the rooms land bit for bit for
P > D and P < D; an idle-hook-less NIXL backend fails with the same diagnosis as in one
process. A backend over the in-process ``LocalEngine`` is refused with a clear reason, and a
factory that fails, kills its process or cannot be pickled is named. The factories the rank
processes call live at module level here: spawned processes import them by reference.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from staging_contracts import KVArgs
from staging_contracts.backends._common import Role
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.engines import engine_available
from staging_contracts.engines.local import LocalEngine
from staging_contracts.testing import (
    IDLE_HOOK_HINT,
    ProcessesUnavailable,
    RankFailed,
    TransferManager,
    process_local_reason,
    run_transfer,
)

NIXL_OK, NIXL_WHY = engine_available("nixl")


def failing_factory(kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> TransferManager:
    """Every rank fails to build its manager."""
    raise RuntimeError(f"no engine today for {role.value} rank {kv_args.engine_rank}")


def pipelined_local(kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> TransferManager:
    """A process-local backend whose staging set-up would refuse it too (pipeline-parallel
    prefill): the engine is judged first, as soon as the manager is built."""
    return LocalKVManager(kv_args, role=role, attn_tp_size=attn_tp_size, pp_size=2)


def dying_factory(kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> TransferManager:
    """Every rank's process dies while building its manager, without a word."""
    os._exit(7)


if NIXL_OK:
    from staging_contracts.backends.nixl import NixlKVManager

    class NixlIdleHookless(NixlKVManager):
        """NIXL with the idle hook emptied: its arrival notifications are never delivered.

        Its writes never complete (decode drives no progress), so prefill's close waits for
        them as long as the write timeout: 3 s here, not the default 30 s.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs, write_timeout_s=3.0)

        def _on_idle(self) -> None:
            pass


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_nixl_rooms_land_with_a_process_per_rank(prefill_tp: int, decode_tp: int) -> None:
    """A spec string, P > D and P < D: every room succeeds, every chunk verified, every
    arrival counted."""
    report = run_transfer(
        "nixl", prefill_tp=prefill_tp, decode_tp=decode_tp, rooms=3, processes=True
    )
    assert report.ok, report.summary()
    assert report.processes
    assert (report.prefill_tp, report.decode_tp) == (prefill_tp, decode_tp)
    assert len(report.rooms) == 3
    for room in report.rooms:
        assert room.chunks_verified == room.chunks == 3
        assert room.arrivals == room.expected_arrivals == 6  # 3 chunks x 2 (rank, writer)
    assert len(report.decode_stats) == decode_tp
    assert all(stats.allocated > 0 for stats in report.decode_stats)
    assert "(a process per rank)" in report.summary()


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_a_class_runs_across_processes_too() -> None:
    """The class itself (pickled by reference) with its standard constructor."""
    report = run_transfer(NixlKVManager, prefill_tp=2, decode_tp=2, rooms=2, processes=True)
    assert report.ok, report.summary()
    assert report.backend == "staging_contracts.backends.nixl.NixlKVManager"


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_an_idle_hookless_backend_fails_with_the_diagnosis_across_processes() -> None:
    """No arrival is delivered: the report says so and points at the idle hook."""
    report = run_transfer(
        NixlIdleHookless, prefill_tp=2, decode_tp=1, rooms=2, timeout_s=3.0, processes=True
    )
    assert not report.ok
    assert report.notifications
    assert all(room.arrivals == 0 for room in report.rooms)
    diagnosis = report.diagnosis()
    assert diagnosis is not None
    assert diagnosis.splitlines()[0].endswith(IDLE_HOOK_HINT), diagnosis


@pytest.mark.parametrize("backend", ["local", LocalKVManager, pipelined_local])
def test_an_in_process_engine_is_refused_with_the_reason(backend: object) -> None:
    """LocalEngine cannot reach another process: ProcessesUnavailable says so."""
    with pytest.raises(ProcessesUnavailable, match=r"LocalEngine moves bytes within one process"):
        run_transfer(backend, prefill_tp=1, decode_tp=1, rooms=1, processes=True)  # type: ignore[arg-type]


def test_a_rank_whose_factory_raises_is_named_with_its_error() -> None:
    """The first rank to fail is named, with the factory's own error."""
    with pytest.raises(RankFailed, match=r"rank 0, waited for 'Joined': RuntimeError: no engine"):
        run_transfer(failing_factory, prefill_tp=1, decode_tp=1, rooms=1, processes=True)


def test_a_rank_process_that_dies_is_named_with_its_exit_code() -> None:
    """A rank process that exits without a word: RankFailed names it and its exit code."""
    with pytest.raises(RankFailed, match=r"rank 0, waited for 'Joined': exited .*7"):
        run_transfer(dying_factory, prefill_tp=1, decode_tp=1, rooms=1, processes=True)


def test_a_factory_that_cannot_be_pickled_is_refused_before_spawning() -> None:
    """A closure cannot reach a spawned process: a ValueError says what can."""

    def local_factory(kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> TransferManager:
        return LocalKVManager(kv_args, role=role, attn_tp_size=attn_tp_size)

    with pytest.raises(ValueError, match=r"a class, a module-level function or a spec string"):
        run_transfer(local_factory, processes=True)


def test_a_bad_spec_is_refused_before_spawning() -> None:
    """A spec string is resolved in the parent first: one line, no process."""
    with pytest.raises(ValueError, match=r"unknown backend 'nope'"):
        run_transfer("nope", processes=True)


def test_process_local_engines_are_recognised() -> None:
    """LocalEngine and an engine class that says process_local = True; others are not."""

    class Declared:
        process_local = True

    engine = LocalEngine()
    try:
        assert process_local_reason(engine) is not None
    finally:
        engine.close()
    assert process_local_reason(Declared()) is not None
    assert process_local_reason(object()) is None
