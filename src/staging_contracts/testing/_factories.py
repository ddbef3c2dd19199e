"""Managers without hand-written factories: the standard constructor, and the in-tree backends.

The kit and the harness build a backend's managers with its *standard constructor*,
``Class(kv_args, role=..., attn_tp_size=...)``, when the author gave no factory.
:func:`standard_factory` checks, before anything is built, that the constructor takes those
arguments; for the project's own backends it also checks that the engine can be imported and
passes the options a single host needs (Mooncake and Ascend over TCP, NIXL without its
InfiniBand modules). When it cannot, it raises :class:`FactoryUnavailable`, whose text says
exactly why, for the kit to skip with.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, cast

from .._contract.typeforms import class_label
from ..backends import BACKENDS
from ..backends._common import Role
from ..backends._registry import in_tree_name
from ..engines import engine_available
from ..protocols import KVArgs
from ._harness import ManagerFactory, TransferManager

IN_TREE_OPTIONS: Final[Mapping[str, Mapping[str, object]]] = MappingProxyType(
    {
        "mooncake": MappingProxyType({"protocol": "tcp"}),
        "ascend": MappingProxyType({"protocol": "tcp"}),
        "nixl": MappingProxyType({"load_ib_modules": False}),
    }
)
"""Constructor options of the in-tree backends on one host with no NIC or NPU, by name."""


class FactoryUnavailable(Exception):
    """The standard constructor cannot build the backend here; the text says why."""


class EngineUnavailable(FactoryUnavailable):
    """An in-tree backend whose engine cannot be imported here (a missing extra): the
    backend is fine, this machine lacks its SDK, so the kit skips rather than fails."""


@dataclass(frozen=True, slots=True, repr=False)
class StandardFactory:
    """A :class:`~staging_contracts.testing.ManagerFactory` calling a class's constructor.

    Attributes:
        cls: the backend class.
        options: extra keyword arguments (the in-tree backends' single-host options).
    """

    cls: type
    options: Mapping[str, object]

    def __call__(self, kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> TransferManager:
        """``cls(kv_args, role=role, attn_tp_size=attn_tp_size, **options)``."""
        made = self.cls(kv_args, role=role, attn_tp_size=attn_tp_size, **self.options)
        return cast(TransferManager, made)

    def __repr__(self) -> str:
        return f"{self.cls.__module__}.{self.describe()}"

    def describe(self) -> str:
        """The call, as text: ``Class(kv_args, role=..., attn_tp_size=..., protocol='tcp')``."""
        extra = "".join(f", {key}={value!r}" for key, value in self.options.items())
        return f"{class_label(self.cls)}(kv_args, role=..., attn_tp_size=...{extra})"


def standard_factory(cls: type) -> ManagerFactory:
    """A factory that builds ``cls`` with its standard constructor, checked before use.

    **Thread:** any. Imports nothing but an in-tree backend's engine (to check it loads).

    Raises:
        FactoryUnavailable: the constructor does not take ``(kv_args, *, role,
            attn_tp_size)`` with everything else defaulted, or (:class:`EngineUnavailable`)
            ``cls`` is an in-tree backend whose engine cannot be imported here (the text
            names the extra to install).
    """
    name = in_tree_name(cls)
    options: Mapping[str, object] = IN_TREE_OPTIONS.get(name, {}) if name else {}
    factory = StandardFactory(cls, options)
    if name is not None:
        engine = BACKENDS[name].engine
        if engine is None:
            raise FactoryUnavailable(f"backend {name!r} ({class_label(cls)}) has no engine")
        available, reason = engine_available(engine)
        if not available:
            raise EngineUnavailable(f"backend {name!r} cannot run here: {reason}")
    signature = read_signature(cls, class_label(cls), FactoryUnavailable)
    try:
        signature.bind(None, role=Role.DECODE, attn_tp_size=1, **options)
    except TypeError as exc:
        raise FactoryUnavailable(
            f"its standard constructor {factory.describe()} does not fit "
            f"{class_label(cls)}({_parameters(signature)}): {exc}"
        ) from None
    return factory


def read_signature(
    obj: Callable[..., object], what: str, error: type[Exception]
) -> inspect.Signature:
    """The signature of ``obj`` (``what`` in the message); ``error`` when it cannot be read."""
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError) as exc:
        raise error(f"the signature of {what} cannot be read ({exc})") from None


def _parameters(signature: inspect.Signature) -> str:
    """The parameters as a reader writes them: names, ``*``, ``=...`` for defaults."""
    out: list[str] = []
    star = False
    for param in signature.parameters.values():
        if param.kind is param.KEYWORD_ONLY and not star:
            out.append("*")
        star = star or param.kind in (param.KEYWORD_ONLY, param.VAR_POSITIONAL)
        bare = param.replace(annotation=param.empty, default=param.empty)  # *args, **kwargs
        out.append(f"{bare}{'=...' if param.default is not param.empty else ''}")
    return ", ".join(out)
