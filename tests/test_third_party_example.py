"""The third-party backend example: installed on its own, its kit tests pass; broken, they fail.

``examples/third_party_backend`` is a package with its own ``pyproject.toml``. It is copied to
a temporary directory (so that nothing is built inside the repository), installed there with
pip (offline: no index, no build isolation, no dependencies), and its tests run in a child
pytest exactly as its author would run them. Then one annotation is deleted from the backend,
and ``staging-contracts check`` and the kit both fail with the contract's message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.test_testing_plugin import PLUGIN_ARGS

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "third_party_backend"
CHILD_TIMEOUT_S = 120.0
DELETED = "    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None\n"
CONTRACT_MESSAGE = (
    "AcmeKVManager does not satisfy the StagingHost contract of StagingManagerMixin:",
    "  - has no declaration of '_staging_ctx' "
    "(expected DecodeStagingContext | PrefillStagingContext | None)",
)


def _copy_example(destination: Path) -> Path:
    """Copy the example (without build or cache leftovers) to ``destination``."""
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(EXAMPLE, destination, ignore=ignore)
    return destination


def _run(args: Sequence[str], *, cwd: Path, python_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` in ``cwd`` with ``python_path`` first on the module path."""
    inherited = os.environ.get("PYTHONPATH")
    paths = [str(python_path), *([inherited] if inherited else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )


def _neutral_dir(parent: Path) -> Path:
    """An empty directory with an empty pytest config: a child pytest there collects nothing."""
    directory = parent / "run"
    directory.mkdir(exist_ok=True)
    (directory / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    return directory


def _lines_in_order(output: str, lines: Sequence[str]) -> bool:
    """``lines`` appear in ``output`` as consecutive lines."""
    return "\n".join(lines) in output


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The example copied to a temporary directory and pip-installed into a target there."""
    root = tmp_path_factory.mktemp("third_party")
    source = _copy_example(root / "acme")
    site = root / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*pip, "--no-index", "--target", str(site), str(source)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (site / "acme_kv" / "backend.py").is_file()
    return source, site


@pytest.fixture
def broken_example(tmp_path: Path) -> Path:
    """A copy of the example whose backend lost its '_staging_ctx' annotation."""
    source = _copy_example(tmp_path / "acme")
    backend = source / "src" / "acme_kv" / "backend.py"
    text = backend.read_text(encoding="utf-8")
    assert text.count(DELETED) == 1
    backend.write_text(text.replace(DELETED, ""), encoding="utf-8")
    return source


def test_installed_example_passes_its_kit_tests(installed_example: tuple[Path, Path]) -> None:
    """The installed example's own kit tests pass, run in its directory by a child pytest."""
    source, site = installed_example
    done = _run(["-m", "pytest", "-p", "no:cacheprovider", "-q"], cwd=source, python_path=site)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "11 passed" in output, output
    assert (
        str(site / "acme_kv")
        in _run(
            ["-c", "import acme_kv; print(acme_kv.__file__)"], cwd=source, python_path=site
        ).stdout
    )


def test_installed_example_passes_the_kit_from_the_command_line(
    installed_example: tuple[Path, Path],
) -> None:
    """--staging-backend runs the class checks on the installed backend with no test file."""
    source, site = installed_example
    args = ["-m", "pytest", *PLUGIN_ARGS, "-p", "no:cacheprovider", "-q", "-rs"]
    done = _run(
        [*args, "--staging-backend", "acme_kv.backend:AcmeKVManager"],
        cwd=_neutral_dir(source.parent),
        python_path=site,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "3 passed, 8 skipped" in output, output
    assert "needs a live decode manager: define make_decode_manager(self, setup)" in output


def test_check_command_fails_with_the_contract_message(broken_example: Path) -> None:
    """staging-contracts check exits 1 on the broken backend and prints the contract's message."""
    done = _run(
        ["-m", "staging_contracts.cli", "check", "acme_kv.backend:AcmeKVManager"],
        cwd=broken_example,
        python_path=broken_example / "src",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert _lines_in_order(done.stdout, CONTRACT_MESSAGE), done.stdout


def test_kit_tests_fail_with_the_contract_message(broken_example: Path) -> None:
    """The example's kit tests fail on the broken backend, showing the contract's message."""
    done = _run(
        ["-m", "pytest", "-p", "no:cacheprovider", "-q"],
        cwd=broken_example,
        python_path=broken_example / "src",
    )
    output = done.stdout + done.stderr
    assert done.returncode not in (0, 5), output
    assert "ContractError: " + CONTRACT_MESSAGE[0] in output, output
    assert CONTRACT_MESSAGE[1] in output, output


def test_command_line_kit_fails_with_the_contract_message(broken_example: Path) -> None:
    """--staging-backend on the broken backend fails its class check with the explanation."""
    args = ["-m", "pytest", *PLUGIN_ARGS, "-p", "no:cacheprovider", "-q"]
    done = _run(
        [*args, "--staging-backend", "acme_kv.backend:AcmeKVManager"],
        cwd=_neutral_dir(broken_example.parent),
        python_path=broken_example / "src",
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert _lines_in_order(output, CONTRACT_MESSAGE), output
    assert "_staging_ctx" in output
    assert "verdict: does not conform: 1 problem(s)" in output, output
    assert "FAILED staging-backend::TestAcmeKVManager::test_class_satisfies_the_contract" in output
