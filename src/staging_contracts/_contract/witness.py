"""Witnesses: the one line by which every type checker reports a host at its class.

A type checker sees a host class, but not the contract its mixin enforces at run time: mypy
needs our plugin for that, and pyright, ty and pyrefly have no plugins. What all of them check
is a *type argument against a type variable's bound*. A witness class is a generic class whose
type parameter is bound by the contract's Protocol, and a host names itself in it in a
``ClassVar`` annotation, the first statement of its body::

    class AcmeKVManager(StagingManagerMixin, CommonKVManager):
        __contract: ClassVar[StagingHostCheck[AcmeKVManager]]

A class that does not satisfy the Protocol (a member missing, a declared type not a subtype,
a method missing) is then an error on that line under every checker: mypy (``type-var``),
pyright (``reportInvalidTypeArguments``), ty (``invalid-type-arguments``) and pyrefly
(``bad-specialization``). Nothing happens at run time but the validation below; the
annotation has no value, and an instance never has the attribute.

Each contract has its own witness class (a type variable's bound cannot be a type parameter,
so one generic class cannot serve every Protocol). Defining one takes two lines::

    _Host = TypeVar("_Host", bound=CacheHost)
    class CacheHostCheck(HostCheck[_Host]): ...

A subclass of a host states a witness of its own (``StagingHostCheck[AscendKVManager]`` under
``class AscendKVManager(MooncakeKVManager)``): the name is private, so nothing is overridden.
The bound should be the Protocol of the *required* members (a Protocol cannot mark a member
optional), with read-only members (``@property``): a writable Protocol attribute must be
declared with exactly its type, while the contract accepts a narrower one.

**At class creation** an enforcing mixin validates the witness a host states for itself
(:func:`witness_problems`, through ``Contract.inspect_class``): it must resolve at run time,
be a witness class, be the witness of a contract the class is held to, and name the class
itself. A host without a witness is not an error; ``staging-contracts check`` and the kit
recommend one.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import sys
import typing
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Generic, TypeVar

from .problems import ContractProblem, ProblemKind
from .typeforms import class_label, is_protocol_class, type_name

__all__ = [
    "WITNESS_ATTRIBUTE",
    "HostCheck",
    "Witness",
    "mangled_witness_name",
    "own_witnesses",
    "unwitnessed",
    "witness_class_for",
    "witness_definition",
    "witness_line",
    "witness_note",
    "witness_problems",
]

WITNESS_ATTRIBUTE: Final = "__contract"
"""The class-body annotation a host states its witness in, as written (a ``ClassVar``,
without a value; ``ClassVar[tuple[A[X], B[X]]]`` for a host of two contracts). A private
name: Python mangles it per class (``_AcmeKVManager__contract``), so a subclass that states
its own witness overrides nothing, and checkers see no incompatible override."""

_T = TypeVar("_T")

_WITNESSES: weakref.WeakValueDictionary[type, type[HostCheck[Any]]] = weakref.WeakValueDictionary()
"""Protocol -> the witness class bound by it (the latest defined), for recommendations."""


class HostCheck(Generic[_T]):
    """Base of witness classes: subclass it with a type variable bound by a host Protocol.

    Never instantiated, and nothing reads it at run time but the validation at class
    creation: a type checker checks ``HostCheck`` subclasses' type arguments against their
    bound, which is the whole point. Each subclass whose one type parameter is bound by a
    Protocol is recorded as that Protocol's witness class (see :func:`witness_class_for`).
    """

    __slots__ = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        bound = _bound(cls)
        if bound is not None:
            _WITNESSES[bound] = cls


def _bound(witness: type) -> type | None:
    """The Protocol bounding the one type parameter of a witness class, else ``None``."""
    params: tuple[object, ...] = getattr(witness, "__parameters__", ())
    if len(params) != 1 or not isinstance(params[0], TypeVar):
        return None
    bound: object = params[0].__bound__
    if isinstance(bound, typing.ForwardRef):
        module = sys.modules.get(witness.__module__)
        try:
            bound = eval(bound.__forward_arg__, dict(vars(module)) if module else {})
        except Exception:  # noqa: BLE001 - an unresolvable bound: not a witness we can use
            return None
    return bound if isinstance(bound, type) and is_protocol_class(bound) else None


def witness_class_for(protocol: type) -> type[HostCheck[Any]] | None:
    """The witness class of a contract over ``protocol``: the one bound by ``protocol`` or,
    failing that, by the nearest Protocol it extends (its required part, say); ``None`` when
    no such class has been defined (imported)."""
    for klass in protocol.__mro__:
        found = _WITNESSES.get(klass)
        if found is not None:
            return found
    return None


def witness_line(protocol: type, cls: type) -> str | None:
    """The witness ``cls`` would state for a contract over ``protocol``, as written in its
    body (``__contract: ClassVar[StagingHostCheck[AcmeKVManager]]``); ``None`` when no
    witness class is defined for it (see :func:`witness_definition`)."""
    witness = witness_class_for(protocol)
    if witness is None:
        return None
    return f"{WITNESS_ATTRIBUTE}: ClassVar[{class_label(witness)}[{class_label(cls)}]]"


def witness_definition(protocol: type) -> str:
    """How to define the witness class of a contract over ``protocol``, as text."""
    name = class_label(protocol)
    return f'_Host = TypeVar("_Host", bound={name}); class {name}Check(HostCheck[_Host]): ...'


# --------------------------------------------------------------------------- reading


def mangled_witness_name(cls: type) -> str:
    """The name the witness annotation of ``cls``'s body is stored under (Python mangles
    ``__contract`` in the body of ``class AcmeKVManager`` to ``_AcmeKVManager__contract``)."""
    stripped = cls.__name__.lstrip("_")
    return f"_{stripped}{WITNESS_ATTRIBUTE}" if stripped else WITNESS_ATTRIBUTE


@dataclass(frozen=True, slots=True)
class Witness:
    """One witness a class states for itself, as resolved at class creation."""

    text: str
    """What the class wrote (the annotation, or the part of a tuple), for messages."""
    witness: type | None = None
    """The witness class (``StagingHostCheck``), or ``None`` if it is not one."""
    bound: type | None = None
    """The Protocol bounding the witness class, or ``None`` (the ``HostCheck`` base itself)."""
    named: object = None
    """The type argument: the class the witness names."""
    error: str = ""
    """Why the annotation could not be resolved at class creation ('' when it was)."""
    unjudged: bool = False
    """The annotation could not be looked at (its module is not loaded): no verdict."""


def own_witnesses(cls: type) -> tuple[Witness, ...] | None:
    """The witnesses ``cls`` states in its own body (not inherited), ``None`` if it states
    none. The annotation is evaluated in the namespace of the class's module, with the class's
    own name bound to it (the name is not bound in the module until the class statement
    completes)."""
    annotations = _own_annotations(cls)
    name = mangled_witness_name(cls)
    if name not in annotations:
        return None
    raw: object = annotations[name]
    if isinstance(raw, str) and cls.__module__ not in sys.modules:
        # The module is gone (its import failed, and a report is made afterwards): the names
        # the annotation uses cannot be looked up, so there is no verdict on it.
        return (Witness(raw, unjudged=True),)
    try:
        value = _evaluate(raw, cls)
    except Exception as exc:  # noqa: BLE001 - any failure is reported, with its reason
        text = raw if isinstance(raw, str) else type_name(raw)
        return (Witness(text, error=f"{type(exc).__name__}: {exc}"),)
    if typing.get_origin(value) is ClassVar:
        (value,) = typing.get_args(value) or (Any,)
    if typing.get_origin(value) is tuple:
        return tuple(_witness(arg, cls) for arg in typing.get_args(value) if arg is not Ellipsis)
    return (_witness(value, cls),)


def _own_annotations(cls: type) -> Mapping[str, object]:
    """The annotations of ``cls``'s own body, unevaluated where Python left them so."""
    try:
        return inspect.get_annotations(cls)
    except NameError:
        # Python 3.14+ evaluates annotations lazily: one naming the class itself cannot be
        # evaluated before the class statement completes; its source text can.
        annotationlib: Any = importlib.import_module("annotationlib")
        found: Mapping[str, object] = annotationlib.get_annotations(
            cls, format=annotationlib.Format.STRING
        )
        return found


