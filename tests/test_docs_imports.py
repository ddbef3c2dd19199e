"""Every ``staging_contracts`` import the README and the guides show works as written."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Final

import pytest

REPO: Final = Path(__file__).resolve().parent.parent
DOCS: Final = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
IMPORT: Final = re.compile(r"from (staging_contracts[\w.]*) import ([\w, ]+)")


def shown_imports() -> list[tuple[str, str, str]]:
    """``(doc, module, name)`` for each name a doc imports from the package."""
    found = []
    for doc in DOCS:
        for module, names in IMPORT.findall(doc.read_text()):
            for name in names.split(","):
                if name.strip():
                    found.append((doc.name, module, name.strip()))
    return found


def test_the_docs_show_imports() -> None:
    """The reader finds the imports (a reader that found none would pass anything)."""
    modules = {module for _, module, _ in shown_imports()}
    assert {"staging_contracts", "staging_contracts.backends"} <= modules
    assert "staging_contracts.testing" in modules


def test_the_docs_import_only_public_modules() -> None:
    """What the README and the guides show a user imports from public modules only: no
    module or package of the path starts with ``_``."""
    private = sorted(
        {f"{doc}: {module}" for doc, module, _ in shown_imports() if "._" in f".{module}"}
    )
    assert not private, private


@pytest.mark.parametrize(("doc", "module", "name"), shown_imports())
def test_shown_import_works(doc: str, module: str, name: str) -> None:
    """The module exists and has the name (a module, class or function)."""
    imported = importlib.import_module(module)
    if not hasattr(imported, name):
        importlib.import_module(f"{module}.{name}")
