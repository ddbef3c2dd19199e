"""The contract kit: pytest conformance tests a staging backend runs against itself.

Subclass :class:`StagingBackendContract` in a test module and name the backend::

    from staging_contracts.backends.common import Role
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

Requires pytest.

May import: ``backends`` and everything below it; never ``cluster``, ``bench`` or ``cli``.
Imported by: backend authors' tests and the ``pytest11`` entry point.
"""

from __future__ import annotations

from .decode_setup import DecodeFactory, DecodeSetup, LiveDecodeManager, StartableBackend
from .kit import NO_FACTORY_MESSAGE, StagingBackendContract
from .live import FakePrefill, LiveDecode

__all__ = [
    "NO_FACTORY_MESSAGE",
    "DecodeFactory",
    "DecodeSetup",
    "FakePrefill",
    "LiveDecode",
    "LiveDecodeManager",
    "StagingBackendContract",
    "StartableBackend",
]