def _evaluate(raw: object, cls: type) -> object:
    """Evaluate a (possibly postponed, possibly quoted) annotation of ``cls``'s body."""
    module = sys.modules.get(cls.__module__)
    global_ns: dict[str, Any] = dict(vars(module)) if module is not None else {}
    global_ns.setdefault("__builtins__", builtins)
    local_ns = {cls.__name__: cls}
    value = raw
    for _ in range(3):  # a quoted annotation under postponed annotations: a string of a string
        if isinstance(value, typing.ForwardRef):
            value = value.__forward_arg__
        if not isinstance(value, str):
            return value
        value = eval(value, global_ns, local_ns)
    return value


def _witness(value: object, cls: type) -> Witness:
    origin = typing.get_origin(value)
    args = typing.get_args(value)
    text = type_name(value)
    if not (isinstance(origin, type) and issubclass(origin, HostCheck)) or len(args) != 1:
        return Witness(text)
    named = args[0]
    if isinstance(named, typing.ForwardRef):
        try:
            named = _evaluate(named, cls)
        except Exception as exc:  # noqa: BLE001 - reported, with its reason
            return Witness(text, error=f"{type(exc).__name__}: {exc}")
    return Witness(text, origin, _bound(origin), named)


# --------------------------------------------------------------------------- recommending


