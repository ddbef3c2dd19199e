"""MkDocs hooks of the documentation site (``mkdocs.yml`` names this file).

The pages are written to be read in the repository too, so their relative links name files
of the repository. The site holds only ``docs/``, and the README as its home page:

* the README is added as a generated ``index.md``;
* a link into ``docs/`` is made relative to the page it is on in the site (the README's
  ``docs/writing-a-backend.md`` becomes ``writing-a-backend.md``);
* a link to a file or folder of the repository outside ``docs/`` (the guide's link to
  ``examples/third_party_backend/``) has no page in the site: it becomes its link text, once
  the target is found to exist;
* a link whose target does not exist is left as it is, and the strict build fails on it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Final

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

README: Final = "README.md"
INDEX: Final = "index.md"

_LINK: Final = re.compile(r"(?P<bang>!?)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)\)")
"""An inline Markdown link or image: ``[text](target)``, ``![alt](target)``."""

_EXTERNAL: Final = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|#|/)", re.IGNORECASE)
"""A target with a scheme (``https:``, ``mailto:``), an anchor of the page, or an absolute path."""


def site_links(markdown: str, *, page_dir: str, repo: Path, docs: str = "docs") -> str:
    """``markdown`` with its repository links made fit for the site.

    ``page_dir`` is the folder, relative to the repository root ``repo``, that the page's
    links are relative to (``""`` for the README, ``"docs"`` for ``docs/x.md``).
    """

    def replace(match: re.Match[str]) -> str:
        target = match["target"]
        if _EXTERNAL.match(target):
            return match[0]
        path, hash_, anchor = target.partition("#")
        in_repo = posixpath.normpath(posixpath.join(page_dir, path))
        if in_repo == docs or in_repo.startswith(docs + "/"):
            relative = posixpath.relpath(in_repo, posixpath.join(docs, page_dir_in_docs()))
            return f"{match['bang']}[{match['text']}]({relative}{hash_}{anchor})"
        above = in_repo == posixpath.pardir or in_repo.startswith(posixpath.pardir + "/")
        if above or not (repo / in_repo).exists():
            return match[0]  # not found: the strict build says so
        return match["text"]

    def page_dir_in_docs() -> str:
        if page_dir == docs or page_dir.startswith(docs + "/"):
            return posixpath.relpath(page_dir, docs)
        return "."  # the README: its page is the site's root

    return _LINK.sub(replace, markdown)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the README as the site's home page (``docs/`` has no index of its own)."""
    readme = Path(config.config_file_path).parent / README
    files.append(File.generated(config, INDEX, content=readme.read_text(encoding="utf-8")))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Make the page's repository links fit for the site (see the module's docstring)."""
    repo = Path(config.config_file_path).parent
    docs = posixpath.relpath(Path(config.docs_dir).as_posix(), repo.as_posix())
    if page.file.generated_by is not None and page.file.src_uri == INDEX:
        page_dir = ""
    else:
        page_dir = posixpath.join(docs, posixpath.dirname(page.file.src_uri)).rstrip("/")
    return site_links(markdown, page_dir=page_dir, repo=repo, docs=docs)
