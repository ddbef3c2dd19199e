"""Enforcement of a :class:`~.contract.Contract` on every subclass of a mixin.

:class:`ContractMixin` is the base a mixin derives from to enforce its contract on every
class it is mixed into:

* at class creation (``__init_subclass__``), unless the class is created with
  ``abstract=True``, which opts out that class only;
* once per instance, after the outermost ``__init__`` (or dataclass ``__post_init__``)
  returns, whatever the ``super().__init__`` chain, and also when ``__init__`` is inherited
  from a base that knows nothing of the mixin;
* at every assignment to a member the contract marks ``set_later``, through a
  ``__setattr__`` the mixin gains (a wrong-typed value raises and is not assigned);
* never on method calls, and never on reads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Final

from .contract import ABSTRACT_MARK, CHAINS_SETATTR, Contract, is_abstract

__all__ = ["ContractMixin", "contract_roots"]

_ROOT_MARK: Final = "__contract_root__"
_NEXT_SETATTR: Final = "_contract_next_setattr_{}"
"""Class attribute (per enforcing mixin) holding the ``__setattr__`` that follows the mixin's
in a host's MRO, resolved once at class creation."""
_GENERIC: Final = "_contract_setattr_generic_{}"
"""Class attribute of an enforcing mixin: non-empty once one of its hosts has another
``__setattr__`` after the mixin in its MRO."""
_constructing = threading.local()


def contract_roots(cls: type) -> tuple[type, ...]:
    """The enforcing mixins in ``cls``'s MRO, nearest first."""
    return tuple(k for k in cls.__mro__ if k.__dict__.get(_ROOT_MARK, False))


def _active() -> set[int]:
    active: set[int] | None = getattr(_constructing, "ids", None)
    if active is None:
        active = set()
        _constructing.ids = active
    return active


def _check_new_instance(obj: object) -> None:
    cls = type(obj)
    if is_abstract(cls):
        return
    for root in contract_roots(cls):
        contract: Contract = root.__dict__["contract"]
        contract.check_instance(obj)


def _outermost(method: Callable[..., None]) -> Callable[..., None]:
    """Wrap an initialiser so the instance check runs once, after the outermost call returns."""

    def wrapper(self: object, *args: Any, **kwargs: Any) -> None:
        active = _active()
        key = id(self)
        if key in active:
            method(self, *args, **kwargs)
            return
        active.add(key)
        try:
            method(self, *args, **kwargs)
        finally:
            active.discard(key)
        _check_new_instance(self)

    wrapper.__name__ = getattr(method, "__name__", "__init__")
    wrapper.__qualname__ = getattr(method, "__qualname__", wrapper.__name__)
    wrapper.__doc__ = method.__doc__
    wrapper.__module__ = method.__module__
    wrapper.__wrapped__ = method  # type: ignore[attr-defined]  # functools.wraps convention
    wrapper.__contract_wrapper__ = True  # type: ignore[attr-defined]  # marks ours
    return wrapper


def _install_instance_check(cls: type) -> None:
    for name in ("__init__", "__post_init__"):
        own = cls.__dict__.get(name)
        if own is not None and callable(own) and not getattr(own, "__contract_wrapper__", False):
            setattr(cls, name, _outermost(own))
    if "__init__" in cls.__dict__:
        return
    owner = next(k for k in cls.__mro__ if "__init__" in k.__dict__)
    if not issubclass(owner, ContractMixin):
        # The inherited __init__ comes from a base listed before the mixin: nothing of ours
        # would run around it, so this class gets its own outermost wrapper.
        host: type = cls

        def forward(self: object, *args: Any, **kwargs: Any) -> None:
            # mypy accepts only a class literal as super()'s first argument:
            super(host, self).__init__(*args, **kwargs)  # type: ignore[arg-type]

        forward.__qualname__ = f"{cls.__qualname__}.__init__"
        forward.__module__ = cls.__module__
        type.__setattr__(cls, "__init__", _outermost(forward))


