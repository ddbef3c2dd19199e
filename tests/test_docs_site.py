"""The documentation site's sources: the hooks' link rewriting, the docstrings' markup, and the
API reference's reach.

``make docs`` (part of ``make test``) builds the site itself, in strict mode, which also fails
on a page missing from the nav or a nav entry without its page.
"""

from __future__ import annotations

import importlib
import re
from os import pardir as UP
from pathlib import Path
from typing import Final

import pytest

from scripts.docs_griffe import markdown_docstring
from scripts.docs_hooks import site_links

REPO: Final = Path(__file__).resolve().parent.parent
REFERENCE: Final = REPO / "docs" / "reference"
DIRECTIVE: Final = re.compile(r"^::: (\S+)$", re.MULTILINE)
SHOWN_IMPORT: Final = re.compile(r"from (staging_contracts[\w.]*) import")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository with a README, a docs folder and an example folder outside it."""
    (tmp_path / "docs" / "images").mkdir(parents=True)
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n")
    (tmp_path / "docs" / "images" / "chart.png").write_bytes(b"")
    (tmp_path / "examples" / "acme").mkdir(parents=True)
    return tmp_path


def test_readme_links_into_docs_become_relative_to_the_site_root(repo: Path) -> None:
    """The README's docs/... links and images lose their docs/ prefix, anchors kept."""
    text = "See [the guide](docs/guide.md#step-2) and ![chart](docs/images/chart.png)."
    assert site_links(text, page_dir="", repo=repo) == (
        "See [the guide](guide.md#step-2) and ![chart](images/chart.png)."
    )


def test_links_outside_docs_become_their_text_when_the_target_exists(repo: Path) -> None:
    """A docs page's link to an existing repository folder outside docs/ keeps only its text."""
    text = f"The example: [`examples/acme/`]({UP}/examples/acme/)."
    assert site_links(text, page_dir="docs", repo=repo) == "The example: `examples/acme/`."


def test_broken_links_are_left_for_the_strict_build_to_report(repo: Path) -> None:
    """A link to nothing, inside docs/ or out, is left as written (mkdocs then warns)."""
    text = f"[gone]({UP}/examples/gone/) [outside]({UP}/{UP}/elsewhere.md) [typo](guid.md)"
    assert site_links(text, page_dir="docs", repo=repo) == text


def test_external_links_and_anchors_are_untouched(repo: Path) -> None:
    """URLs, mailto links, absolute paths and in-page anchors stay as they are."""
    text = "[a](https://example.org/x.md) [b](mailto:x@example.org) [c](#security) [d](/abs)"
    assert site_links(text, page_dir="", repo=repo) == text


def test_links_between_docs_pages_stay_relative_to_the_page(repo: Path) -> None:
    """A page in docs/reference/ keeps its links to the pages and images one folder up."""
    (repo / "docs" / "reference").mkdir()
    text = f"[guide]({UP}/guide.md) [chart]({UP}/images/chart.png)"
    assert site_links(text, page_dir="docs/reference", repo=repo) == text


def test_docstring_roles_become_code_spans() -> None:
    """reST roles render as code: the last component after ``~``, the target otherwise."""
    text = "Use :class:`~staging_contracts.testing._kit.StagingBackendContract` or :func:`.run`."
    assert markdown_docstring(text) == "Use `StagingBackendContract` or `run`."
    assert markdown_docstring(":mod:`staging_contracts.testing.plugin`") == (
        "`staging_contracts.testing.plugin`"
    )


def test_a_literal_block_introduction_loses_one_colon() -> None:
    """``name the backend::`` before an indented block reads ``name the backend:``."""
    text = "Name the backend::\n\n    backend_class = X\n\nA ratio: 2::3 stays."
    assert markdown_docstring(text) == (
        "Name the backend:\n\n    backend_class = X\n\nA ratio: 2::3 stays."
    )


def reference_modules() -> list[str]:
    """Every module an API reference page renders, in page order."""
    pages = sorted(REFERENCE.glob("*.md"))
    return [module for page in pages for module in DIRECTIVE.findall(page.read_text())]


def test_the_reference_renders_modules_that_import() -> None:
    """Each ``::: module`` of docs/reference/ names a module of the package that imports."""
    modules = reference_modules()
    assert "staging_contracts" in modules
    assert len(modules) == len(set(modules)), "a module is rendered twice"
    for module in modules:
        importlib.import_module(module)


def test_the_reference_covers_every_module_the_docs_import_from() -> None:
    """A module the README or a guide imports from has its API reference."""
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    shown = {m for doc in docs for m in SHOWN_IMPORT.findall(doc.read_text())}
    assert "staging_contracts.testing" in shown  # the reader finds the imports
    assert shown - set(reference_modules()) == set()


README_MAX_LINES: Final = 250


def test_the_readme_is_short() -> None:
    """The README is an entry point: at most 250 lines; the rest lives in the docs pages."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)


def test_every_docs_page_is_in_the_nav() -> None:
    """Each page of docs/ (the API reference aside) is listed in mkdocs.yml's nav."""
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages - set(re.findall(r":\s*(\S+\.md)\s*$", nav, re.M)) == set()
