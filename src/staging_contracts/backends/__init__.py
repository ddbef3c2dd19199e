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

May import: ``decode``, ``prefill``, ``mixin``, ``engines`` and everything below them;
never ``testing``, ``cluster``, ``bench`` or ``cli``.
Imported by: ``testing``, ``cluster``, ``bench``, ``cli`` and backends outside the package.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from ..engines import engine_available

__all__ = ["BACKENDS", "BackendSpec", "load_backend"]


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


def load_backend(name: str) -> type:
    """Import and return the backend class called ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
        ImportError: its engine cannot be imported; the message names the extra to install.
    """
    spec = BACKENDS.get(name)
    if spec is None:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    if spec.engine is not None:
        available, reason = engine_available(spec.engine)
        if not available:
            raise ImportError(
                f"backend {name!r} needs the {spec.engine!r} engine, which cannot be imported "
                f"({reason}); install it with pip install 'staging-contracts[{spec.extra}]'",
                name=spec.module,
            )
    module = importlib.import_module(spec.module)
    backend: type = getattr(module, spec.class_name)
    return backend
