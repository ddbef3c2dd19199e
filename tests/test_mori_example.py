"""examples/mori_with_staging.py, run as a script from anywhere, shows the contract's error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import staging_contracts

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "mori_with_staging.py"


def test_run_as_a_script_from_elsewhere_it_fails_with_the_contract_error(tmp_path: Path) -> None:
    """python examples/mori_with_staging.py, from another folder and with only the package on
    sys.path (not the repository root), ends in the ContractError naming both members."""
    package_root = Path(staging_contracts.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    tail = result.stderr.strip().splitlines()[-4:]
    assert tail[0] == (
        "staging_contracts.ContractError: MoriWithStaging does not satisfy the StagingHost"
        " contract of StagingManagerMixin:"
    ), result.stderr
    assert (
        tail[1] == "  - has no declaration of '_staging_handler' (expected StagingHandler | None)"
    )
    assert tail[2].startswith("  - has no declaration of '_staging_ctx' (expected ")
    assert tail[3].startswith("Fix: Declare each missing member")
