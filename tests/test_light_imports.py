"""Adopting the library costs nothing heavy: no torch, no pyzmq, until the staging path runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "zmq", "numpy")


def _loaded_after(code: str) -> dict[str, bool]:
    """Which heavy modules a fresh interpreter has loaded after running ``code``."""
    probe = (
        "import json, sys\n"
        f"{code}\n"
        f"print(json.dumps({{name: name in sys.modules for name in {HEAVY!r}}}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    loaded: dict[str, bool] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


@pytest.mark.parametrize(
    "code",
    [
        "import staging_contracts",
        "from staging_contracts import Contract, ContractMixin, StagingManagerMixin",
        "import staging_contracts.testing.plugin",
        "import staging_contracts.testing",
        (
            "from staging_contracts.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass"
        ),
        (
            "from staging_contracts.cli import main\n"
            "try:\n    main(['check', '--help'])\nexcept SystemExit:\n    pass"
        ),
        (
            "from staging_contracts.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass"
        ),
    ],
    ids=[
        "package",
        "contract-names",
        "pytest-plugin",
        "testing-package",
        "help",
        "check-help",
        "version",
    ],
)
def test_adoption_imports_nothing_heavy(code: str) -> None:
    """The package, its contract names, the pytest plugin and the CLI's help load no torch,
    pyzmq or numpy."""
    assert _loaded_after(code) == dict.fromkeys(HEAVY, False)


def test_the_testing_names_still_import_on_use() -> None:
    """The kit's public names are there, imported when first used."""
    loaded = _loaded_after("from staging_contracts.testing import StagingBackendContract")
    assert loaded["torch"]


def test_a_pytest_run_with_the_plugin_installed_loads_nothing_heavy(
    pytester: pytest.Pytester,
) -> None:
    """The auto-loaded plugin (the installed package's pytest11 entry point) keeps a pytest
    run that names no backend free of torch and pyzmq."""
    pytester.makepyfile(
        test_probe="""
        import sys

        def test_nothing_heavy_loaded():
            assert [m for m in ("torch", "zmq") if m in sys.modules] == []
        """
    )
    result = pytester.runpytest_subprocess("-q")
    assert "staging-backend" in pytester.runpytest_subprocess("--help").stdout.str()
    result.assert_outcomes(passed=1)