def unwitnessed(cls: type, protocols: Sequence[type]) -> tuple[type, ...]:
    """The Protocols, among ``protocols``, for whose contract ``cls`` states no witness."""
    stated = own_witnesses(cls) or ()
    if any(w.unjudged for w in stated):
        return ()
    return tuple(p for p in protocols if not any(_serves(w, p) for w in stated))


def witness_note(cls: type, protocols: Sequence[type]) -> str | None:
    """A recommendation (not a problem): the witness ``cls`` could state for each contract
    over ``protocols`` that has a witness class (its author defined one) and that ``cls``
    states none for; ``None`` when there is none to recommend. A contract with no witness
    class is not mentioned: whether to define one is its author's choice, not the host's."""
    checks = [c for c in (witness_class_for(p) for p in unwitnessed(cls, protocols)) if c]
    if not checks:
        return None
    label = class_label(cls)
    args = [f"{class_label(c)}[{label}]" for c in checks]
    inner = args[0] if len(args) == 1 else f"tuple[{', '.join(args)}]"
    return (
        f"note: {label} states no witness of its contract: add "
        f"'{WITNESS_ATTRIBUTE}: ClassVar[{inner}]' as the first statement of its body (after "
        "the docstring), so that every type checker (mypy, pyright, ty, pyrefly) reports a "
        "broken contract at the class, with no plugin"
    )


# --------------------------------------------------------------------------- judging


def _serves(witness: Witness, protocol: type) -> bool:
    """Is ``witness`` the witness of a contract over ``protocol`` (bound by it, or by a
    Protocol it extends)?"""
    return witness.bound is not None and witness.bound in protocol.__mro__


def witness_problems(
    cls: type, protocol: type, others: Sequence[type] = ()
) -> Iterator[ContractProblem]:
    """What is wrong with the witnesses ``cls`` states, for its contract over ``protocol``.

    A witness of this contract must name ``cls``. A witness that cannot be resolved, is not a
    witness class, or serves neither this contract nor one of ``others`` (the Protocols of
    the other contracts ``cls`` is held to, which judge their own witnesses) is reported
    too, by the first of the class's contracts only (``others`` empty or led by
    ``protocol``), so that it is reported once. No witness at all is no problem.

    Args:
        cls: the host class.
        protocol: the Protocol of the contract being checked.
        others: the Protocols of every contract ``cls`` is held to, in MRO order (with or
            without ``protocol``).
    """
    witnesses = own_witnesses(cls)
    if witnesses is None:
        return
    label = class_label(cls)
    expected = witness_line(protocol, cls) or ""
    reports_strays = not others or others[0] is protocol
    for witness in witnesses:
        if witness.unjudged:
            continue
        if witness.error:
            if reports_strays:
                yield _problem(witness, expected, f"cannot be resolved: {witness.error}")
        elif _serves(witness, protocol):
            if witness.named is not cls:
                named = (
                    class_label(witness.named)
                    if isinstance(witness.named, type)
                    else type_name(witness.named)
                )
                yield _problem(witness, expected, f"names {named}, not {label}")
        elif any(_serves(witness, other) for other in others):
            continue
        elif reports_strays:
            if witness.witness is None:
                why = "is not a witness (a HostCheck subclass bound by a host Protocol)"
            elif witness.bound is None:
                why = (
                    f"uses {class_label(witness.witness)}, which no Protocol bounds (the base of "
                    "witness classes)"
                )
            else:
                why = f"checks {class_label(witness.bound)}, not a contract {label} is held to"
            yield _problem(witness, expected, why)


def _problem(witness: Witness, expected: str, why: str) -> ContractProblem:
    return ContractProblem(
        ProblemKind.WITNESS, WITNESS_ATTRIBUTE, expected, actual=witness.text, detail=why
    )
