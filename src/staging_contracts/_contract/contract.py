"""Contracts: a ``typing.Protocol`` that a mixin requires of the classes it is mixed into.

Domain-free. A :class:`Contract` is built once from a Protocol (its members and their types are
resolved then, never per check) and answers three questions about a host class:

* :meth:`Contract.check_class` — does the class *declare* every required member, with a
  declared type that is not clearly incompatible, does no base listed before the mixin
  shadow a method the mixin provides, and does the witness it states, if any, name it?
* :meth:`Contract.check_instance` — after construction, does each member *hold* a value of its
  declared type (typeguard, every item of every collection)?
* :meth:`Contract.explain` — a table of each member: expected type, where and how it is
  declared, and its status.

:class:`ContractMixin` is the base a mixin derives from to enforce its contract on every
subclass: at class creation (``__init_subclass__``) and once per instance, after the outermost
``__init__`` returns. Method calls pay nothing. A second, unrelated mixin uses it the same way::

    class CacheHost(Protocol):
        cache_dir: str

    class CacheMixin(ContractMixin, contract=Contract(CacheHost)):
        def cache_path(self: CacheHost, key: str) -> str: ...
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final

from typeguard import TypeCheckError

from .declarations import Declaration, DeclarationKind, find_declaration, provided_methods
from .members import MemberKind, MemberSpec, protocol_members
from .problems import ContractError, ContractProblem, ProblemKind
from .signatures import call_problem
from .typeforms import Compat, class_label, declared_compatibility, type_name
from .valuecheck import ValueChecker, compile_checker
from .witness import witness_problems

CHAINS_SETATTR: Final = "__contract_chains_setattr__"
"""Set on the ``__setattr__`` an enforcing mixin gains: it hands every assignment on to the
next ``__setattr__`` of the host's MRO, so listing it before another mixin hides nothing."""

ABSTRACT_MARK: Final = "__contract_abstract__"
"""Class attribute set by enforcing mixins on classes created with ``abstract=True``."""

__all__ = [
    "ClassReport",
    "Contract",
    "ContractError",
    "ContractProblem",
    "MemberKind",
    "MemberReport",
    "MemberSpec",
    "MemberStatus",
    "ProblemKind",
]

AssignmentCheck = Callable[[object, object], None]
"""``(host, value) -> None``: checks a value about to be assigned to a member; raises
:class:`ContractError`."""


class MemberStatus(enum.Enum):
    """Status of one member in a class report."""

    OK = "ok"
    MISSING = "missing"
    MISMATCHED = "mismatched"
    UNRESOLVED = "unresolved, checked per instance"
    UNTYPED = "declared without a type, checked per instance"
    ABSENT = "optional, not declared"

    @property
    def unverified(self) -> bool:
        """Declared, but what it holds cannot be judged from the class alone."""
        return self in (MemberStatus.UNRESOLVED, MemberStatus.UNTYPED)


@dataclass(frozen=True, slots=True)
class MemberReport:
    """One row of :meth:`Contract.explain`."""

    spec: MemberSpec
    declaration: Declaration | None
    status: MemberStatus


@dataclass(frozen=True, slots=True)
class ClassReport:
    """Everything :meth:`Contract.check_class` found about one class."""

    cls: type
    members: tuple[MemberReport, ...]
    problems: tuple[ContractProblem, ...]
    abstract: bool

    @property
    def conforms(self) -> bool:
        """True when the class has no problem (abstract classes are not judged)."""
        return self.abstract or not self.problems

    @property
    def unverified(self) -> tuple[str, ...]:
        """Members declared in a way the class check cannot judge (no type stated, or one it
        cannot resolve): only an instance check can tell whether they hold the right thing."""
        return tuple(row.spec.name for row in self.members if row.status.unverified)


# --------------------------------------------------------------------------- the contract


