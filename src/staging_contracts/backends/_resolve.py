"""Backend specs resolved: :func:`resolve_backend` and the :class:`BackendFactory` it returns.

The spec's text is split and its modules imported by ``_refs``; names are looked up in
``_registry``. See the package's docstring (:mod:`staging_contracts.backends`) for the forms.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, cast

from ._refs import a_type, article, import_ref_text, split_spec
from ._registry import BACKENDS, load_named

if TYPE_CHECKING:
    from ..protocols import KVArgs
    from ._common import Role
    from ._staging_setup import StagingBackend

__all__ = [
    "SPEC_FORMS",
    "BackendFactory",
    "load_backend",
    "process_local_reason",
    "resolve_backend",
]

logger = logging.getLogger(__name__)


def load_backend(name: str) -> type:
    """Import and return the backend class called ``name`` (in-tree, else an entry point),
    or the class of a spec (``MODULE:CLASS[=MODULE:FACTORY]``, see :func:`resolve_backend`).

    **Thread:** any; imports modules.

    Raises:
        ValueError: unknown name (the message lists the known ones), an entry point whose
            value is not ``MODULE:CLASS``, whose module cannot be imported (or raises while
            importing) or that does not name a class (each message starts ``entry point
            NAME = VALUE of group ...``), or a spec :func:`resolve_backend` refuses.
        ImportError: an in-tree backend's engine cannot be imported; the message names the
            extra to install.
    """
    if ":" in name or "=" in name:
        return resolve_backend(name).backend_class
    return load_named(name)


SPEC_FORMS: Final = "NAME, MODULE:CLASS or MODULE:CLASS=MODULE:FACTORY"
"""The forms of a backend spec, for messages."""


@dataclass(frozen=True, slots=True)
class BackendFactory:
    """A backend spec resolved: the class, and the callable that builds its managers.

    Built by :func:`resolve_backend`. Another process is given the :attr:`spec` string (as
    ``TransferConfig.backend`` carries it to the rank processes) and resolves it there, so
    that its own imports and checks run in that process.
    """

    spec: str
    """The spec it was resolved from."""
    backend_class: type
    """The backend class (a non-abstract ``StagingManagerMixin`` subclass)."""
    build: Callable[..., object]
    """The class itself, or the spec's factory."""
    takes_host: bool
    """``build`` has a parameter named ``host``: it is given the rank's address."""
    engine_name: str | None = None
    """The engine of an in-tree backend named by the spec (``None``: not known without
    building a manager)."""
    _verdict: list[str | None] = field(default_factory=list, compare=False, repr=False)
    """The cached :attr:`process_local_reason` (empty until asked)."""

    @property
    def process_local_reason(self) -> str | None:
        """Why the backend's managers cannot reach a peer in another process, else ``None``.

        Decided by :func:`process_local_reason` on the engine, the same function the
        transfer harness applies to each rank's manager. An in-tree backend's engine is known
        by name; for any other backend one manager is built here (decode, TP 1, a one-page
        KV layout, on loopback), its engine judged, and the manager closed, once per
        factory. A manager that cannot be built gives ``None`` (undecided): the ranks then
        report their own error.

        **Thread:** any; may build and close one manager (a listener socket, an engine).
        """
        if not self._verdict:
            self._verdict.append(self._decide())
        return self._verdict[0]

    @property
    def process_local(self) -> bool:
        """The backend's engine moves bytes within one process only (``LocalEngine``, or an
        engine class with ``process_local = True``): its ranks cannot live in separate
        processes. See :attr:`process_local_reason`."""
        return self.process_local_reason is not None

    def _decide(self) -> str | None:
        if self.engine_name is not None:
            if self.engine_name == "local":
                return _process_local_text("LocalEngine")
            return None
        from ..protocols import KVArgsRecord  # noqa: PLC0415 - only for the probe
        from ._common import Role  # noqa: PLC0415

        kv_args = KVArgsRecord(
            page_size=1,
            kv_item_lens=(1,),
            engine_rank=0,
            device="cpu",
            total_kv_head_num=1,
            kv_head_num=1,
            kv_layer_ids=(0,),
        )
        quiet = _ThreadFilter()
        common_logger = logging.getLogger(Role.__module__)
        common_logger.addFilter(quiet)  # the probe's own notes (no cluster secret) are not news
        try:
            probe: object = self(kv_args, role=Role.DECODE, attn_tp_size=1)
        except Exception as exc:  # noqa: BLE001 - undecided; the ranks report it themselves
            logger.debug(
                "%s: probe manager not built (%s): process-locality undecided", self.spec, exc
            )
            return None
        finally:
            common_logger.removeFilter(quiet)
        try:
            return process_local_reason(getattr(probe, "engine", None))
        finally:
            close = getattr(probe, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as exc:  # noqa: BLE001 - the verdict stands; say so
                    logger.warning("%s: closing the probe manager raised %r", self.spec, exc)

    def __call__(
        self, kv_args: KVArgs, *, role: Role, attn_tp_size: int, host: str | None = None
    ) -> StagingBackend:
        """Build one unstarted manager for rank ``kv_args.engine_rank`` of side ``role``.

        **Thread:** any (the rank's main thread in the cluster). ``host`` is passed on only
        when :attr:`takes_host`; otherwise the manager keeps its own default address.

        Raises:
            TypeError: the factory returned something that is not a :attr:`backend_class`.
            Exception: whatever the constructor or factory raised.
        """
        options: dict[str, Any] = {}
        if host is not None and self.takes_host:
            options["host"] = host
        made = self.build(kv_args, role=role, attn_tp_size=attn_tp_size, **options)
        if not isinstance(made, self.backend_class):
            close = getattr(made, "close", None)
            if callable(close):
                close()
            wanted = self.backend_class.__name__
            raise TypeError(
                f"backend {self.spec}: the factory returned {a_type(made)}, not "
                f"{article(wanted)} {wanted}"
            )
        return cast("StagingBackend", made)  # a staging host: its class passed the contract


class _ThreadFilter(logging.Filter):
    """Drops the records of the thread that created it (the probe's, while it builds)."""

    def __init__(self) -> None:
        super().__init__()
        self._thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self._thread


def _process_local_text(engine: str) -> str:
    return (
        f"its engine {engine} moves bytes within one process only; give the harness a "
        "factory over an engine that crosses processes (NIXL, Mooncake), or run it with "
        "processes=False"
    )


def process_local_reason(engine: object) -> str | None:
    """Why ``engine`` cannot reach a peer in another process, or ``None`` if it can.

    The one place this is decided: :attr:`BackendFactory.process_local` (and so the
    command line's refusal) and the transfer harness (``processes=True``) both call it. An
    engine is in-process only when it is a
    :class:`~staging_contracts.engines.local.LocalEngine` or its class sets
    ``process_local = True``.
    """
    from ..engines.local import LocalEngine  # noqa: PLC0415 - no SDK; lazily like the rest

    if isinstance(engine, LocalEngine) or getattr(type(engine), "process_local", False) is True:
        return _process_local_text(type(engine).__name__)
    return None


def resolve_backend(spec: str | type | Callable[..., object]) -> BackendFactory:
    """Resolve a backend spec (:data:`SPEC_FORMS`), class or factory to the factory of its
    managers.

    Checks everything that can be checked without building a manager: the modules import,
    the class exists, is a non-abstract ``StagingManagerMixin`` subclass that satisfies the
    ``StagingHost`` contract, the factory (if any) is callable, and the class or factory
    takes the standard arguments ``(kv_args, *, role, attn_tp_size)``. A class is checked as
    ``MODULE:CLASS`` is; a callable as a spec's factory is (what it returns is checked at each
    call: a ``StagingManagerMixin`` instance, or of the class its return annotation names).

    **Thread:** any. Imports the spec's modules (and an in-tree backend's engine).

    Raises:
        ValueError: one line saying what is wrong with the spec: an unknown name, a module
            that cannot be imported (or raised while importing), a missing attribute, a class
            that is not a conforming staging backend, a factory that is not callable, or a
            signature that does not take the standard arguments.
        ImportError: an in-tree backend's engine cannot be imported (names the extra).
    """
    if not isinstance(spec, str):
        return _resolve_object(spec)
    parts = split_spec(spec)
    class_part, eq, factory_part = parts.backend, parts.factory is not None, parts.factory or ""
    if not class_part or (eq and not factory_part):
        raise ValueError(f"backend spec {spec!r} is not one of {SPEC_FORMS}")
    if parts.names_class:
        cls_obj = import_ref_text(class_part)
        if not isinstance(cls_obj, type):
            raise ValueError(f"{class_part} is {a_type(cls_obj)}, not a class")
        cls = cls_obj
    else:
        cls = load_backend(class_part)
    _check_backend_class(cls, class_part)
    build: Callable[..., object] = cls
    where = class_part
    if eq:
        if ":" not in factory_part:
            raise ValueError(f"factory {factory_part!r} of {spec!r} is not MODULE:FACTORY")
        factory = import_ref_text(factory_part)
        if not callable(factory):
            raise ValueError(f"factory {factory_part} is {a_type(factory)}, not callable")
        build = factory
        where = factory_part
    takes_host = _check_signature(build, where)
    in_tree = BACKENDS.get(class_part)
    engine = in_tree.engine if in_tree is not None and not eq else None
    return BackendFactory(spec, cls, build, takes_host, engine)


def _resolve_object(backend: type | Callable[..., object]) -> BackendFactory:
    """:func:`resolve_backend` for a class or a callable given as an object."""
    from ..mixin import StagingManagerMixin  # noqa: PLC0415 - only for specs

    module = getattr(backend, "__module__", None)
    qualname = getattr(backend, "__qualname__", None)
    where = f"{module}.{qualname}" if module and qualname else repr(backend)
    if isinstance(backend, type):
        _check_backend_class(backend, where)
        takes_host = _check_signature(backend, where)
        return BackendFactory(where, backend, backend, takes_host)
    if not callable(backend):
        raise ValueError(f"backend {where} is {a_type(backend)}, neither a class nor callable")
    takes_host = _check_signature(backend, where)
    returns: object = None
    try:
        returns = inspect.signature(backend, eval_str=True).return_annotation
    except Exception:  # noqa: BLE001 - an annotation that does not evaluate names no class
        logger.debug("%s: return annotation not evaluated; any staging backend will do", where)
    cls = (
        returns
        if isinstance(returns, type) and issubclass(returns, StagingManagerMixin)
        else StagingManagerMixin
    )
    return BackendFactory(where, cls, backend, takes_host)


def _check_signature(build: Callable[..., object], where: str) -> bool:
    """Refuse a class or factory that cannot be called with the standard arguments; whether
    it takes ``host``."""
    try:
        signature = inspect.signature(build)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the signature of {where} cannot be read ({exc})") from None
    try:
        signature.bind(None, role=None, attn_tp_size=1)
    except TypeError as exc:
        raise ValueError(
            f"{where} cannot be called as (kv_args, *, role=..., attn_tp_size=...): {exc}"
        ) from None
    host = signature.parameters.get("host")
    return host is not None and host.kind in (host.POSITIONAL_OR_KEYWORD, host.KEYWORD_ONLY)


def _check_backend_class(cls: type, where: str) -> None:
    """Refuse a class that is not a conforming, non-abstract staging backend."""
    from .._contract.contract import is_abstract  # noqa: PLC0415 - only for specs
    from ..mixin import STAGING_CONTRACT, StagingManagerMixin  # noqa: PLC0415

    if not issubclass(cls, StagingManagerMixin):
        raise ValueError(
            f"{where}: {cls.__qualname__} is not a staging backend (StagingManagerMixin is not "
            "among its bases)"
        )
    if is_abstract(cls):
        raise ValueError(
            f"{where}: {cls.__qualname__} is declared abstract=True (an intermediate base); "
            "name a concrete subclass"
        )
    report = STAGING_CONTRACT.inspect_class(cls)
    if not report.conforms:
        problems = "; ".join(p.describe(instance=False) for p in report.problems)
        raise ValueError(
            f"{where}: {cls.__qualname__} does not satisfy the StagingHost contract: {problems}"
        )
