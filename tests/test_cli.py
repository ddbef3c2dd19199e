"""The command line: check exit codes and output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from staging_contracts.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_check_conforming_class_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    """A conforming backend is explained and the exit status is 0."""
    assert main(["check", "examples.hosts:ExampleKVManager"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "examples.hosts.ExampleKVManager against the StagingHost contract of StagingManagerMixin"
    )
    assert "verdict: conforms" in out


def test_check_mori_style_class_exits_one(capsys: pytest.CaptureFixture[str]) -> None:
    """A class without the staging members is explained with its problems; exit status 1."""
    assert main(["check", "examples.hosts:MoriStyleKVManager"]) == 1
    out = capsys.readouterr().out
    assert "does not use an enforcing mixin" in out
    assert "  - has no declaration of '_staging_ctx'" in out


def test_check_contract_error_at_import_exits_one(capsys: pytest.CaptureFixture[str]) -> None:
    """A module whose class statement fails the contract shows the error; exit status 1."""
    assert main(["check", "examples.mori_with_staging:MoriWithStaging"]) == 1
    out = capsys.readouterr().out
    assert "the contract rejected a class while importing 'examples.mori_with_staging'" in out
    assert "MoriWithStaging does not satisfy the StagingHost contract of StagingManagerMixin:" in (
        out
    )


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_such_module_xyz:Thing", "cannot import 'no_such_module_xyz'"),
        ("examples.hosts:NoSuchClass", "'examples.hosts' has no attribute 'NoSuchClass'"),
        ("examples.hosts:example_kv_args", "'example_kv_args' is not a class"),
        ("examples.hosts", "expected MODULE:CLASS"),
    ],
)
def test_check_unimportable_name_exits_two(
    target: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A name that cannot be imported as a class gives exit status 2."""
    assert main(["check", target]) == 2
    assert message in capsys.readouterr().err


def test_check_worst_status_wins(capsys: pytest.CaptureFixture[str]) -> None:
    """With several targets the exit status is the worst of them."""
    targets = ["examples.hosts:ExampleKVManager", "examples.hosts:MoriStyleKVManager"]
    assert main(["check", *targets]) == 1
    assert main(["check", *targets, "nope_module:X"]) == 2
    capsys.readouterr()


def test_console_script_runs_check() -> None:
    """The installed console script runs from the repository root."""
    script = Path(sys.executable).with_name("staging-contracts")
    result = subprocess.run(
        [str(script), "check", "examples.hosts:ExampleKVManager"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "verdict: conforms" in result.stdout
