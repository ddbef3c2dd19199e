"""The third-party backend example: installed on its own, its kit tests pass; broken, they fail.

``examples/third_party_backend`` is a package with its own ``pyproject.toml``. It is copied to
a temporary directory (so that nothing is built inside the repository), installed there with
pip (offline: no index, no build isolation, no dependencies), and its tests run in a child
pytest exactly as its author would run them: the kit and a staged transfer through the
harness (in one process, and with a process per rank over NIXL). Installed, it registers itself
under the ``staging_contracts.backends`` entry points, so ``--staging-backend acme`` finds it
by name, and ``staging-contracts demo`` runs it across processes, by spec
(``MODULE:CLASS=MODULE:FACTORY``) and by its registered cross-process name ``acme-nixl`` (and
``soak`` by that name). Then
one annotation is deleted from the backend, and ``staging-contracts check`` and the kit both
fail with the contract's message; and with its idle hook emptied, the kit's transfer checks
fail naming the idle hook.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from staging_contracts.engines import engine_available
from staging_contracts.testing import IDLE_HOOK_HINT
from tests.test_testing_plugin import KIT_TESTS, PLUGIN_ARGS, TRANSFER_TESTS

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "third_party_backend"
CHILD_TIMEOUT_S = 120.0
DELETED = "    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None\n"
IDLE_HOOK = "    def _on_idle(self) -> None:\n        staging_idle(self)\n"
EMPTIED_IDLE_HOOK = "    def _on_idle(self) -> None:\n        pass\n"
NIXL_OK, NIXL_WHY = engine_available("nixl")
EXAMPLE_TRANSFER_TESTS = 3
"""The in-process harness tests of the example (tests/test_acme_transfer.py)."""
EXAMPLE_PROCESS_TESTS = 1
"""Its harness test with a process per rank (over NIXL: skipped without it)."""
DEMO_TIMEOUT_S = 240.0
DEMO_ARGS = (
    "--prefill-tp",
    "2",
    "--decode-tp",
    "1",
    "--kv-heads",
    "2",
    "--layers",
    "1",
    "--head-dim",
    "16",
    "--tokens",
    "64",
    "--page-size",
    "16",
    "--requests",
    "2",
    "--chunk-tokens",
    "32",
)
"""A small demo: two prefill ranks, one decode rank, two requests of two chunks."""
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


def _run(
    args: Sequence[str], *, cwd: Path, python_path: Path, timeout_s: float = CHILD_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
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
        timeout=timeout_s,
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
    """The installed example's own kit and harness tests pass, run by a child pytest."""
    source, site = installed_example
    done = _run(["-m", "pytest", "-p", "no:cacheprovider", "-q"], cwd=source, python_path=site)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    passed = KIT_TESTS + EXAMPLE_TRANSFER_TESTS + (EXAMPLE_PROCESS_TESTS if NIXL_OK else 0)
    assert f"{passed} passed" in output, output
    if not NIXL_OK:
        assert f"{EXAMPLE_PROCESS_TESTS} skipped" in output, output
    assert (
        str(site / "acme_kv")
        in _run(
            ["-c", "import acme_kv; print(acme_kv.__file__)"], cwd=source, python_path=site
        ).stdout
    )


