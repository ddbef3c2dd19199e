"""Backends named on the command line: ``NAME``, ``MODULE:CLASS``, either with ``=MODULE:FACTORY``.

A ``NAME`` (in-tree or registered under ``staging_contracts.backends``) becomes its
``MODULE:CLASS`` when pytest is configured, importing nothing; importing happens when the
plugin collects the kit's tests, and a failure is one collection error with the reason (see
``docs/writing-a-backend.md``, "Without a test file").
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, cast

from .._contract.contract import Contract
from .._contract.enforcement import contract_roots
from ..backends import BACKENDS, ENTRY_POINT_GROUP, BackendFactory, backend_ref
from ..backends._refs import (
    AttributeMissing,
    ModuleMissing,
    ModuleRaised,
    ModuleRejected,
    Ref,
    import_ref,
    split_ref,
    split_spec,
)
from ..mixin import STAGING_CONTRACT
from ._factories import read_signature
from ._harness import ManagerFactory

HostFactory = Callable[[], object]
"""``FACTORY()``: builds managers the host's own way; returns one, or an iterable of them."""

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
    """One ``--staging-backend`` value: a backend class and, optionally, a manager factory."""

    spec: str
    """The value as given."""
    class_ref: str
    """``MODULE:CLASS`` of the backend."""
    factory_ref: str | None = None
    """``MODULE:FUNCTION`` of a manager factory, ``FACTORY(kv_args, *, role, attn_tp_size)``
    (a :class:`~staging_contracts.testing.ManagerFactory`, as ``demo --backend`` and
    :func:`~staging_contracts.testing.run_transfer` take it), if given."""
    name: str | None = None
    """The backend's registry or entry-point name, when it was named so."""

    @classmethod
    def parse(cls, spec: str) -> BackendTarget:
        """Parse ``NAME``, ``MODULE:CLASS``, either optionally followed by ``=MODULE:FACTORY``.

        Raises:
            ValueError: the value has another shape, or names no known backend (the message
                shows the expected shape and the known names).
        """
        parts = split_spec(spec.strip())
        if not parts.strict:
            raise ValueError(f"{_EXPECTED}, got {spec!r}")
        if parts.names_class:
            return cls(parts.text, parts.backend, parts.factory)
        try:
            ref = backend_ref(parts.backend)
        except ValueError as exc:
            raise ValueError(f"{_EXPECTED}: {exc}") from None
        return cls(parts.text, ref, parts.factory, parts.backend)

    @property
    def class_name(self) -> str:
        """The class's own name (the last part of its qualified name)."""
        return self.class_qualname.rpartition(".")[2]

    @property
    def class_qualname(self) -> str:
        """The class's qualified name in its module (all of :attr:`class_ref` without a
        colon)."""
        ref = split_ref(self.class_ref)
        return self.class_ref if ref is None else ref.qualname

    @property
    def registered(self) -> bool:
        """Named by an entry point (a name that is not in-tree)."""
        return self.name is not None and self.name not in BACKENDS

    def load_class(self) -> type:
        """Import the backend class.

        Raises:
            BackendLoadError: the module does not import (a ``ContractError`` raised by a
                ``class`` statement included, with its message and the class's explanation),
                or the name is not a class. For a registered name, the message starts
                ``entry point NAME = MODULE:CLASS of group ...``.
        """
        try:
            obj = _load(self.class_ref, "backend", path_hint=not self.registered)
        except BackendLoadError as exc:
            if self.registered:
                raise BackendLoadError(
                    f"entry point {self.name} = {self.class_ref} of group "
                    f"{ENTRY_POINT_GROUP!r}: {exc}"
                ) from None
            raise
        if not isinstance(obj, type):
            raise BackendLoadError(f"{self.class_ref}: {type(obj).__name__} is not a class")
        return obj

    def load_factory(self) -> ManagerFactory | None:
        """Import the manager factory, if one was named, checked before it is called.

        The factory of ``--staging-backend MODULE:CLASS=MODULE:FACTORY`` is one of two kinds:

        * a **manager factory**, ``FACTORY(kv_args, *, role=..., attn_tp_size=...)``, that
          builds one unstarted manager of either role, like the standard constructor of our
          staging backends: the kit builds its decode manager with it (and starts it with
          :meth:`DecodeSetup.start`), and the transfer checks build every rank with it;
        * a **host factory**, ``FACTORY()``, that builds managers the host's own way (a
          serving stack's constructor, its own arguments) and returns one, or an iterable of
          them (a factory that can be called with no argument is one, whatever else it
          takes): the kit runs the instance check of their contract on each
          (:meth:`load_host_factory`); this returns ``None`` for it.

        What a manager factory returns is checked to be an instance of the backend class.

        Raises:
            BackendLoadError: it does not import, is not callable, or takes neither kind's
                arguments (say, a decode factory ``FACTORY(setup)``: the message says which
                kinds are expected and which was given).
        """
        obj = self._factory("manager")
        if obj is None:
            return None
        cls = self.load_class()
        return cast(ManagerFactory, BackendFactory(self.spec, cls, obj, takes_host=False))

    def load_host_factory(self) -> HostFactory | None:
        """Import the host factory, ``FACTORY()``, if the named factory is one (see
        :meth:`load_factory`); ``None`` otherwise.

        Raises:
            BackendLoadError: as :meth:`load_factory`.
        """
        return self._factory("host")

    def _factory(self, kind: str) -> Callable[..., object] | None:
        """The named factory when it is of ``kind`` (``"manager"`` or ``"host"``), else
        ``None``."""
        if self.factory_ref is None:
            return None
        obj = _load(self.factory_ref, "factory", path_hint=True)
        if not callable(obj):
            raise BackendLoadError(f"{self.factory_ref}: {type(obj).__name__} is not callable")
        what = f"the factory {self.factory_ref}"
        signature = read_signature(obj, what, BackendLoadError)
        # a factory callable with no argument is a host factory, even when it would also
        # take a manager factory's (FACTORY(*args, **kwargs), FACTORY(variant="a")): a
        # manager factory cannot build a manager without its kv_args
        try:
            signature.bind()
        except TypeError:
            pass
        else:
            return obj if kind == "host" else None
        try:
            signature.bind(None, role=None, attn_tp_size=1)
        except TypeError as exc:
            problem = str(exc)
        else:
            return obj if kind == "manager" else None
        raise BackendLoadError(
            f"the factory {self.factory_ref}{signature} takes the arguments of neither kind "
            "of factory: --staging-backend MODULE:CLASS=MODULE:FACTORY (like demo --backend "
            "and run_transfer) calls a manager factory FACTORY(kv_args, *, role=..., "
            f"attn_tp_size=...) for a new, unstarted manager of either role ({problem}), or "
            "a host factory FACTORY() that builds managers the host's own way and returns one "
            "or an iterable of them. A decode factory FACTORY(setup) is a "
            "make_decode_manager(self, setup) on a StagingBackendContract subclass in a test "
            "file"
        ) from None


