"""The tooling writes nothing twice: no run of six code lines stands in two places of it.

The tooling is what runs on top of the core: ``testing/``, ``_cluster/``, ``_bench/``,
``_run/`` and ``cli.py``. A *code line* is a line with a token that is not punctuation,
outside import statements, comments and the continuation lines of a string that spans several
lines (a docstring counts once, by its first line). Two places repeat when six consecutive
code lines read the same, token for token (white space and line breaks inside a line aside).
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections import defaultdict
from pathlib import Path
from typing import Final

PACKAGE_ROOT: Final = Path(__file__).resolve().parent.parent / "src" / "staging_contracts"
TOOLING: Final = ("testing", "_cluster", "_bench", "_run")
RUN_LINES: Final = 6
_SKIPPED: Final = frozenset(
    {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
)


def tooling_files(root: Path = PACKAGE_ROOT) -> list[Path]:
    """``cli.py`` and every module of the tooling packages."""
    return [root / "cli.py", *(f for unit in TOOLING for f in sorted((root / unit).glob("*.py")))]


def code_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, its tokens joined)`` of every code line of a module's source."""
    imports: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            imports.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    tokens: dict[int, list[str]] = defaultdict(list)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in _SKIPPED or token.start[0] in imports:
            continue
        tokens[token.start[0]].append(token.string.split("\n", 1)[0])
    lines = [(number, " ".join(parts)) for number, parts in sorted(tokens.items())]
    return [(number, line) for number, line in lines if any(c.isalnum() for c in line)]


def repeated_runs(files: list[Path], root: Path = PACKAGE_ROOT) -> list[str]:
    """Each run of :data:`RUN_LINES` code lines found in more than one place, with them."""
    places: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for path in files:
        lines = code_lines(path.read_text())
        for start in range(len(lines) - RUN_LINES + 1):
            run = lines[start : start + RUN_LINES]
            where = f"{path.relative_to(root)}:{run[0][0]}-{run[-1][0]}"
            places[tuple(line for _, line in run)].append(where)
    return [" ~ ".join(found) for found in places.values() if len(found) > 1]


def test_no_run_of_six_code_lines_repeats_within_the_tooling() -> None:
    repeats = repeated_runs(tooling_files())
    assert not repeats, "\n".join(repeats)


def test_a_repeated_run_is_found(tmp_path: Path) -> None:
    """The finder itself: six lines written twice are found (once moved and re-indented,
    with a comment and an import between), five are not."""
    body = [f"value_{i} = compute({i}, 'text')" for i in range(RUN_LINES)]
    first = tmp_path / "first.py"
    first.write_text("\n".join(["import os", *body, "print(os.sep)"]) + "\n")
    second = tmp_path / "second.py"
    moved = ["    " + line for line in body]
    moved.insert(3, "    # a comment\n    from os import sep")
    second.write_text("def f() -> None:\n" + "\n".join(moved) + "\n")
    assert len(repeated_runs([first, second], tmp_path)) == 1
    second.write_text("\n".join(body[1:]) + "\n")
    assert repeated_runs([first, second], tmp_path) == []
