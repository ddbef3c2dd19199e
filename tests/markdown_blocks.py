"""The fenced code blocks of a Markdown page, and the shell commands they show.

Used by ``tests/test_markdown_blocks.py``. A block's info string is a language and at most a
``title="..."`` (the form pymdownx.superfences and GitHub both accept; the site shows the
title above the block). The titles that mark a block (see that test module) start with one of
:data:`MARKS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

LANGUAGES: Final = frozenset({"python", "sh", "console", "ini", "toml", ""})
"""The info-string languages a page may use: code that runs, configuration, and plain output."""

SHELLS: Final = frozenset({"sh", "console"})

MARKS: Final = ("fragment: ", "raises ", "needs ")
"""Title prefixes that change how a block is tested; any other title names a file."""

_OPEN: Final = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_INFO: Final = re.compile(r'^(?P<lang>[\w+-]*)(?: +title="(?P<title>[^"]+)")? *$')


@dataclass(frozen=True)
class Block:
    """One fenced code block."""

    doc: str
    """The page, relative to the repository root."""
    line: int
    """The line of its opening fence (1-based)."""
    lang: str
    title: str | None
    text: str
    """Its content, with the opening fence's indentation removed."""

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def mark(self) -> str | None:
        """The marking prefix of its title (``"fragment: "``, ``"raises "``, ``"needs "``)."""
        return next((m for m in MARKS if self.title and self.title.startswith(m)), None)


@dataclass(frozen=True)
class Command:
    """One shell command shown in a block, and the output a console block shows after it."""

    block: Block
    text: str
    """The command, continuation lines joined, its trailing ``# comment`` dropped."""
    output: str | None
    """What a ``console`` block shows after the command (``None`` when it shows nothing)."""
    before: tuple[str, ...]
    """The commands shown before it in the same block."""

    @property
    def synopsis(self) -> bool:
        """A usage line (``staging-contracts demo [--backend SPEC] ...``), not a command."""
        return " [" in self.text

    @property
    def where(self) -> str:
        return f"{self.block.where}: {self.text}"


def blocks(path: Path, root: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of the page at ``path``, and the problems found reading them (an
    unclosed fence, an info string of another shape or language)."""
    doc = path.relative_to(root).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    problems: list[str] = []
    number = 0
    while number < len(lines):
        opening = _OPEN.match(lines[number])
        number += 1
        if opening is None:
            continue
        start, indent, fence = number, len(opening["indent"]), opening["fence"]
        closing = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}} *$")
        body: list[str] = []
        while number < len(lines) and not closing.match(lines[number]):
            line = lines[number]
            body.append(line[indent:] if line[:indent].strip() == "" else line)
            number += 1
        if number == len(lines):
            problems.append(f"{doc}:{start}: the fence opened here is never closed")
            break
        number += 1
        info = _INFO.match(opening["info"].strip())
        if info is None or info["lang"] not in LANGUAGES:
            problems.append(
                f"{doc}:{start}: info string {opening['info'].strip()!r}: expected one of"
                f' {sorted(LANGUAGES)}, optionally followed by title="..."'
            )
            continue
        found.append(Block(doc, start, info["lang"], info["title"], "\n".join(body) + "\n"))
    return found, problems


def _strip_comment(line: str) -> str:
    """``line`` without a trailing `` # comment`` (none of the pages quotes a ``#``)."""
    return re.sub(r"(^|\s)#.*$", "", line).rstrip()


def commands(block: Block) -> list[Command]:
    """The shell commands a ``sh`` or ``console`` block shows, in order."""
    found: list[Command] = []
    lines = block.text.splitlines()
    if block.lang == "sh":
        joined: list[str] = []
        pending = ""
        for line in lines:
            text = _strip_comment(line)
            if text.endswith("\\"):
                pending += text[:-1].rstrip() + " "
                continue
            text = (pending + text.strip()).strip()
            pending = ""
            if text.startswith("[") and joined:  # a synopsis going on over its next line
                joined[-1] += " " + text
            elif text:
                joined.append(text)
        joined = [" ".join(c.split()) if " [" in c else c for c in joined]
        found = [Command(block, c, None, tuple(joined[:i])) for i, c in enumerate(joined)]
    elif block.lang == "console":
        shown: list[tuple[str, list[str]]] = []
        for line in lines:
            if line.startswith("$ "):
                shown.append((_strip_comment(line[2:]).strip(), []))
            elif shown:
                shown[-1][1].append(line)
        for i, (text, output) in enumerate(shown):
            out = "\n".join(output).strip()
            found.append(Command(block, text, out or None, tuple(c for c, _ in shown[:i])))
    return found


def following(block: Block, every: list[Block]) -> Block | None:
    """The block of the same page that comes right after ``block``, if any."""
    later = [b for b in every if b.doc == block.doc and b.line > block.line]
    return min(later, key=lambda b: b.line) if later else None