def _load(text: str, what: str, *, path_hint: bool) -> object:
    ref = split_ref(text) or Ref(text, "")
    module_name, qualname = ref.module, ref.qualname
    try:
        return import_ref(ref)
    except ModuleRejected as failure:
        rejected = failure.error
        contract = contract_of(rejected.cls)
        raise BackendLoadError(
            f"importing {module_name!r} failed: the contract rejected a class statement:\n"
            f"{rejected}\n\n{contract.explain(rejected.cls)}"
        ) from None
    except ModuleMissing as failure:
        exc = failure.error
        hint = ""
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        top = module_name.split(".")[0]
        if missing is not None and missing == top:
            hint = f" ({PATH_HINT})" if path_hint else ""
        elif missing is not None and f"{module_name}.".startswith(f"{missing}."):
            parent, _, child = missing.rpartition(".")
            hint = f" ({parent!r} imports, but has no submodule {child!r}: check the name)"
        raise BackendLoadError(
            f"cannot import the {what} module {module_name!r}: {exc}{hint}"
        ) from None
    except ModuleRaised as failure:
        raised = failure.error
        trace = "".join(traceback.format_exception(raised)).rstrip()
        raise BackendLoadError(
            f"importing the {what} module {module_name!r} raised {type(raised).__name__}: "
            f"{raised}\n\n{trace}"
        ) from None
    except AttributeMissing:
        raise BackendLoadError(f"{module_name!r} has no attribute {qualname!r}") from None
