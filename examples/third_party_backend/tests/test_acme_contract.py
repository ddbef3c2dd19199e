"""The staging contract kit on AcmeKVManager: class, instance and live behaviour checks."""

from __future__ import annotations

from acme_kv.backend import AcmeKVManager

from staging_contracts.backends import Role
from staging_contracts.testing import DecodeSetup, StagingBackendContract


class TestAcmeKVManager(StagingBackendContract):
    """AcmeKVManager against the StagingHost contract and the kit's behaviour checks."""

    backend_class = AcmeKVManager

    def make_decode_manager(self, setup: DecodeSetup) -> AcmeKVManager:
        """A started decode AcmeKVManager with the kit's KV pool and staging ring."""
        manager = AcmeKVManager(setup.kv_args, role=Role.DECODE, attn_tp_size=setup.attn_tp_size)
        return setup.start(manager)