def _install_assignment_check(mixin: type, contract: Contract) -> None:
    """Give ``mixin`` a ``__setattr__`` that checks the ``set_later`` members of ``contract``.

    Reads are untouched (no descriptor, no ``__getattribute__``). An assignment to another
    attribute pays one dictionary lookup and one call; one to a watched member also its value
    check. While every host hands assignments on to ``object.__setattr__`` (no other class of
    their MROs after the mixin defines ``__setattr__``), it is called directly; once a host
    has another one after the mixin, each assignment looks up the one of its own class.
    """
    checks = contract.assignment_checks
    if not checks:
        return
    follow = _NEXT_SETATTR.format(id(mixin))
    generic: list[bool] = []  # appended to (once) when a host needs the lookup
    plain = object.__setattr__

    def __setattr__(self: object, name: str, value: object) -> None:
        check = checks.get(name)
        if check is not None:
            check(self, value)
        if generic:
            getattr(type(self), follow)(self, name, value)
        else:
            plain(self, name, value)

    __setattr__.__qualname__ = f"{mixin.__qualname__}.__setattr__"
    __setattr__.__module__ = mixin.__module__
    setattr(__setattr__, CHAINS_SETATTR, True)
    type.__setattr__(mixin, "__setattr__", __setattr__)
    type.__setattr__(mixin, _GENERIC.format(id(mixin)), generic)
    _resolve_next_setattr(mixin)


def _resolve_next_setattr(cls: type) -> None:
    """For each enforcing mixin of ``cls`` that checks assignments, record on ``cls`` the
    ``__setattr__`` that comes after the mixin's in ``cls``'s MRO (``object``'s, usually);
    when it is another one, switch that mixin's ``__setattr__`` to looking it up."""
    mro = cls.__mro__
    for root in contract_roots(cls):
        if not root.__dict__["contract"].assignment_checks:
            continue
        after = mro[mro.index(root) + 1 :]
        owner = next(k for k in after if "__setattr__" in k.__dict__)
        following = owner.__dict__["__setattr__"]
        type.__setattr__(cls, _NEXT_SETATTR.format(id(root)), following)
        generic: list[bool] = root.__dict__[_GENERIC.format(id(root))]
        if following is not object.__dict__["__setattr__"] and not generic:
            generic.append(True)


class ContractMixin:
    """Base for mixins that enforce a :class:`Contract` on every class they are mixed into.

    Define the mixin with ``contract=``; every subclass is then checked:

    * at class creation, unless created with ``abstract=True`` (for itself only);
    * once per instance, after the outermost ``__init__`` (or dataclass ``__post_init__``)
      returns, whatever the ``super().__init__`` chain;
    * at each assignment to a member the contract marks ``set_later`` (the mixin then has a
      ``__setattr__``; a host that defines its own must call ``super().__setattr__``);
    * never on method calls or reads.

    A host whose ``__init__`` would be inherited from a base listed *before* the mixin gets an
    ``__init__`` of its own that forwards to it, so that the instance check still runs; a
    ``@dataclass`` host must therefore list the mixin before such a base (the decorator keeps
    an ``__init__`` it finds in the class and would not generate its own).

    Class keywords:
        contract: on the mixin itself: the contract it enforces.
        abstract: on a host: skip the checks for this class (its subclasses are checked).
    """

    contract: ClassVar[Contract]
    """The contract the mixin enforces on its hosts."""

    def __init_subclass__(
        cls, *, contract: Contract | None = None, abstract: bool = False, **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        if contract is not None:
            if abstract:
                raise TypeError("a contract mixin cannot also be abstract=True")
            contract.bind(cls)
            type.__setattr__(cls, "contract", contract)
            type.__setattr__(cls, _ROOT_MARK, True)
            _install_instance_check(cls)
            _install_assignment_check(cls, contract)
            return
        type.__setattr__(cls, ABSTRACT_MARK, abstract)
        if not abstract:
            for root in contract_roots(cls):
                root.__dict__["contract"].check_class(cls)
        _install_instance_check(cls)
        _resolve_next_setattr(cls)

    if not TYPE_CHECKING:
        # Runtime only, so that type checkers keep seeing the host's own constructor
        # signature. With the mixin listed first, a host without an __init__ of its own
        # enters here, and this is then the outermost initialiser.
        def _forward_init(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

        __init__ = _outermost(_forward_init)
        del _forward_init

        def __post_init__(self, *args):
            # Dataclass hosts: the generated __init__ never calls super().__init__, but it
            # calls __post_init__ last.
            follow = getattr(super(), "__post_init__", None)
            if follow is not None:
                follow(*args)
            if id(self) not in _active():
                _check_new_instance(self)
