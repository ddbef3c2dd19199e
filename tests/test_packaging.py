"""The distributions as a user gets them: the sdist and the wheel, built, checked, installed.

Both are built once (``python -m build --no-isolation``: the sdist from a copy of the tree
without its build leftovers, the wheel from the sdist) into a temporary folder. The copy
matters: setuptools adds the files an old ``*.egg-info/SOURCES.txt`` lists to the sdist, so a
tree built before would hide a file that MANIFEST.in no longer takes. Each is installed into
a fresh virtual environment that has no ``staging_contracts`` of its own: the heavy
dependencies (torch, the engines, pytest, ...) come from this interpreter's site-packages
through a ``.pth`` file, whose own ``.pth`` files (the editable install's among them) are not
processed, so the package itself comes only from the distribution installed there. Each test
checks that it does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import venv
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Final

import pytest
from packaging.requirements import Requirement

import staging_contracts
from staging_contracts.engines import engine_available

REPO: Final = Path(__file__).resolve().parent.parent
NIXL_OK, NIXL_WHY = engine_available("nixl")
TIMEOUT_S: Final = 240.0

SDIST_FAST_TESTS: Final = (
    "tests/test_reference_vectors.py",  # tests/data
    "tests/test_docs_imports.py",  # README.md and docs/
    "tests/test_self_contained.py",  # Makefile, .ci/run, mypy.ini, scripts/
    "tests/test_docs_site.py",  # mkdocs.yml, docs/reference/, scripts/docs_hooks.py
)
"""Quick tests run from the unpacked sdist, each needing files the sdist must carry."""

LEFTOVERS: Final = (
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
    ".mutation",
    "mutants",
)
"""What building, testing and tools leave in a tree: not copied to the tree that is built."""


@dataclass(frozen=True)
class Dists:
    """The built distributions."""

    sdist: Path
    wheel: Path


def _env() -> dict[str, str]:
    """This process's environment without what would put the source tree on ``sys.path``."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    env.pop("VIRTUAL_ENV", None)
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(
    args: Sequence[str | Path], cwd: Path, timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    """The output of a command that must have succeeded."""
    assert result.returncode == 0, f"{result.args}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    """The sdist and the wheel built from it, as ``python -m build`` makes them."""
    tree = tmp_path_factory.mktemp("tree") / REPO.name
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(*LEFTOVERS), symlinks=True)
    out = tmp_path_factory.mktemp("dist")
    _ok(_run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, tree], out))
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Dists(sdist, wheel)


def fresh_venv(where: Path) -> Path:
    """A virtual environment without the package; its python.

    Its site-packages gets one ``.pth`` file naming this interpreter's site-packages, so
    that the dependencies need no installing.
    """
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    python = where / "bin" / "python"
    query = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_ok(_run([python, "-c", query], where)).strip())
    shared = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "_shared_dependencies.pth").write_text("".join(f"{path}\n" for path in shared))
    return python


def pip_install(python: Path, target: Path) -> None:
    """Install ``target`` (a wheel or a source folder) into ``python``'s environment, offline."""
    args: list[str | Path] = ["install", "--no-deps", "--no-index", "--no-build-isolation", target]
    _ok(_run([sys.executable, "-m", "pip", "--python", python, *args], target.parent))


def installed_from(python: Path, cwd: Path) -> Path:
    """Where ``python`` started in ``cwd`` imports ``staging_contracts`` from."""
    query = "import staging_contracts; print(staging_contracts.__file__)"
    return Path(_ok(_run([python, "-c", query], cwd)).strip())


@pytest.fixture(scope="module")
def wheel_venv(dists: Dists, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh environment with only the wheel installed; its python."""
    python = fresh_venv(tmp_path_factory.mktemp("wheel-venv"))
    pip_install(python, dists.wheel)
    return python


def test_twine_accepts_both_distributions(dists: Dists) -> None:
    """twine check --strict passes the sdist and the wheel (metadata, README rendering)."""
    out = _ok(
        _run([sys.executable, "-m", "twine", "check", "--strict", dists.sdist, dists.wheel], REPO)
    )
    assert out.count("PASSED") == 2, out


def test_the_wheel_holds_the_package_its_types_and_its_license(dists: Dists) -> None:
    """The wheel: the package with py.typed, the LICENSE, the SPDX license and classifiers."""
    with zipfile.ZipFile(dists.wheel) as wheel:
        names = wheel.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        headers = wheel.read(metadata).decode().partition("\n\n")[0].splitlines()
        license_text = wheel.read(metadata.replace("METADATA", "licenses/LICENSE")).decode()
    assert {n.split("/")[0] for n in names} == {"staging_contracts", metadata.split("/")[0]}
    assert "staging_contracts/py.typed" in names
    assert license_text == (REPO / "LICENSE").read_text()
    assert "License-Expression: Apache-2.0" in headers
    assert "License-File: LICENSE" in headers
    classifiers = [h.removeprefix("Classifier: ") for h in headers if h.startswith("Classifier:")]
    assert "Typing :: Typed" in classifiers
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # PEP 639: the expression


def _git_files() -> set[str] | None:
    """The files git tracks here, or ``None`` outside a git checkout (an unpacked sdist)."""
    result = _run(["git", "ls-files", "-z"], REPO)
    if result.returncode != 0:
        return None
    return {name for name in result.stdout.split("\0") if name}


def test_the_sdist_holds_every_file_the_repository_tracks(dists: Dists) -> None:
    """The sdist is the tree: every tracked file is in it (tests, data, docs, stubs, ...)."""
    tracked = _git_files()
    if tracked is None:
        pytest.skip("not a git checkout: no list of tracked files to compare with")
    with tarfile.open(dists.sdist) as sdist:
        names = {name.partition("/")[2] for name in sdist.getnames()}
    assert tracked - names == set()
    assert "PKG-INFO" in names


def test_the_build_setuptools_meets_build_system_requires() -> None:
    """The setuptools these tests build with satisfies build-system.requires, which the dev
    extra repeats (PEP 639 needs setuptools 77: an older one rejects the license string)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    requires = [Requirement(r) for r in project["build-system"]["requires"]]
    dev = [Requirement(r) for r in project["project"]["optional-dependencies"]["dev"]]
    for requirement in requires:
        assert requirement.specifier.contains(version(requirement.name)), requirement
        assert requirement in dev, f"{requirement} is missing from the dev extra"


def test_the_version_is_the_same_in_pyproject_and_the_package() -> None:
    """pyproject.toml's version is the package's __version__."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["version"] == staging_contracts.__version__


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_the_installed_wheel_runs_the_demo(wheel_venv: Path, tmp_path: Path) -> None:
    """The wheel's console script, in an environment of its own, runs a small verified demo."""
    assert installed_from(wheel_venv, tmp_path).is_relative_to(wheel_venv.parent.parent)
    script = wheel_venv.with_name("staging-contracts")
    small = "--prefill-tp 2 --decode-tp 1 --kv-heads 2 --layers 2 --head-dim 16 --tokens 64"
    out = _ok(
        _run([script, "demo", *small.split(), "--requests", "1", "--chunk-tokens", "32"], tmp_path)
    )
    assert "verification             PASS: every page of 1 requests on 1 decode ranks" in out


USER_BACKEND: Final = """\
from staging_contracts import (
    ArrivalMode,
    DecodeStagingContext,
    KVArgs,
    PrefillStagingContext,
    StagingHandler,
    StagingManagerMixin,
)
from staging_contracts.backends._common import CommonKVManager, Role
from staging_contracts.backends._staging_setup import staging_idle
from staging_contracts.engines.mooncake import MooncakeEngine
from staging_contracts.engines.nixl import NixlEngine


class UserKVManager(StagingManagerMixin, CommonKVManager):
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None

    def __init__(self, kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> None:
        engine = NixlEngine(None, host="127.0.0.1", load_ib_modules=False)
        super().__init__(kv_args, role=role, attn_tp_size=attn_tp_size, engine=engine)

    @property
    def arrival(self) -> ArrivalMode:
        return "notification"

    def _on_idle(self) -> None:
        staging_idle(self)


def mooncake_session(engine: MooncakeEngine) -> str:
    return engine.session_id


class Incomplete(StagingManagerMixin, CommonKVManager):
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
"""
"""A user's backend module: typed, importing both engines; ``Incomplete`` lacks a member."""


def test_a_users_mypy_needs_no_engine_stubs(wheel_venv: Path, tmp_path: Path) -> None:
    """mypy --strict with the plugin, over a backend importing both engines, against the
    installed wheel and without this repository's stubs/, reports only the plugin's error."""
    (tmp_path / "user_backend.py").write_text(USER_BACKEND)
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\nstrict = True\nplugins = staging_contracts.mypy_plugin\n")
    args: list[str | Path] = [
        "--config-file",
        config,
        "--python-executable",
        wheel_venv,
        "user_backend.py",
    ]
    result = _run(
        [sys.executable, "-m", "mypy", "--cache-dir", tmp_path / "cache", *args], tmp_path
    )
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 1, result.stdout + result.stderr
    assert len(lines) == 2, result.stdout  # the one error and the summary line
    assert lines[0].startswith("user_backend.py:35: error: Incomplete does not satisfy")
    assert lines[0].endswith("[staging-missing-member]")


def test_the_sdist_installs_and_its_tests_run(dists: Dists, tmp_path: Path) -> None:
    """Unpacked and pip-installed, the sdist's whole suite collects without an error and
    its quick tests pass, with the package from the install, not from src/."""
    with tarfile.open(dists.sdist) as sdist:
        sdist.extractall(tmp_path / "unpacked", filter="data")
    (tree,) = (tmp_path / "unpacked").iterdir()
    python = fresh_venv(tmp_path / "venv")
    pip_install(python, tree)
    assert installed_from(python, tree).is_relative_to(tmp_path / "venv")
    pytest_args: list[str | Path] = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    collected = _ok(_run([*pytest_args, "--collect-only"], tree))
    assert "error" not in collected.lower().splitlines()[-1], collected[-2000:]
    passed = _ok(_run([*pytest_args, *SDIST_FAST_TESTS], tree))
    summary = passed.splitlines()[-1]
    assert " passed" in summary, passed
    assert "skipped" not in summary, passed
