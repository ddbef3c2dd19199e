"""Backend specs and ``MODULE:NAME`` references as text: the one parser and importer.

Every place that takes a backend by text (:func:`~staging_contracts.backends.resolve_backend`,
the pytest kit's ``--staging-backend``, the command line's ``check MODULE:CLASS``) splits it
with :func:`split_spec` or :func:`split_ref` and imports it with :func:`import_ref`; each words
its own errors from the typed failures raised here (:class:`RefUnavailable`), so that their
messages stay their own while the grammar and the import are defined once.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Final

from .._contract.problems import ContractError

__all__ = [
    "AttributeMissing",
    "ModuleMissing",
    "ModuleRaised",
    "ModuleRejected",
    "Ref",
    "RefUnavailable",
    "SpecParts",
    "a_type",
    "article",
    "import_ref",
    "import_ref_text",
    "split_ref",
    "split_spec",
]

_NAME: Final = r"[A-Za-z_][A-Za-z0-9_]*"
_REF: Final = rf"{_NAME}(?:\.{_NAME})*:{_NAME}(?:\.{_NAME})*"
_BACKEND_NAME: Final = r"[A-Za-z_][A-Za-z0-9_.-]*"
_SPEC_RE: Final = re.compile(rf"(?:{_REF}|{_BACKEND_NAME})(?:={_REF})?")
"""A spec in its strict form: ``NAME`` or ``MODULE:CLASS``, then optionally ``=MODULE:FACTORY``,
each part made of Python identifiers (a name may also hold ``.`` and ``-``)."""


@dataclass(frozen=True, slots=True)
class Ref:
    """A ``MODULE:QUALNAME`` reference, split."""

    module: str
    """The module to import."""
    qualname: str
    """The dotted name inside it."""

    @property
    def text(self) -> str:
        """``MODULE:QUALNAME``."""
        return f"{self.module}:{self.qualname}"

    @property
    def name(self) -> str:
        """The object's own name (the last part of :attr:`qualname`)."""
        return self.qualname.rpartition(".")[2]


def split_ref(ref: str) -> Ref | None:
    """``MODULE:QUALNAME`` split at its first colon; ``None`` when either side is empty."""
    module, colon, qualname = ref.partition(":")
    if not colon or not module or not qualname:
        return None
    return Ref(module, qualname)


@dataclass(frozen=True, slots=True)
class SpecParts:
    """A backend spec (``NAME | MODULE:CLASS[=MODULE:FACTORY]``) split at its first ``=``."""

    text: str
    """The spec as split."""
    backend: str
    """``NAME`` or ``MODULE:CLASS`` (empty when the spec starts with ``=``)."""
    factory: str | None
    """What follows ``=`` (empty when nothing does); ``None`` without ``=``."""

    @property
    def names_class(self) -> bool:
        """The backend part is ``MODULE:CLASS`` rather than a registry name."""
        return ":" in self.backend

    @property
    def strict(self) -> bool:
        """The spec has the strict form (identifiers only, both refs ``MODULE:NAME``)."""
        return _SPEC_RE.fullmatch(self.text) is not None


def split_spec(spec: str) -> SpecParts:
    """Split a backend spec into its backend and factory parts; checks nothing else."""
    backend, eq, factory = spec.partition("=")
    return SpecParts(spec, backend, factory if eq else None)


class RefUnavailable(Exception):
    """The object a :class:`Ref` names cannot be had; the subclass says at which step."""

    def __init__(self, ref: Ref, cause: BaseException | None = None) -> None:
        super().__init__(ref.text)
        self.ref = ref
        """The reference that failed."""
        self.cause = cause
        """The exception that stopped it (``None`` for a missing attribute)."""


class ModuleRejected(RefUnavailable):
    """Importing the module raised a :class:`ContractError` (a ``class`` statement refused)."""

    def __init__(self, ref: Ref, cause: ContractError) -> None:
        super().__init__(ref, cause)
        self.error = cause
        """The contract's error."""


class ModuleMissing(RefUnavailable):
    """The module cannot be imported (an ``ImportError``)."""

    def __init__(self, ref: Ref, cause: ImportError) -> None:
        super().__init__(ref, cause)
        self.error = cause
        """The ``ImportError``."""


class ModuleRaised(RefUnavailable):
    """Importing the module raised something other than an ``ImportError``."""

    def __init__(self, ref: Ref, cause: Exception) -> None:
        super().__init__(ref, cause)
        self.error = cause
        """What it raised."""


class AttributeMissing(RefUnavailable):
    """The module imports but has no attribute at :attr:`Ref.qualname`."""


def import_ref(ref: Ref) -> object:
    """Import ``ref.module`` and return the object at ``ref.qualname``.

    **Thread:** any; imports modules.

    Raises:
        ModuleRejected: the module's import raised a ``ContractError``.
        ModuleMissing: it raised an ``ImportError``.
        ModuleRaised: it raised any other exception.
        AttributeMissing: a part of the qualified name is not there.
    """
    try:
        obj: object = importlib.import_module(ref.module)
    except ContractError as exc:
        raise ModuleRejected(ref, exc) from exc
    except ImportError as exc:
        raise ModuleMissing(ref, exc) from exc
    except Exception as exc:  # any error of the imported module: the caller words it
        raise ModuleRaised(ref, exc) from exc
    for part in ref.qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeMissing(ref) from None
    return obj


def import_ref_text(text: str) -> object:
    """:func:`import_ref` of ``MODULE:QUALNAME`` text, each failure a one-line ``ValueError``
    (the wording of :func:`~staging_contracts.backends.resolve_backend` and the registry)."""
    ref = split_ref(text)
    if ref is None:
        raise ValueError(f"{text!r} is not MODULE:NAME")
    try:
        return import_ref(ref)
    except ModuleRejected as failure:
        exc = failure.error
        problems = "; ".join(p.describe(instance=False) for p in exc.problems)
        raise ValueError(
            f"importing {ref.module!r}: {exc.cls.__qualname__} does not satisfy the "
            f"{exc.contract_name} contract: {problems} (staging-contracts check {text} explains)"
        ) from None
    except ModuleMissing as failure:
        raise ValueError(f"cannot import {ref.module!r}: {failure.error}") from None
    except ModuleRaised as failure:
        exc_raised = failure.error
        raise ValueError(
            f"importing {ref.module!r} raised {type(exc_raised).__name__}: {exc_raised}"
        ) from None
    except AttributeMissing:
        raise ValueError(f"module {ref.module!r} has no attribute {ref.qualname!r}") from None


def article(noun: str) -> str:
    """``a`` or ``an``, for ``noun``."""
    return "an" if noun[:1].lower() in "aeiou" else "a"


def a_type(obj: object) -> str:
    """``a Foo`` / ``an int``: the type of ``obj`` with its article."""
    name = type(obj).__name__
    return f"{article(name)} {name}"
