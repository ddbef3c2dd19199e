"""The repository stands on its own: nothing under src/, tests/, scripts/ or the build files
refers to a path outside the repository root (a user's clone has nothing beside it)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

REPO: Final = Path(__file__).resolve().parent.parent

BESIDE: Final = str(REPO.parent) + "/"
"""Absolute paths starting here (and not inside the repository) name a neighbour of the clone."""

_PARENT_STEP: Final = re.compile(r"(?:^|[/\"'\s=(])\.\.(?:/|[\"'])")
"""A ``..`` path component: ``../x``, ``x/..``, or ``".."`` as a join argument."""

_SHARED: Final = re.compile(r"(?:^|/)shared/(?:vectors|docs)\b")
"""The folder beside the project's own checkout, which a user's clone does not have."""


def scanned_files() -> list[Path]:
    """Every file whose paths must stay inside: sources, tests, scripts and the build."""
    roots = [REPO / "src", REPO / "tests", REPO / "scripts"]
    files = [p for root in roots if root.is_dir() for p in sorted(root.rglob("*")) if p.is_file()]
    build = ("Makefile", ".ci/run", "pyproject.toml", "mypy.ini")
    files += [REPO / name for name in build if (REPO / name).is_file()]
    return [
        p
        for p in files
        if "__pycache__" not in p.parts
        and p.suffix not in {".pyc", ".png"}
        and p != Path(__file__).resolve()  # its own examples of what it catches
    ]


_SCRIPT_DIR: Final = '$(dirname "$0")/'
"""A shell script's own folder: ``..`` after it climbs from the script, not from the cwd."""


def parent_steps(text: str, depth: int = 0) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of each ``..`` path component in ``text`` that may leave the root.

    ``depth`` is how many folders below the root the file sits: a script may climb that many
    from its own folder (``cd "$(dirname "$0")/.."`` in ``.ci/run``).
    """
    for number, line in enumerate(text.splitlines(), start=1):
        if not _PARENT_STEP.search(line):
            continue
        before, _, after = line.partition(_SCRIPT_DIR)
        if after and not _PARENT_STEP.search(before) and after.count("..") <= depth:
            continue
        yield number, line.strip()


def _ups(node: ast.expr) -> int | None:
    """Directories climbed from ``__file__`` by a chain of ``.parent``, ``.parents[k]`` and
    ``os.path.dirname``; ``None`` where the chain does not start at ``__file__``."""
    if isinstance(node, ast.Name):
        return 0 if node.id == "__file__" else None
    if isinstance(node, ast.Attribute):
        inner = _ups(node.value)
        if inner is None:
            return None
        return inner + 1 if node.attr == "parent" else inner
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
        inner = _ups(node.value.value)
        if inner is not None and node.value.attr == "parents":
            index = node.slice
            if isinstance(index, ast.Constant) and isinstance(index.value, int):
                return inner + index.value + 1
            return inner + 10**6  # a computed index: assume the worst
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if node.args:
            inner = _ups(node.args[0])
            if inner is not None:
                return inner + 1 if name == "dirname" else inner
        if isinstance(func, ast.Attribute):  # Path(__file__).resolve(), .absolute()
            return _ups(func.value)
    return None


def python_escapes(source: str, depth: int, beside: str = BESIDE) -> Iterator[tuple[int, str]]:
    """``(line, why)`` for each path in a Python file that leaves the repository.

    ``depth`` is how many folders below the root the file sits (``tests/x.py``: 1); an
    absolute path under ``beside`` (the clone's parent) but not in the clone names a neighbour.
    """
    inside = str(REPO) + "/"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            ups = _ups(node)
            if ups is not None and ups > depth + 1:
                yield node.lineno, f"climbs {ups - depth - 1} folder(s) above the repository root"
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            if (value.startswith(beside) and not value.startswith(inside)) or _SHARED.search(value):
                yield node.lineno, f"names the path {value!r} outside the repository"


def escapes(path: Path) -> list[str]:
    """Every reference to a path outside the repository in ``path``."""
    relative = path.relative_to(REPO)
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return []
    depth = len(relative.parts) - 1
    found = [f"{relative}:{n}: '..' in {line!r}" for n, line in parent_steps(text, depth)]
    if path.suffix == ".py":
        found += [f"{relative}:{n}: {why}" for n, why in python_escapes(text, depth)]
    return found


def test_nothing_refers_outside_the_repository() -> None:
    """No source, test, script or build file names a path beside or above the clone."""
    files = scanned_files()
    assert any(p.name == "Makefile" for p in files)
    assert any(p.name == "reference_staging.json" for p in files)
    found = [line for p in files for line in escapes(p)]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        'VECTORS = ROOT / ".." / "neighbour"',
        "cp ../neighbour/vectors/x.json tests/data",
        "path = 'data/../../outside'",
        "open('..')",
    ],
)
def test_a_parent_step_is_found(line: str) -> None:
    """Each form of ``..`` is found."""
    assert list(parent_steps(line)) == [(1, line)]


@pytest.mark.parametrize("line", ["from ..staging import layout", "x = 'a...b'", "..."])
def test_relative_imports_and_ellipses_are_not_parent_steps(line: str) -> None:
    """Relative imports and ellipses are not paths."""
    assert list(parent_steps(line)) == []


def test_a_script_may_climb_to_the_root_from_its_own_folder() -> None:
    """``.ci/run`` climbs one folder from itself, to the root; two would leave it."""
    line = 'cd "$(dirname "$0")/.."'
    assert list(parent_steps(line, depth=1)) == []
    assert list(parent_steps('cd "$(dirname "$0")/../.."', depth=1)) != []
    assert list(parent_steps(line, depth=0)) == [(1, line)]


@pytest.mark.parametrize(
    ("source", "depth", "expected"),
    [
        ("Path(__file__).resolve().parents[2] / 'outside'", 1, 1),
        ("Path(__file__).parent.parent.parent", 1, 1),
        ("os.path.dirname(os.path.dirname(os.path.dirname(__file__)))", 1, 1),
        ("Path(__file__).resolve().parents[1] / 'examples'", 1, 0),
        ("Path(__file__).parent.parent", 1, 0),
        ("Path(__file__).parents[3]", 3, 0),
        ("Path(__file__).parents[4]", 3, 1),
        ("p = '/elsewhere/shared/vectors/x.json'", 1, 1),
        ("p = '/clones/neighbour/file.txt'", 1, 1),
        ("p = '/clones/main/tests/data/x.json'", 1, 0),
        ("p = '/usr/share/zoneinfo/UTC'", 1, 0),  # unrelated (not /tmp: clones live there)
        ("cache_dir = '/data'", 1, 0),
        ("p = 'relative/path'", 1, 0),
    ],
)
def test_python_escapes_are_found(source: str, depth: int, expected: int) -> None:
    """``__file__`` chains that climb above the root, paths beside the clone and the shared
    folder are found; paths inside the repository and unrelated strings are not."""
    source = source.replace("/clones/main/", str(REPO) + "/").replace("/clones/", BESIDE)
    assert len(list(python_escapes(source, depth))) == expected