@pytest.mark.parametrize("spec", ["acme_kv.backend:AcmeKVManager", "acme"])
def test_installed_example_passes_the_kit_from_the_command_line(
    installed_example: tuple[Path, Path], spec: str
) -> None:
    """--staging-backend, by class or by its entry-point name, runs every check with no test
    file: the kit builds the backend with its standard constructor."""
    source, site = installed_example
    args = ["-m", "pytest", *PLUGIN_ARGS, "-p", "no:cacheprovider", "-q", "-rs"]
    done = _run(
        [*args, "--staging-backend", spec], cwd=_neutral_dir(source.parent), python_path=site
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"{KIT_TESTS} passed" in output, output
    assert "skipped" not in output, output


def test_installed_example_is_registered_by_name(installed_example: tuple[Path, Path]) -> None:
    """The example's entry point makes load_backend('acme') find it, listed by name."""
    source, site = installed_example
    code = (
        "from staging_contracts.backends import backend_names, load_backend; "
        "print(backend_names()); print(load_backend('acme'))"
    )
    done = _run(["-c", code], cwd=_neutral_dir(source.parent), python_path=site)
    assert done.returncode == 0, done.stdout + done.stderr
    names, loaded = done.stdout.splitlines()
    assert names.endswith(", 'acme', 'acme-nixl')"), names
    assert loaded == "<class 'acme_kv.backend.AcmeKVManager'>"


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
@pytest.mark.parametrize(
    "spec",
    [
        "acme_kv.backend:AcmeKVManager=acme_kv.backend:over_nixl",
        "acme_kv.backend:AcmeNixlKVManager",
        "acme-nixl",
    ],
)
def test_installed_example_runs_through_the_demo_across_processes(
    installed_example: tuple[Path, Path], spec: str
) -> None:
    """staging-contracts demo --backend SPEC: every rank in its own process builds Acme's
    manager (by its factory, by its class's standard constructor, or by the registered
    name), and every page verifies."""
    source, site = installed_example
    done = _run(
        ["-m", "staging_contracts.cli", "demo", "--backend", spec, *DEMO_ARGS],
        cwd=_neutral_dir(source.parent),
        python_path=site,
        timeout_s=DEMO_TIMEOUT_S,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"over {spec}: 2 prefill ranks -> 1 decode ranks" in done.stdout, output
    assert "] 2/2 rooms done" in done.stdout, output
    assert "PASS: every page of 2 requests on 1 decode ranks" in done.stdout, output


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_installed_example_runs_through_the_soak_by_name(
    installed_example: tuple[Path, Path],
) -> None:
    """staging-contracts soak --backend acme-nixl: the soak's rank processes resolve the
    registered name themselves; rooms succeed, none is corrupt or hung."""
    source, site = installed_example
    args = ["soak", "--backend", "acme-nixl", "--duration", "2", "--faults", "none"]
    done = _run(
        ["-m", "staging_contracts.cli", *args],
        cwd=_neutral_dir(source.parent),
        python_path=site,
        timeout_s=DEMO_TIMEOUT_S,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "engine             acme-nixl, 2 prefill -> 1 decode" in done.stdout, output
    assert " 0 corrupt, 0 hung" in done.stdout, output
    assert done.stdout.rstrip().endswith("PASS"), output


def test_example_without_its_idle_hook_fails_the_transfer_checks(tmp_path: Path) -> None:
    """The issue's bad_g, written as its author would: the kit's transfer checks fail and
    point at the idle hook; every other check passes."""
    source = _copy_example(tmp_path / "acme")
    backend = source / "src" / "acme_kv" / "backend.py"
    text = backend.read_text(encoding="utf-8")
    assert text.count(IDLE_HOOK) == 1
    backend.write_text(text.replace(IDLE_HOOK, EMPTIED_IDLE_HOOK), encoding="utf-8")
    (source / "tests" / "test_acme_transfer.py").unlink()
    (source / "tests" / "conftest.py").write_text(
        "from staging_contracts.testing import StagingBackendContract\n\n"
        "StagingBackendContract.transfer_timeout_s = 2.0\n",
        encoding="utf-8",
    )
    # -rN: no short summary, which repeats each message in full where CI is set.
    done = _run(
        ["-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN"],
        cwd=source,
        python_path=source / "src",
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert f"{TRANSFER_TESTS} failed, {KIT_TESTS - TRANSFER_TESTS} passed" in output, output
    failure = (
        "through AcmeKVManager failed: no arrivals were delivered at all (ring regions were "
        f"allocated): {IDLE_HOOK_HINT}"
    )
    assert output.count(failure) == TRANSFER_TESTS, output


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
    """The example's kit tests fail on the broken backend: one collection error per test
    module, with the contract's message and the explanation, without the library's frames."""
    done = _run(
        ["-m", "pytest", "-p", "no:cacheprovider", "-q"],
        cwd=broken_example,
        python_path=broken_example / "src",
    )
    output = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.INTERRUPTED, output
    assert "importing tests/test_acme_contract.py failed: the contract rejected a class " in output
    assert _lines_in_order(output, CONTRACT_MESSAGE), output
    assert "verdict: does not conform: 1 problem(s)" in output, output
    assert "enforcement.py" not in output, output


def test_command_line_kit_fails_with_the_contract_message(broken_example: Path) -> None:
    """--staging-backend on the broken backend: one collection error, with the explanation."""
    args = ["-m", "pytest", *PLUGIN_ARGS, "-p", "no:cacheprovider", "-q"]
    done = _run(
        [*args, "--staging-backend", "acme_kv.backend:AcmeKVManager"],
        cwd=_neutral_dir(broken_example.parent),
        python_path=broken_example / "src",
    )
    output = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.INTERRUPTED, output
    assert _lines_in_order(output, CONTRACT_MESSAGE), output
    assert output.count(CONTRACT_MESSAGE[1]) == 1, output
    assert "verdict: does not conform: 1 problem(s)" in output, output
    assert "ERROR staging-backend::TestAcmeKVManager\n" in output, output
    assert "1 error in" in output, output
    assert " passed" not in output, output
