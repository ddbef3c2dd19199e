"""The backend registry: in-tree names, entry points, and loading a backend class by name.

See the package's docstring (:mod:`staging_contracts.backends`) for the names and the
entry-point group; specs (``MODULE:CLASS[=MODULE:FACTORY]``) are resolved by ``_resolve``.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType
from typing import Final

from ..engines import engine_available
from ._refs import a_type, import_ref_text, split_ref

__all__ = [
    "BACKENDS",
    "ENTRY_POINT_GROUP",
    "BackendSpec",
    "backend_names",
    "backend_ref",
    "in_tree_name",
    "load_named",
    "unknown_backend",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP: Final = "staging_contracts.backends"
"""The entry-point group third-party backends register under (``NAME = "MODULE:CLASS"``)."""


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """Where a backend lives and which engine it needs."""

    module: str
    """Module that defines the backend class."""
    class_name: str
    """Name of the class in that module."""
    engine: str | None
    """Engine it constructs itself (``None``: given by the caller or none)."""
    extra: str | None
    """The pip extra that provides the engine."""


BACKENDS: Final = MappingProxyType(
    {
        "local": BackendSpec("staging_contracts.backends.local", "LocalKVManager", "local", None),
        "mooncake": BackendSpec(
            "staging_contracts.backends.mooncake", "MooncakeKVManager", "mooncake", "mooncake"
        ),
        "nixl": BackendSpec("staging_contracts.backends.nixl", "NixlKVManager", "nixl", "nixl"),
        "ascend": BackendSpec(
            "staging_contracts.backends.ascend", "AscendKVManager", "mooncake", "mooncake"
        ),
        "mori": BackendSpec("staging_contracts.backends.mori", "MoriKVManager", None, None),
    }
)
"""Backend name -> where it lives."""


def _entry_points() -> dict[str, EntryPoint]:
    return {entry.name: entry for entry in entry_points(group=ENTRY_POINT_GROUP)}


def unknown_backend(name: str) -> ValueError:
    """The error for a name that is neither in-tree nor registered (lists the known ones)."""
    known = (
        f"{known} (no staging)" if (spec := BACKENDS.get(known)) and spec.engine is None else known
        for known in sorted(backend_names())
    )
    return ValueError(f"unknown backend {name!r}; known: {', '.join(known)}")


def _entry_label(entry: EntryPoint) -> str:
    return f"entry point {entry.name} = {entry.value} of group {ENTRY_POINT_GROUP!r}"


def _entry_ref(entry: EntryPoint) -> str:
    """The ``MODULE:CLASS`` an entry point names; ``ValueError`` for any other value."""
    value = entry.value.strip()
    if "=" in value or split_ref(value) is None or " " in value:
        raise ValueError(
            f"{_entry_label(entry)}: the value must be MODULE:CLASS (a factory cannot be "
            f"registered; give it in the spec instead: {entry.name}=MODULE:FACTORY)"
        )
    return value


def backend_names() -> tuple[str, ...]:
    """Every backend name: the in-tree ones, then the registered entry points (sorted).

    **Thread:** any. Reads installed packages' metadata; imports nothing.
    """
    registered = sorted(name for name in _entry_points() if name not in BACKENDS)
    return (*BACKENDS, *registered)


def backend_ref(name: str) -> str:
    """``MODULE:CLASS`` of the backend called ``name`` (in-tree, else an entry point).

    Imports nothing.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    spec = BACKENDS.get(name)
    if spec is not None:
        return f"{spec.module}:{spec.class_name}"
    entry = _entry_points().get(name)
    if entry is None:
        raise unknown_backend(name)
    return _entry_ref(entry)


def load_named(name: str) -> type:
    """Import and return the backend class called ``name`` (in-tree, else an entry point);
    what :func:`load_backend` does for a name that is not a spec.

    **Thread:** any; imports modules.

    Raises:
        ValueError: as :func:`load_backend`, for a name.
        ImportError: an in-tree backend's engine cannot be imported (names the extra).
    """
    spec = BACKENDS.get(name)
    if spec is None:
        entry = _entry_points().get(name)
        if entry is None:
            raise unknown_backend(name)
        logger.debug("loading backend %r from entry point %s", name, entry.value)
        ref = _entry_ref(entry)
        try:
            loaded = import_ref_text(ref)
        except ValueError as exc:
            raise ValueError(f"{_entry_label(entry)}: {exc}") from None
        if not isinstance(loaded, type):
            raise ValueError(f"{_entry_label(entry)}: names {a_type(loaded)}, not a class")
        return loaded
    if spec.engine is not None:
        available, reason = engine_available(spec.engine)
        if not available:
            command = f"pip install 'staging-contracts[{spec.extra}]'"
            if command not in reason:  # name the command once, whoever said why
                reason = f"{reason}; install it with {command}"
            raise ImportError(f"backend {name!r}: {reason}", name=spec.module)
    module = importlib.import_module(spec.module)
    backend: type = getattr(module, spec.class_name)
    return backend


def in_tree_name(cls: type) -> str | None:
    """The registry name of ``cls`` when it is an in-tree backend class, else ``None``."""
    for name, spec in BACKENDS.items():
        if cls.__module__ == spec.module and cls.__qualname__ == spec.class_name:
            return name
    return None
