"""The adoption patch of ``integrations/sglang`` applied to the installed reference.

:func:`apply` applies a unified diff to text, strictly: every context and removed line must be
there, as ``git apply`` would insist (no fuzz, no external tool). :func:`overlay` makes a
folder whose ``sglang`` package is the installed reference with a few files replaced: every
folder on the way to a replaced file is real, everything else is a symbolic link into the
install, so the install itself is never written to. :func:`patched` is the overlay with the
patch applied; with ``mori_with_mixin=True`` it also gives Mori the patched mixin, the mistake
the contract must refuse. :func:`copy_tree` writes real copies of the disaggregation files for
mypy. Processes that import the overlay run its ``sglang`` first on ``sys.path``
(:func:`run_probe`, :func:`run_check`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = [
    "MORI",
    "PATCH",
    "STAGING_HANDLER",
    "TYPED_FILES",
    "FilePatch",
    "apply",
    "changed_lines",
    "copy_tree",
    "mori_with_mixin",
    "overlay",
    "parse",
    "patched",
    "patched_files",
    "run_check",
    "run_probe",
]

ROOT: Final = Path(__file__).resolve().parents[2]
PATCH: Final = ROOT / "integrations" / "sglang" / "sglang-0.5.23.patch"
"""The adoption patch, as an SGLang maintainer applies it (paths ``a/python/sglang/...``)."""

STAGING_HANDLER: Final = "sglang/srt/disaggregation/common/staging_handler.py"
MORI: Final = "sglang/srt/disaggregation/mori/conn.py"

TYPED_FILES: Final = tuple(
    f"sglang/srt/disaggregation/{folder}/{name}"
    for folder, names in (
        (
            "common",
            (
                "__init__.py",
                "bootstrap.py",
                "conn.py",
                "dcp_pack.py",
                "staging_buffer.py",
                "staging_handler.py",
                "utils.py",
            ),
        ),
        ("mooncake", ("__init__.py", "conn.py", "utils.py")),
        ("nixl", ("__init__.py", "conn.py")),
        ("ascend", ("__init__.py", "conn.py", "transfer_engine.py")),
        ("mori", ("__init__.py", "conn.py")),
    )
    for name in names
)
"""The 17 files of ``disaggregation/{common,mooncake,nixl,ascend,mori}``."""

PROBE_TIMEOUT_S: Final = 600


@dataclass(frozen=True)
class Hunk:
    """One ``@@ -start,count +start,count @@`` block: its old and new lines."""

    old_start: int
    old: tuple[str, ...]
    new: tuple[str, ...]


@dataclass(frozen=True)
class FilePatch:
    """The hunks of one file, its path relative to the package root (``sglang/...``)."""

    path: str
    hunks: tuple[Hunk, ...]


_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")


def parse(text: str) -> list[FilePatch]:
    """The files of a unified diff (prose before the first ``---`` is ignored); paths lose
    their ``a/``/``b/`` prefix and a leading ``python/`` (the repository's layout)."""
    files: list[FilePatch] = []
    path: str | None = None
    hunks: list[Hunk] = []
    old: list[str] = []
    new: list[str] = []
    start = 0
    in_hunk = False

    def close_hunk() -> None:
        if in_hunk:
            hunks.append(Hunk(start, tuple(old), tuple(new)))

    for line in text.splitlines():
        if line.startswith("--- "):
            close_hunk()
            in_hunk = False
            if path is not None:
                files.append(FilePatch(path, tuple(hunks)))
            hunks = []
            path = None
        elif line.startswith("+++ "):
            path = line[4:].split("\t")[0].removeprefix("b/").removeprefix("python/")
        elif (match := _HUNK.match(line)) is not None:
            close_hunk()
            in_hunk, start, old, new = True, int(match[1]), [], []
        elif in_hunk and line[:1] in (" ", "-", "+"):
            body = line[1:]
            if line[0] in (" ", "-"):
                old.append(body)
            if line[0] in (" ", "+"):
                new.append(body)
        elif in_hunk and line == "":
            old.append("")
            new.append("")
    close_hunk()
    if path is not None:
        files.append(FilePatch(path, tuple(hunks)))
    return files


def changed_lines(text: str) -> int:
    """Lines the diff adds or removes (``+++``/``---`` headers excluded)."""
    return sum(
        1
        for line in text.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++ ", "--- "))
    )


def apply(original: str, patch: FilePatch) -> str:
    """``original`` with the hunks applied.

    Raises:
        ValueError: a hunk's old lines are not at its place (the text is not the version the
            patch was made for).
    """
    lines = original.split("\n")
    offset = 0
    for hunk in patch.hunks:
        at = hunk.old_start - 1 + offset
        if tuple(lines[at : at + len(hunk.old)]) != hunk.old:
            raise ValueError(f"{patch.path}: hunk at line {hunk.old_start} does not apply")
        lines[at : at + len(hunk.old)] = list(hunk.new)
        offset += len(hunk.new) - len(hunk.old)
    return "\n".join(lines)


def patched_files(reference_folder: Path) -> dict[str, str]:
    """The files the patch changes, patched, keyed by their path in the install."""
    return {
        fp.path: apply((reference_folder / fp.path).read_text(), fp)
        for fp in parse(PATCH.read_text())
    }


def mori_with_mixin(text: str) -> str:
    """Mori's ``conn.py`` with the patched mixin listed in its bases (the mistake)."""
    header = "class MoriKVManager(CommonKVManager):"
    if header not in text:
        raise ValueError("Mori's class statement is not where the test expects it")
    text = text.replace(header, "class MoriKVManager(StagingManagerMixin, CommonKVManager):", 1)
    anchor = "from sglang.srt.environ import envs\n"
    return text.replace(
        anchor,
        anchor + "from sglang.srt.disaggregation.common.staging_handler import "
        "StagingManagerMixin\n",
        1,
    )


def overlay(reference_folder: Path, dest: Path, files: dict[str, str]) -> Path:
    """A folder whose ``sglang`` is the install with ``files`` replaced; returns ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    real: set[Path] = {dest}
    for rel in files:
        parts = Path(rel).parts
        for depth in range(1, len(parts)):
            real.add(dest.joinpath(*parts[:depth]))
    for folder in sorted(real, key=lambda p: len(p.parts)):
        folder.mkdir(exist_ok=True)
        source = reference_folder / folder.relative_to(dest)
        if folder == dest:
            entries = ["sglang"]
        else:
            entries = [e.name for e in source.iterdir() if e.name != "__pycache__"]
        for name in entries:
            target = folder / name
            if target in real or str(target.relative_to(dest)) in files:
                continue
            os.symlink(source / name, target)
    for rel, content in files.items():
        (dest / rel).write_text(content)
    return dest


def patched(reference_folder: Path, dest: Path, *, mori_mixin: bool = False) -> Path:
    """The overlay with the patch applied (and, if asked, Mori given the mixin)."""
    files = patched_files(reference_folder)
    if mori_mixin:
        files[MORI] = mori_with_mixin((reference_folder / MORI).read_text())
    return overlay(reference_folder, dest, files)


def copy_tree(source: Path, dest: Path) -> Path:
    """Real copies of :data:`TYPED_FILES` (and their packages' ``__init__``) from the
    ``sglang`` under ``source`` (an install or an overlay), for mypy."""
    if dest.exists():
        shutil.rmtree(dest)
    packages = (
        "sglang/__init__.py",
        "sglang/srt/__init__.py",
        "sglang/srt/disaggregation/__init__.py",
    )
    for rel in (*TYPED_FILES, *packages):
        if not (source / rel).is_file():
            continue  # a namespace package (the wheel's sglang/srt has no __init__)
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((source / rel).read_text())
    return dest


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def run_probe(out: Path, overlay_dir: Path | None = None) -> dict[str, Any]:
    """Run :mod:`._adoption_probe` in a fresh process (over ``overlay_dir`` if given) and
    return its report.

    Raises:
        RuntimeError: the probe did not write its report (its output is in the message).
    """
    command = [sys.executable, "-m", "tests.interop._adoption_probe", str(out)]
    if overlay_dir is not None:
        command[3:3] = ["--overlay", str(overlay_dir)]
    done = subprocess.run(
        command,
        cwd=ROOT,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(
            f"the adoption probe failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
            f"{done.stderr[-6000:]}"
        )
    report: dict[str, Any] = json.loads(out.read_text())
    return report


_CHECK = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.interop._reference import ensure_installed, importing
from staging_contracts.cli import main
with importing(ensure_installed()):
    status = main(sys.argv[2:])
sys.exit(status)
"""


def run_check(overlay_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``staging-contracts ARGS`` in a process where the overlay's ``sglang`` imports (its
    GPU-only imports stood in for while the command imports it)."""
    return subprocess.run(
        [sys.executable, "-c", _CHECK, str(overlay_dir), *args],
        cwd=ROOT,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
        check=False,
    )


_MYPY_CONFIG: Final = """\
[mypy]
python_version = 3.11
plugins = staging_contracts.mypy_plugin
explicit_package_bases = True
ignore_missing_imports = True
follow_imports = skip
mypy_path = {tree}

[mypy-staging_contracts.*]
follow_imports = normal
"""
"""mypy over the 17 files alone: SGLang's other modules (and torch, numpy, zmq) are not
followed, so each run takes seconds; staging_contracts is, so the plugin sees the mixin."""

_MYPY_LINE: Final = re.compile(
    r"^(?P<file>[^:]+):(?P<line>\d+): (?P<level>error|note): "
    r"(?P<text>.*?)(?:  \[(?P<code>[a-z-]+)\])?$"
)


@dataclass(frozen=True, order=True)
class MypyError:
    """One error mypy reported: the file (relative to the tree), line, code and text."""

    file: str
    line: int
    code: str
    text: str


def mypy_errors(tree: Path, cache: Path) -> list[MypyError]:
    """mypy's errors over :data:`TYPED_FILES` of ``tree`` (default options, not strict: as
    SGLang's maintainers would run it), with the plugin enabled."""
    config = cache.parent / f"{cache.name}.ini"
    config.write_text(_MYPY_CONFIG.format(tree=tree))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(config),
            "--cache-dir",
            str(cache),
            "--no-error-summary",
            "--hide-error-context",
            *(str(tree / rel) for rel in TYPED_FILES),
        ],
        cwd=tree,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
        check=False,
    )
    if done.returncode not in (0, 1):
        raise RuntimeError(f"mypy crashed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    errors: list[MypyError] = []
    for line in done.stdout.splitlines():
        match = _MYPY_LINE.match(line)
        if match is None or match["level"] != "error":
            continue
        path = Path(match["file"])
        rel = str(path.relative_to(tree)) if path.is_absolute() else str(path)
        errors.append(MypyError(rel, int(match["line"]), match["code"] or "", match["text"]))
    return errors


_KIT_CONFTEST: Final = """\
import os
import sys

sys.path.insert(0, {overlay!r})
from tests.interop._reference import ensure_installed, load_reference

load_reference(ensure_installed())  # its modules import here, with their stand-ins
_status = []


def pytest_sessionfinish(session, exitstatus):
    _status.append(int(exitstatus))


def pytest_unconfigure(config):
    # SGLang's managers cannot be closed; their ZMQ contexts would block at exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_status[0] if _status else 0)
"""


def run_kit(overlay_dir: Path, folder: Path, *specs: str) -> subprocess.CompletedProcess[str]:
    """The contract kit (``pytest --staging-backend SPEC ...``) in a fresh process whose
    ``sglang`` is the overlay's, from an empty project in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "conftest.py").write_text(_KIT_CONFTEST.format(overlay=str(overlay_dir)))
    args = [arg for spec in specs for arg in ("--staging-backend", spec)]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-q", *args],
        cwd=folder,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
        check=False,
    )
