"""Backends named on the command line: ``MODULE:CLASS`` or ``MODULE:CLASS=MODULE:FACTORY``.

Parsing happens when pytest is configured (a bad name is a usage error); importing happens in
the kit's tests, so that a backend whose ``class`` statement the contract rejects is reported
by the tests, with the contract's message, and not as a crash of pytest.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Final, cast

from ..contract.contract import Contract
from ..contract.enforcement import contract_roots
from ..contract.problems import ContractError
from ..mixin import STAGING_CONTRACT
from .decode_setup import DecodeFactory

__all__ = ["BackendLoadError", "BackendTarget", "contract_of"]

_NAME: Final = r"[A-Za-z_][A-Za-z0-9_]*"
_REF: Final = rf"{_NAME}(?:\.{_NAME})*:{_NAME}(?:\.{_NAME})*"
_SPEC_RE: Final = re.compile(rf"(?P<cls>{_REF})(?:=(?P<factory>{_REF}))?")


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

    @classmethod
    def parse(cls, spec: str) -> BackendTarget:
        """Parse ``MODULE:CLASS`` or ``MODULE:CLASS=MODULE:FACTORY``.

        Raises:
            ValueError: the value has another shape (the message shows the expected one).
        """
        text = spec.strip()
        match = _SPEC_RE.fullmatch(text)
        if match is None:
            raise ValueError(
                f"--staging-backend expects MODULE:CLASS or MODULE:CLASS=MODULE:FACTORY "
                f"(e.g. mypkg.backend:MyKVManager), got {spec!r}"
            )
        return cls(text, match["cls"], match["factory"])

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
        raise BackendLoadError(f"cannot import the {what} module {module_name!r}: {exc}") from exc
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BackendLoadError(f"{module_name!r} has no attribute {qualname!r}") from None
    return obj
