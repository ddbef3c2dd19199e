"""The contract kit: pytest conformance tests a staging backend runs against itself.

Subclass :class:`StagingBackendContract` in a test module and name the backend::

    from staging_contracts.backends import Role
    from staging_contracts.testing import DecodeSetup, StagingBackendContract

    from mypkg.backend import MyKVManager


    class TestMyKVManager(StagingBackendContract):
        backend_class = MyKVManager

        def make_decode_manager(self, setup: DecodeSetup) -> MyKVManager:
            manager = MyKVManager(setup.kv_args, role=Role.DECODE, attn_tp_size=setup.attn_tp_size)
            return setup.start(manager)

or run it without a test module: ``pytest --staging-backend mypkg.backend:MyKVManager``
(the plugin, :mod:`staging_contracts.testing.plugin`, is registered as a ``pytest11`` entry
point). See ``docs/writing-a-backend.md``.

The harness behind the kit's transfer checks is public too: :func:`run_transfer` stages
several multi-chunk rooms from P prefill to D decode managers of any backend, in one process
(or, with ``processes=True``, each rank in a spawned process of its own, over an engine that
crosses processes), verifies every decode page bit for bit and returns a
:class:`TransferReport`::

    report = run_transfer(MyKVManager, prefill_tp=2, decode_tp=1, rooms=3)
    if not report.ok:
        pytest.fail(report.summary())

Requires pytest. The names below are imported on first use (they need torch and pyzmq), so
that the ``pytest11`` plugin loaded by every pytest run of an environment costs nothing until
``--staging-backend`` is given.

May import: ``_run``, ``backends`` and everything below them; never ``_cluster``, ``_bench`` or
``cli``.
Imported by: backend authors' tests and the ``pytest11`` entry point.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._decode_setup import DecodeFactory, DecodeSetup, LiveDecodeManager, StartableBackend
    from ._factories import EngineUnavailable, FactoryUnavailable, standard_factory
    from ._harness import (
        IDLE_HOOK_HINT,
        ManagerFactory,
        ProcessesUnavailable,
        RankFailed,
        RoomReport,
        TransferGeometry,
        TransferManager,
        TransferReport,
        process_local_reason,
        run_transfer,
    )
    from ._kit import NO_FACTORY_MESSAGE, NO_MANAGER_FACTORY_MESSAGE, StagingBackendContract
    from ._live import FakePrefill, LiveDecode

__all__ = [
    "IDLE_HOOK_HINT",
    "NO_FACTORY_MESSAGE",
    "NO_MANAGER_FACTORY_MESSAGE",
    "DecodeFactory",
    "DecodeSetup",
    "EngineUnavailable",
    "FactoryUnavailable",
    "FakePrefill",
    "LiveDecode",
    "LiveDecodeManager",
    "ManagerFactory",
    "ProcessesUnavailable",
    "RankFailed",
    "RoomReport",
    "StagingBackendContract",
    "StartableBackend",
    "TransferGeometry",
    "TransferManager",
    "TransferReport",
    "process_local_reason",
    "run_transfer",
    "standard_factory",
]

_HOMES = {
    "DecodeFactory": "_decode_setup",
    "DecodeSetup": "_decode_setup",
    "LiveDecodeManager": "_decode_setup",
    "StartableBackend": "_decode_setup",
    "EngineUnavailable": "_factories",
    "FactoryUnavailable": "_factories",
    "standard_factory": "_factories",
    "IDLE_HOOK_HINT": "_harness",
    "ManagerFactory": "_harness",
    "ProcessesUnavailable": "_harness",
    "RankFailed": "_harness",
    "RoomReport": "_harness",
    "TransferGeometry": "_harness",
    "TransferManager": "_harness",
    "TransferReport": "_harness",
    "process_local_reason": "_harness",
    "run_transfer": "_harness",
    "NO_FACTORY_MESSAGE": "_kit",
    "NO_MANAGER_FACTORY_MESSAGE": "_kit",
    "StagingBackendContract": "_kit",
    "FakePrefill": "_live",
    "LiveDecode": "_live",
}
"""Where each public name lives: imported on first use (they import torch and pyzmq), so that
loading the ``pytest11`` plugin of this package costs a pytest run nothing it does not use."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