class Contract:
    """A Protocol turned into a checkable contract.

    Built once; immutable afterwards except for the one-time binding to the mixin that
    enforces it. Thread-safe: checks only read.

    Members are the Protocol's annotated attributes, its properties (a value of the getter's
    return type) and its methods (a callable that takes every call the Protocol's signature
    allows); see :mod:`.members`.

    Args:
        protocol: a ``typing.Protocol`` class; its members (and those of the Protocols it
            extends) are the contract's.
        optional: names of members that are checked only when present.
        set_later: names of attribute members the host assigns after construction (a handler
            attached by the scheduler, a pool handed over at start-up): they may be unset
            when ``__init__`` returns, and an enforcing mixin checks every assignment to them
            (a wrong-typed value raises :class:`ContractError` and leaves the old value).
        name: how messages name the contract; defaults to the Protocol's name.

    Raises:
        TypeError: ``protocol`` is not a Protocol, its hints cannot be resolved, a name in
            ``optional`` or ``set_later`` is not one of its members, or a ``set_later`` name
            is a method.
    """

    def __init__(
        self,
        protocol: type,
        *,
        optional: Iterable[str] = (),
        set_later: Iterable[str] = (),
        name: str | None = None,
    ) -> None:
        members = protocol_members(protocol, optional=optional, set_later=set_later)
        self.protocol: Final = protocol
        self.name: Final = name or class_label(protocol)
        self.members: Final[tuple[MemberSpec, ...]] = members
        self._checkers: Final[tuple[tuple[MemberSpec, ValueChecker], ...]] = tuple(
            (spec, _method_checker if spec.is_method else compile_checker(spec.expected))
            for spec in self.members
        )
        self._assignment_checks: Final[Mapping[str, AssignmentCheck]] = {
            spec.name: self._assignment_check(spec, checker)
            for spec, checker in self._checkers
            if spec.set_later
        }
        self._mixin: type | None = None

    def __repr__(self) -> str:
        return f"Contract({self.name}, members={[m.name for m in self.members]!r})"

    @property
    def mixin(self) -> type | None:
        """The mixin that enforces this contract, once bound."""
        return self._mixin

    @property
    def required(self) -> tuple[str, ...]:
        """Names of the required members, in Protocol order."""
        return tuple(m.name for m in self.members if not m.optional)

    @property
    def optional(self) -> tuple[str, ...]:
        """Names of the optional members, in Protocol order."""
        return tuple(m.name for m in self.members if m.optional)

    @property
    def set_later(self) -> tuple[str, ...]:
        """Names of the members assigned after construction, in Protocol order."""
        return tuple(m.name for m in self.members if m.set_later)

    @property
    def methods(self) -> tuple[str, ...]:
        """Names of the method members, in Protocol order."""
        return tuple(m.name for m in self.members if m.is_method)

    @property
    def assignment_checks(self) -> Mapping[str, AssignmentCheck]:
        """For each ``set_later`` member, the check an enforcing mixin runs on every
        assignment to it (read-only; empty when there are none)."""
        return self._assignment_checks

    def bind(self, mixin: type) -> None:
        """Record the mixin that enforces this contract (called once, by :class:`ContractMixin`).

        Raises:
            TypeError: the contract is already bound to another mixin.
        """
        if self._mixin is not None and self._mixin is not mixin:
            raise TypeError(
                f"contract {self.name} is already enforced by {class_label(self._mixin)}"
            )
        self._mixin = mixin

    # ----------------------------------------------------------------- class creation

    def inspect_class(self, cls: type, *, abstract: bool = False) -> ClassReport:
        """Collect declarations, statuses and problems of ``cls`` without raising.

        Args:
            cls: the host class.
            abstract: report only; the class opted out of being judged.
        """
        excluded = self._excluded_classes()
        rows: list[MemberReport] = []
        problems: list[ContractProblem] = []
        for spec in self.members:
            decl = find_declaration(cls, spec.name, excluded)
            status = _status(spec, decl)
            rows.append(MemberReport(spec, decl, status))
            if status is MemberStatus.MISSING:
                problems.append(
                    ContractProblem(
                        ProblemKind.MISSING, spec.name, spec.expected_name, method=spec.is_method
                    )
                )
            elif status is MemberStatus.MISMATCHED and decl is not None:
                problems.append(
                    ContractProblem(
                        ProblemKind.MISMATCHED,
                        spec.name,
                        spec.expected_name,
                        actual=decl.declared_name,
                        where=self._label(decl.owner, cls),
                        detail=_method_detail(spec, decl),
                        method=spec.is_method,
                    )
                )
        problems.extend(self._shadowing_problems(cls))
        problems.extend(witness_problems(cls, self.protocol, _held_protocols(cls)))
        return ClassReport(cls, tuple(rows), tuple(problems), abstract)

    def check_class(self, cls: type) -> None:
        """Raise :class:`ContractError` listing every problem of ``cls``; return if none."""
        report = self.inspect_class(cls)
        if report.problems:
            raise self.class_error(report)

    def class_error(self, report: ClassReport) -> ContractError:
        """The :class:`ContractError` that reports ``report``'s problems (not raised).

        Class names are qualified with their module wherever two named in the message share
        a short name (a base named like the mixin, say).
        """
        return ContractError(
            report.cls,
            report.problems,
            contract_name=self.name,
            mixin_name=self._mixin_name(report.problems),
        )

    def _excluded_classes(self) -> frozenset[type]:
        if self._mixin is None:
            return frozenset({object})
        return frozenset(self._mixin.__mro__)

    def _mixin_name(self, problems: Iterable[ContractProblem] = ()) -> str | None:
        """The mixin's name; with its module when a class a problem names shares its name."""
        mixin = self._mixin
        if mixin is None:
            return None
        short = class_label(mixin)
        others = {p.actual for p in problems if p.kind is ProblemKind.SHADOWED}
        others |= {p.where for p in problems if p.where}
        if any(name.rpartition(".")[2] == short for name in others):
            return _qualified(mixin)
        return short

    def _label(self, owner: type, cls: type) -> str:
        """``owner``'s name in a message about ``cls``: with its module when it shares its
        short name with ``cls`` or the mixin without being that class."""
        short = class_label(owner)
        namesakes = [k for k in (cls, self._mixin) if k is not None and k is not owner]
        if any(class_label(k) == short for k in namesakes):
            return _qualified(owner)
        return short

    def _shadowing_problems(self, cls: type) -> Iterator[ContractProblem]:
        mixin = self._mixin
        if mixin is None or mixin not in cls.__mro__:
            return
        methods = list(provided_methods(mixin))
        if self._assignment_checks:
            methods.append("__setattr__")  # where the set_later members are checked
        for method in methods:
            owner = next(k for k in cls.__mro__ if method in k.__dict__)
            if getattr(owner.__dict__[method], CHAINS_SETATTR, False):
                continue  # another enforcing mixin's check: it hands the assignment on
            if owner not in mixin.__mro__ and not issubclass(owner, mixin):
                yield ContractProblem(
                    ProblemKind.SHADOWED, method, "", actual=self._label(owner, cls)
                )

    # ----------------------------------------------------------------- per instance

    def instance_problems(self, obj: object) -> list[ContractProblem]:
        """Check each member's current value; return the problems (empty when it conforms).

        An optional member, or one set later, may be unset; a method member must be callable.
        """
        problems: list[ContractProblem] = []
        for spec, checker in self._checkers:
            try:
                value = getattr(obj, spec.name)
            except AttributeError:
                if not (spec.optional or spec.set_later):
                    decl = find_declaration(type(obj), spec.name, self._excluded_classes())
                    where = "" if decl is None else self._label(decl.owner, type(obj))
                    problems.append(
                        ContractProblem(
                            ProblemKind.MISSING,
                            spec.name,
                            spec.expected_name,
                            where=where,
                            method=spec.is_method,
                        )
                    )
                continue
            try:
                checker(value)
            except TypeCheckError as exc:
                problems.append(self._value_problem(spec, value, exc))
        return problems

    def _value_problem(
        self, spec: MemberSpec, value: object, exc: TypeCheckError
    ) -> ContractProblem:
        return ContractProblem(
            ProblemKind.MISMATCHED,
            spec.name,
            spec.expected_name,
            actual=type_name(type(value)),
            detail=_typeguard_detail(exc),
            method=spec.is_method,
        )

    def check_instance(self, obj: object) -> None:
        """Raise :class:`ContractError` if a member of ``obj`` is unset or of the wrong type.

        **Called by** the enforcing mixin once per construction, after the outermost
        ``__init__`` returns; may be called directly, from any thread.
        """
        problems = self.instance_problems(obj)
        if problems:
            raise ContractError(
                type(obj),
                problems,
                contract_name=self.name,
                mixin_name=self._mixin_name(problems),
                instance=True,
            )

    def check_member(self, obj: object, name: str, value: object) -> None:
        """Check that ``value`` may be assigned to member ``name`` of ``obj``.

        **Called by** the enforcing mixin's ``__setattr__`` for each ``set_later`` member
        (through :attr:`assignment_checks`), and by anyone, from any thread.

        Raises:
            KeyError: ``name`` is not an attribute member of the contract.
            ContractError: the value's type does not match.
        """
        check = self._assignment_checks.get(name)
        if check is None:
            found = [
                (spec, checker)
                for spec, checker in self._checkers
                if spec.name == name and not spec.is_method
            ]
            if not found:
                raise KeyError(name)
            check = self._assignment_check(*found[0])
        check(obj, value)

    def _assignment_check(self, spec: MemberSpec, checker: ValueChecker) -> AssignmentCheck:
        def check(obj: object, value: object) -> None:
            try:
                checker(value)
            except TypeCheckError as exc:
                problem = self._value_problem(spec, value, exc)
                raise ContractError(
                    type(obj),
                    [problem],
                    contract_name=self.name,
                    mixin_name=self._mixin_name(),
                    instance=True,
                    assignment=True,
                ) from None

        return check

    # ----------------------------------------------------------------- explanation

    def explain(self, cls: type) -> str:
        """A table of every member of the contract as ``cls`` declares it, then a verdict.

        Columns: member, expected type, declared in, declared as, status. Shadowed mixin
        methods and a wrong witness (:mod:`.witness`) follow the table.
        """
        report = self.inspect_class(cls, abstract=is_abstract(cls))
        header = ("member", "expected", "declared in", "declared type", "status")
        rows = [header]
        for row in report.members:
            decl = row.declaration
            rows.append(
                (
                    row.spec.name + (" (optional)" if row.spec.optional else ""),
                    row.spec.expected_name,
                    f"{self._label(decl.owner, cls)} ({decl.how})" if decl else "-",
                    decl.declared_name if decl else "-",
                    self._status_text(row.status, cls, abstract=report.abstract),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [
            f"{cls.__module__}.{class_label(cls)} against the {self.name} contract"
            + (f" of {self._mixin_name(report.problems)}" if self._mixin else "")
        ]
        for index, row_text in enumerate(rows):
            lines.append(
                "  ".join(c.ljust(w) for c, w in zip(row_text, widths, strict=True)).rstrip()
            )
            if index == 0:
                lines.append("  ".join("-" * w for w in widths))
        for problem in report.problems:
            if problem.kind in (ProblemKind.SHADOWED, ProblemKind.WITNESS):
                lines.append(f"! {problem.describe(instance=False)}")
        lines.append(f"verdict: {self._verdict(report)}")
        return "\n".join(lines)

    def _verdict(self, report: ClassReport) -> str:
        """``conforms`` only when the check verified every member, or what is left unverified
        is verified per instance by the enforcing mixin; otherwise what was verified and what
        was not."""
        if report.abstract:
            return "abstract (abstract=True): not judged; its subclasses are"
        if report.problems:
            return f"does not conform: {len(report.problems)} problem(s)"
        unverified = report.unverified
        if not unverified:
            return "conforms"
        names = ", ".join(repr(name) for name in unverified)
        if self._enforced_on(report.cls):
            return f"conforms (the values of {names} are checked per instance)"
        return (
            f"every member declared; not verified: {names} (their types cannot be checked "
            "from the class, and no enforcing mixin checks them per instance)"
        )

    def _enforced_on(self, cls: type) -> bool:
        mixin = self._mixin
        return mixin is not None and mixin in cls.__mro__

    def _status_text(self, status: MemberStatus, cls: type, *, abstract: bool) -> str:
        """The status as the table shows it; for a member left to the per-instance check,
        when that check runs on ``cls``, if ever."""
        text = str(status.value)
        if not status.unverified:
            return text
        reason = text.removesuffix(", checked per instance")
        if not self._enforced_on(cls):
            return f"{reason}: type not checked"
        if abstract:
            return f"{reason}, checked per instance of its subclasses (abstract=True)"
        return text


def _held_protocols(cls: type) -> tuple[type, ...]:
    """The Protocols of the contracts the mixins in ``cls``'s MRO enforce, nearest first."""
    found: list[type] = []
    for klass in cls.__mro__:
        contract = klass.__dict__.get("contract")
        if isinstance(contract, Contract) and contract.mixin is klass:
            found.append(contract.protocol)
    return tuple(found)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{class_label(cls)}"


def _typeguard_detail(exc: TypeCheckError) -> str:
    text = str(exc)
    return "" if text.startswith("is not an instance of") else text


def _method_checker(value: object) -> None:
    if not callable(value):
        raise TypeCheckError("is not callable")


def _method_detail(spec: MemberSpec, decl: Declaration) -> str:
    """Why a method declaration cannot stand for the Protocol's method ('' if not a method)."""
    if spec.is_method and decl.kind is DeclarationKind.METHOD:
        return call_problem(spec.expected, decl.declared) or ""
    return ""


def _status(spec: MemberSpec, decl: Declaration | None) -> MemberStatus:
    if decl is None:
        return MemberStatus.ABSENT if spec.optional else MemberStatus.MISSING
    if spec.is_method:
        return _method_status(spec, decl)
    if decl.kind is DeclarationKind.METHOD:
        # a method where a value is expected: fine only if that value may be a callable
        return _compat_status(declared_compatibility(types.MethodType, spec.expected))
    if not decl.resolved:
        return MemberStatus.UNRESOLVED
    if decl.declared is None and decl.kind is not DeclarationKind.ANNOTATION:
        return MemberStatus.UNTYPED
    return _compat_status(declared_compatibility(decl.declared, spec.expected))


def _compat_status(verdict: Compat) -> MemberStatus:
    if verdict is Compat.NO:
        return MemberStatus.MISMATCHED
    return MemberStatus.OK if verdict is Compat.YES else MemberStatus.UNRESOLVED


def _method_status(spec: MemberSpec, decl: Declaration) -> MemberStatus:
    """A method member: a method whose signature takes the Protocol's calls is OK; a value
    that is certainly not callable (``name = None``) is mismatched; anything else (an
    annotation, a slot, a property) is left to the instance check."""
    if decl.kind is DeclarationKind.METHOD:
        return (
            MemberStatus.MISMATCHED
            if call_problem(spec.expected, decl.declared)
            else (MemberStatus.OK)
        )
    if decl.kind is DeclarationKind.ATTRIBUTE and decl.declared is not None:
        return MemberStatus.MISMATCHED  # a literal: None, a number, a string
    return MemberStatus.UNRESOLVED


def is_abstract(cls: type) -> bool:
    """True for a class created with ``abstract=True`` (the flag is not inherited)."""
    return bool(cls.__dict__.get(ABSTRACT_MARK, False))
