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

**Backend specs.** Wherever a backend is chosen by text (``staging-contracts demo --backend``,
``bench transfer --backend``, ``soak --backend``, ``TransferConfig.backend``), the text is a
*spec*: a registry name (``nixl``, ``acme``), ``MODULE:CLASS``, or
``MODULE:CLASS=MODULE:FACTORY`` (the class part may also be a name). :func:`resolve_backend`
turns a spec into a :class:`BackendFactory` that builds one manager per call; a spec is a
plain string, so it travels to spawned rank processes, which resolve it again. Without a
factory the class is called with its standard constructor, ``Class(kv_args, role=...,
attn_tp_size=...)``; with one, the factory is called the same way and must return an
instance of the class. ``host`` (the address a rank binds and advertises) is passed as
``host=...`` only when the class or factory has a parameter named ``host``; one without it
builds managers that keep their own defaults (loopback for the in-tree backends).

May import: ``decode``, ``prefill``, ``mixin``, ``engines`` and everything below them;
never ``testing``, ``cluster``, ``bench`` or ``cli``.
Imported by: ``testing``, ``cluster``, ``bench``, ``cli`` and backends outside the package.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, cast

from ..engines import engine_available

if TYPE_CHECKING:
    from ..protocols import KVArgs
    from .common import Role
    from .staging_setup import StagingBackend

__all__ = [
    "BACKENDS",
    "ENTRY_POINT_GROUP",
    "SPEC_FORMS",
    "BackendFactory",
    "BackendSpec",
    "backend_names",
    "backend_ref",
    "load_backend",
    "process_local_reason",
    "resolve_backend",
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
    known = (
        f"{known} (no staging)" if (spec := BACKENDS.get(known)) and spec.engine is None else known
        for known in sorted(backend_names())
    )
    return ValueError(f"unknown backend {name!r}; known: {', '.join(known)}")


def _article(noun: str) -> str:
    return "an" if noun[:1].lower() in "aeiou" else "a"


def _a(obj: object) -> str:
    """``a Foo`` / ``an int``: the type of ``obj`` with its article."""
    name = type(obj).__name__
    return f"{_article(name)} {name}"


def _entry_label(entry: EntryPoint) -> str:
    return f"entry point {entry.name} = {entry.value} of group {ENTRY_POINT_GROUP!r}"


def _entry_ref(entry: EntryPoint) -> str:
    """The ``MODULE:CLASS`` an entry point names; ``ValueError`` for any other value."""
    value = entry.value.strip()
    module, colon, qualname = value.partition(":")
    if "=" in value or not colon or not module or not qualname or " " in value:
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
        raise _unknown(name)
    return _entry_ref(entry)


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
    spec = BACKENDS.get(name)
    if spec is None:
        entry = _entry_points().get(name)
        if entry is None:
            raise _unknown(name)
        logger.debug("loading backend %r from entry point %s", name, entry.value)
        ref = _entry_ref(entry)
        try:
            loaded = _import_ref(ref)
        except ValueError as exc:
            raise ValueError(f"{_entry_label(entry)}: {exc}") from None
        if not isinstance(loaded, type):
            raise ValueError(f"{_entry_label(entry)}: names {_a(loaded)}, not a class")
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
        from .common import Role  # noqa: PLC0415

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
        common_logger = logging.getLogger(f"{__name__}.common")
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
                f"backend {self.spec}: the factory returned {_a(made)}, not "
                f"{_article(wanted)} {wanted}"
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
    class_part, eq, factory_part = spec.partition("=")
    if not class_part or (eq and not factory_part):
        raise ValueError(f"backend spec {spec!r} is not one of {SPEC_FORMS}")
    if ":" in class_part:
        cls_obj = _import_ref(class_part)
        if not isinstance(cls_obj, type):
            raise ValueError(f"{class_part} is {_a(cls_obj)}, not a class")
        cls = cls_obj
    else:
        cls = load_backend(class_part)
    _check_backend_class(cls, class_part)
    build: Callable[..., object] = cls
    where = class_part
    if eq:
        if ":" not in factory_part:
            raise ValueError(f"factory {factory_part!r} of {spec!r} is not MODULE:FACTORY")
        factory = _import_ref(factory_part)
        if not callable(factory):
            raise ValueError(f"factory {factory_part} is {_a(factory)}, not callable")
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
        raise ValueError(f"backend {where} is {_a(backend)}, neither a class nor callable")
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


def _import_ref(ref: str) -> object:
    """The object ``MODULE:QUALNAME`` names; one-line ``ValueError`` when it cannot be had."""
    module_name, _, qualname = ref.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"{ref!r} is not MODULE:NAME")
    from ..contract.problems import ContractError  # noqa: PLC0415 - only for specs

    try:
        module = importlib.import_module(module_name)
    except ContractError as exc:
        problems = "; ".join(p.describe(instance=False) for p in exc.problems)
        raise ValueError(
            f"importing {module_name!r}: {exc.cls.__qualname__} does not satisfy the "
            f"{exc.contract_name} contract: {problems} (staging-contracts check {ref} explains)"
        ) from None
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any error of the imported module, in one line
        raise ValueError(f"importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    obj: object = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {qualname!r}") from None
    return obj


def _check_backend_class(cls: type, where: str) -> None:
    """Refuse a class that is not a conforming, non-abstract staging backend."""
    from ..contract.contract import is_abstract  # noqa: PLC0415 - only for specs
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
