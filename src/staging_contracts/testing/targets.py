"""Backends named on the command line: ``NAME``, ``MODULE:CLASS``, either with ``=MODULE:FACTORY``.

``NAME`` is an in-tree backend (``local``, ``mooncake``, ``nixl``, ``ascend``) or one
registered under the ``staging_contracts.backends`` entry-point group; it is turned into its
``MODULE:CLASS`` when pytest is configured, without importing anything (an unknown name, like
a malformed value, is a usage error). Importing happens when the plugin collects the kit's
tests: a backend that cannot be imported, or whose ``class`` statement the contract rejects,
is then reported once, as one collection error with the reason (and the class's explanation),
not by every test of the kit.
"""

from __future__ import annotations

import importlib
import re
import traceback
from dataclasses import dataclass
from typing import Final, cast

from ..backends import backend_ref
from ..contract.contract import Contract
from ..contract.enforcement import contract_roots
from ..contract.problems import ContractError
from ..mixin import STAGING_CONTRACT
from .decode_setup import DecodeFactory

__all__ = ["PATH_HINT", "BackendLoadError", "BackendTarget", "contract_of"]

_NAME: Final = r"[A-Za-z_][A-Za-z0-9_]*"
_REF: Final = rf"{_NAME}(?:\.{_NAME})*:{_NAME}(?:\.{_NAME})*"
_BACKEND_NAME: Final = r"[A-Za-z_][A-Za-z0-9_.-]*"
_SPEC_RE: Final = re.compile(
    rf"(?:(?P<cls>{_REF})|(?P<name>{_BACKEND_NAME}))(?:=(?P<factory>{_REF}))?"
)
_EXPECTED: Final = (
    "--staging-backend expects NAME, MODULE:CLASS or MODULE:CLASS=MODULE:FACTORY "
    "(e.g. nixl or mypkg.backend:MyKVManager)"
)

PATH_HINT: Final = (
    "pytest does not put the current directory on sys.path: run 'python -m pytest', or set "
    'pythonpath = ["."] (or ["src"]) under [tool.pytest.ini_options], or install the '
    "package"
)
"""Why a backend module found next to the tests may not import under ``pytest``."""


class BackendLoadError(Exception):
    """A named backend or factory cannot be loaded; the text says why and what to do."""


def contract_of(cls: type) -> Contract:
    """The contract ``cls`` is held to: its enforcing mixin's, else ``StagingHost``."""
    roots = contract_roots(cls)
    if roots:
        contract: Contract = roots[0].__dict__["contract"]
        return contract
    return STAGING_CONTRACT


@dataclass(frozen=True, slots=True)
class BackendTarget:
    """One ``--staging-backend`` value: a backend class and, optionally, a decode factory."""

    spec: str
    """The value as given."""
    class_ref: str
    """``MODULE:CLASS`` of the backend."""
    factory_ref: str | None = None
    """``MODULE:FUNCTION`` of a :data:`~staging_contracts.testing.DecodeFactory`, if given."""
    name: str | None = None
    """The backend's registry or entry-point name, when it was named so."""

    @classmethod
    def parse(cls, spec: str) -> BackendTarget:
        """Parse ``NAME``, ``MODULE:CLASS``, either optionally followed by ``=MODULE:FACTORY``.

        Raises:
            ValueError: the value has another shape, or names no known backend (the message
                shows the expected shape and the known names).
        """
        text = spec.strip()
        match = _SPEC_RE.fullmatch(text)
        if match is None:
            raise ValueError(f"{_EXPECTED}, got {spec!r}")
        name = match["name"]
        if name is None:
            return cls(text, match["cls"], match["factory"])
        try:
            ref = backend_ref(name)
        except ValueError as exc:
            raise ValueError(f"{_EXPECTED}: {exc}") from None
        return cls(text, ref, match["factory"], name)

    @property
    def class_name(self) -> str:
        """The class's own name (the last part of its qualified name)."""
        return self.class_ref.rpartition(".")[2].rpartition(":")[2]

    def load_class(self) -> type:
        """Import the backend class.

        Raises:
            BackendLoadError: the module does not import (a ``ContractError`` raised by a
                ``class`` statement included, with its message and the class's explanation),
                or the name is not a class.
        """
        obj = _load(self.class_ref, "backend")
        if not isinstance(obj, type):
            raise BackendLoadError(f"{self.class_ref}: {type(obj).__name__} is not a class")
        return obj

    def load_factory(self) -> DecodeFactory | None:
        """Import the decode factory, if one was named.

        Raises:
            BackendLoadError: it does not import or is not callable.
        """
        if self.factory_ref is None:
            return None
        obj = _load(self.factory_ref, "factory")
        if not callable(obj):
            raise BackendLoadError(f"{self.factory_ref}: {type(obj).__name__} is not callable")
        return cast(DecodeFactory, obj)


def _load(ref: str, what: str) -> object:
    module_name, _, qualname = ref.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except ContractError as exc:
        contract = contract_of(exc.cls)
        raise BackendLoadError(
            f"importing {module_name!r} failed: the contract rejected a class statement:\n"
            f"{exc}\n\n{contract.explain(exc.cls)}"
        ) from None
    except ImportError as exc:
        hint = ""
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if missing is not None and module_name.split(".")[0] == missing.split(".")[0]:
            hint = f" ({PATH_HINT})"
        raise BackendLoadError(
            f"cannot import the {what} module {module_name!r}: {exc}{hint}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any error of the module is reported, traced
        trace = "".join(traceback.format_exception(exc)).rstrip()
        raise BackendLoadError(
            f"importing the {what} module {module_name!r} raised {type(exc).__name__}: "
            f"{exc}\n\n{trace}"
        ) from None
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BackendLoadError(f"{module_name!r} has no attribute {qualname!r}") from None
    return obj
