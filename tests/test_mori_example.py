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
    sys.path (not the repository root), ends in the ContractError naming the staging members."""
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
    lines = result.stderr.strip().splitlines()
    header = (
        "staging_contracts.ContractError: MoriWithStaging does not satisfy the StagingHost"
        " contract of StagingManagerMixin:"
    )
    assert header in lines, result.stderr
    problems = lines[lines.index(header) + 1 : -1]
    assert problems[:2] == [
        "  - has no declaration of '_staging_handler' (expected StagingHandler | None)",
        "  - has no declaration of '_staging_ctx' (expected DecodeStagingContext"
        " | PrefillStagingContext | None)",
    ], result.stderr
    assert lines[-1].startswith("Fix: Declare each missing member"), result.stderr
