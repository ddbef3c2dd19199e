"""A griffe extension of the documentation site: the docstrings' reST markup as Markdown.

The package's docstrings are written for reading in the source and in ``help()``, in the
reST style (``:class:`~.kit.StagingBackendContract```, ``name the backend::`` before an
indented example). mkdocstrings renders docstrings as Markdown, where that markup would show
as it is written; this extension rewrites it when griffe loads the package, for the API
reference only (``mkdocs.yml`` names it). A role becomes a code span (``StagingBackendContract``:
the last component when the target starts with ``~``), and a paragraph's closing ``::``
becomes ``:`` (the indented block after it is already a code block in Markdown).
"""

from __future__ import annotations

import re
from typing import Any, Final

import griffe

_ROLE: Final = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const):`(?P<target>[^`]+)`")
_LITERAL_INTRO: Final = re.compile(r"(?<=\S)::$", re.MULTILINE)


def markdown_docstring(text: str) -> str:
    """``text`` with its reST roles as code spans and its ``::`` introductions as ``:``."""

    def code(match: re.Match[str]) -> str:
        target = match["target"]
        if target.startswith("~"):
            target = target[1:].rsplit(".", 1)[-1]
        return f"`{target.lstrip('.')}`"

    return _LITERAL_INTRO.sub(":", _ROLE.sub(code, text))


class ReSTAsMarkdown(griffe.Extension):
    """Rewrite every docstring of the loaded objects with :func:`markdown_docstring`."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Called by griffe for each object once the tree is built."""
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
