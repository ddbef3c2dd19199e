"""The contract kit on every in-tree staging backend, exactly as a backend author runs it.

Local, Mooncake (TCP) and Ascend (through Mooncake, TCP) run the whole kit in this process,
staged transfers included. NIXL runs its class checks here and its live checks in a child
pytest, started with ``--staging-backend nixl`` (the registry name: the kit builds NIXL
managers itself): a process that held a NIXL agent can crash at exit, so no agent is ever
created in this one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from staging_contracts.backends._common import Role
from staging_contracts.backends.ascend import AscendKVManager
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.backends.mooncake import MooncakeKVManager
from staging_contracts.backends.nixl import NixlKVManager
from staging_contracts.engines import engine_available
from staging_contracts.protocols import KVArgs
from staging_contracts.testing import (
    DecodeSetup,
    LiveDecodeManager,
    StagingBackendContract,
    TransferManager,
)
from tests.test_testing_plugin import KIT_TESTS, PLUGIN_ARGS

REPO = Path(__file__).resolve().parents[1]
NIXL_KIT_TIMEOUT_S = 120.0
CHILD_ARGS = ("-p", "no:cacheprovider", "-q", "-rs")


class TestLocalKVManager(StagingBackendContract):
    """The kit on the in-process backend over LocalEngine."""

    backend_class = LocalKVManager

    def make_decode_manager(self, setup: DecodeSetup) -> LocalKVManager:
        """A started decode LocalKVManager with the kit's pool and ring."""
        manager = LocalKVManager(setup.kv_args, role=Role.DECODE, attn_tp_size=setup.attn_tp_size)
        return setup.start(manager)


@pytest.mark.mooncake
class TestMooncakeKVManager(StagingBackendContract):
    """The kit on the Mooncake backend (TCP on loopback)."""

    backend_class = MooncakeKVManager

    def make_decode_manager(self, setup: DecodeSetup) -> MooncakeKVManager:
        """A started decode MooncakeKVManager over TCP."""
        _require_engine("mooncake")
        manager = MooncakeKVManager(
            setup.kv_args, role=Role.DECODE, attn_tp_size=setup.attn_tp_size, protocol="tcp"
        )
        return setup.start(manager)


@pytest.mark.mooncake
class TestAscendKVManager(StagingBackendContract):
    """The kit on the Ascend backend, through Mooncake over TCP (no NPU here)."""

    backend_class = AscendKVManager

    def make_decode_manager(self, setup: DecodeSetup) -> AscendKVManager:
        """A started decode AscendKVManager with Mooncake's TCP transport."""
        _require_engine("mooncake")
        manager = AscendKVManager(
            setup.kv_args, role=Role.DECODE, attn_tp_size=setup.attn_tp_size, protocol="tcp"
        )
        return setup.start(manager)


@pytest.mark.nixl
class TestNixlKVManager(StagingBackendContract):
    """The kit's class checks on the NIXL backend (its live checks run in a child process)."""

    backend_class = NixlKVManager

    def make_decode_manager(self, setup: DecodeSetup) -> LiveDecodeManager:
        """Never in this process: see test_nixl_live_checks_pass."""
        pytest.skip("NIXL agents run in a child pytest (test_nixl_live_checks_pass)")

    def make_manager(self, kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> TransferManager:
        """Never in this process: see test_nixl_live_checks_pass."""
        pytest.skip("NIXL agents run in a child pytest (test_nixl_live_checks_pass)")


def _require_engine(name: str) -> None:
    available, why = engine_available(name)
    if not available:
        pytest.skip(why)


@pytest.mark.nixl
def test_nixl_live_checks_pass(tmp_path: Path) -> None:
    """The whole kit passes on NixlKVManager, named by its registry name in a child pytest.

    No factory is given: the kit builds NIXL managers with the in-tree factory, and the
    transfer checks deliver arrivals by NIXL's notifications.
    """
    _require_engine("nixl")
    (tmp_path / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    target = "nixl"
    inherited = os.environ.get("PYTHONPATH")
    paths = [str(REPO), str(REPO / "src"), *([inherited] if inherited else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *PLUGIN_ARGS, *CHILD_ARGS, "--staging-backend", target],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=NIXL_KIT_TIMEOUT_S,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"{KIT_TESTS} passed" in output, output
