"""KV-transfer backends, loaded lazily by name.

===========  ===============================================  ==========================
name         class                                            needs
===========  ===============================================  ==========================
``local``    :class:`~.local.LocalKVManager`                  nothing (one process)
``mooncake`` :class:`~.mooncake.MooncakeKVManager`            the ``mooncake`` extra
``nixl``     :class:`~.nixl.NixlKVManager`                    the ``nixl`` extra
``ascend``   :class:`~.ascend.AscendKVManager`                the ``mooncake`` extra
``mori``     :class:`~.mori.MoriKVManager` (no staging)       nothing
===========  ===============================================  ==========================

Importing this package imports no engine SDK; :func:`load_backend` imports a backend's
module on first use and checks that its engine can be imported, raising an ``ImportError``
that names the backend and the extra to install otherwise.

Backends outside the package register under the entry-point group
``staging_contracts.backends`` (:data:`ENTRY_POINT_GROUP`), one ``NAME = "MODULE:CLASS"`` per
backend, in their ``pyproject.toml``::

    [project.entry-points."staging_contracts.backends"]
    acme = "acme_kv.backend:AcmeKVManager"

:func:`backend_names` lists both kinds, :func:`backend_ref` turns a name into
``MODULE:CLASS`` without importing anything, and :func:`load_backend` loads either kind (an
in-tree name wins over an entry point of the same name).

May import: ``decode``, ``prefill``, ``mixin``, ``engines`` and everything below them;
never ``testing``, ``cluster``, ``bench`` or ``cli``.
Imported by: ``testing``, ``cluster``, ``bench``, ``cli`` and backends outside the package.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType
from typing import Final

from ..engines import engine_available

__all__ = [
    "BACKENDS",
    "ENTRY_POINT_GROUP",
    "BackendSpec",
    "backend_names",
    "backend_ref",
    "load_backend",
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


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown backend {name!r}; known: {', '.join(sorted(backend_names()))}")


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
        raise _unknown(name)
    return entry.value


def load_backend(name: str) -> type:
    """Import and return the backend class called ``name`` (in-tree, else an entry point).

    Raises:
        ValueError: unknown name (the message lists the known ones), or an entry point that
            does not name a class.
        ImportError: its engine cannot be imported; the message names the extra to install.
            For an entry point, whatever importing its module raises.
    """
    spec = BACKENDS.get(name)
    if spec is None:
        entry = _entry_points().get(name)
        if entry is None:
            raise _unknown(name)
        logger.debug("loading backend %r from entry point %s", name, entry.value)
        loaded: object = entry.load()
        if not isinstance(loaded, type):
            raise ValueError(
                f"entry point {name!r} of {ENTRY_POINT_GROUP!r} names {entry.value}, "
                f"a {type(loaded).__name__}, not a class"
            )
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
