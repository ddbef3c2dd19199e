"""The transfer engines behind :class:`~staging_contracts.protocols.TransferEngine`, by name.

Engines load lazily: importing this package imports no engine SDK. ``load_engine_class``
imports an engine's module on first use; a missing optional dependency raises an
``ImportError`` that names the engine and the extra to install.

- ``"local"``: :class:`~staging_contracts.engines.local.LocalEngine`, same-process copies;
  needs nothing.
- ``"mooncake"``: :class:`~staging_contracts.engines.mooncake.MooncakeEngine`;
  ``pip install 'staging-contracts[mooncake]'``.
- ``"nixl"``: :class:`~staging_contracts.engines.nixl.NixlEngine`;
  ``pip install 'staging-contracts[nixl]'``.

May import: ``protocols`` and ``stats`` only (a new engine is one module of this package).
Imported by: ``backends`` and ``_bench``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Literal, overload

if TYPE_CHECKING:
    from ..protocols import TransferEngine
    from .local import LocalEngine
    from .mooncake import MooncakeEngine
    from .nixl import NixlEngine

__all__ = ["ENGINES", "EngineSpec", "engine_available", "load_engine_class"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Where an engine lives and what it needs."""

    module: str
    """Absolute module path of the engine's implementation."""
    class_name: str
    """Name of the engine class in that module."""
    extra: str | None
    """The ``staging-contracts`` pip extra that installs its SDK (``None``: built in)."""

    @property
    def install_hint(self) -> str:
        """The pip command that installs the SDK (empty for a built-in engine)."""
        return f"pip install 'staging-contracts[{self.extra}]'" if self.extra else ""


ENGINES: Final[Mapping[str, EngineSpec]] = MappingProxyType(
    {
        "local": EngineSpec(f"{__name__}.local", "LocalEngine", None),
        "mooncake": EngineSpec(f"{__name__}.mooncake", "MooncakeEngine", "mooncake"),
        "nixl": EngineSpec(f"{__name__}.nixl", "NixlEngine", "nixl"),
    }
)
"""Every engine by name (read-only)."""


def _spec(name: str) -> EngineSpec:
    try:
        return ENGINES[name]
    except KeyError:
        known = ", ".join(repr(known) for known in sorted(ENGINES))
        raise ValueError(f"unknown transfer engine {name!r}; known engines: {known}") from None


@overload
def load_engine_class(name: Literal["local"]) -> type[LocalEngine]: ...
@overload
def load_engine_class(name: Literal["mooncake"]) -> type[MooncakeEngine]: ...
@overload
def load_engine_class(name: Literal["nixl"]) -> type[NixlEngine]: ...
@overload
def load_engine_class(name: str) -> Callable[..., TransferEngine]: ...
def load_engine_class(name: str) -> Callable[..., TransferEngine]:
    """Import and return the class of the engine ``name``.

    **Called by:** any thread (imports are serialized by Python's import lock).
    **Blocking:** for the import of the engine's SDK on first use (up to a second or two).

    Returns:
        The class; each takes its own constructor options (see its docstring).

    Raises:
        ValueError: ``name`` is not in :data:`ENGINES` (the text lists the known names).
        ImportError: the engine's SDK is not installed or fails to load; the text names the
            engine and the pip extra, and the original error is chained.
    """
    spec = _spec(name)
    try:
        module = importlib.import_module(spec.module)
    except ImportError as exc:
        hint = f"; install it with {spec.install_hint}" if spec.extra else ""
        raise ImportError(
            f"transfer engine {name!r} is not available ({exc}){hint}", name=spec.module
        ) from exc
    cls: Callable[..., TransferEngine] = getattr(module, spec.class_name)
    return cls


def engine_available(name: str) -> tuple[bool, str]:
    """Can engine ``name`` be loaded here? ``(True, "")``, or ``(False, reason)``.

    Imports the engine's SDK (see :func:`load_engine_class`); meant for ``skipif`` marks.

    Raises:
        ValueError: ``name`` is not in :data:`ENGINES`.
    """
    try:
        load_engine_class(name)
    except ImportError as exc:
        logger.debug("transfer engine %r unavailable: %s", name, exc)
        return False, str(exc)
    return True, ""
