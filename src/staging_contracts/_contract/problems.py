"""What can be wrong with a host of a contract, and the error that reports it."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from .typeforms import class_label

__all__ = ["ContractError", "ContractProblem", "ProblemKind"]


class ProblemKind(enum.Enum):
    """What is wrong with one member of a host."""

    MISSING = "missing"
    """The class declares the member nowhere, or an instance does not hold it."""
    MISMATCHED = "mismatched"
    """The declared type, or the value's type, is incompatible with the Protocol's."""
    SHADOWED = "shadowed"
    """A method the mixin provides resolves to a base listed before the mixin."""
    WITNESS = "witness"
    """The witness the class states (``__contract: ClassVar[...]``) names another class,
    serves another contract, or cannot be resolved (:mod:`.witness`)."""


@dataclass(frozen=True, slots=True)
class ContractProblem:
    """One problem of a host class or instance, with the facts the message is built from."""

    kind: ProblemKind
    """What is wrong."""
    member: str
    """The member (for ``SHADOWED``, the mixin method; for ``WITNESS``, the annotation)."""
    expected: str
    """The expected type, rendered (empty for ``SHADOWED``; for ``WITNESS``, the witness line
    the class should state, or empty when the contract has no witness class)."""
    actual: str = ""
    """The declared type, the value's type, or the shadowing base's name."""
    where: str = ""
    """The class that declares the member, when known (for an unset member of an instance:
    the class whose declaration, e.g. an ``__init__`` assignment, should have set it)."""
    detail: str = ""
    """Extra detail: from typeguard, where inside the value the mismatch is; for a method,
    which call its signature cannot take."""
    method: bool = False
    """The member is a method of the Protocol (its ``expected`` reads ``a method NAME(...)``)."""

    def describe(self, *, instance: bool) -> str:
        """One lowercase fragment describing the problem, names quoted with ``!r``."""
        if self.kind is ProblemKind.SHADOWED:
            return (
                f"method {self.member!r} of the mixin is shadowed by base {self.actual!r}, "
                "which is listed before the mixin"
            )
        if self.kind is ProblemKind.WITNESS:
            return f"its witness {self.actual!r} {self.detail}"
        extra = f": {self.detail}" if self.detail else ""
        if instance:
            noun = "method" if self.method else "attribute"
            if self.kind is ProblemKind.MISSING:
                return f"{noun} {self.member!r} is not set (expected {self.expected})"
            return f"{noun} {self.member!r} is {self.actual} (expected {self.expected}){extra}"
        if self.kind is ProblemKind.MISSING:
            return f"has no declaration of {self.member!r} (expected {self.expected})"
        return (
            f"declares {self.member!r} as {self.actual} in {self.where} "
            f"(expected {self.expected}){extra}"
        )


class ContractError(TypeError):
    """A class or instance does not satisfy a contract.

    Every problem is reported at once. The message is built from the fields: a header naming
    the class, the contract and the mixin, one indented line per problem, then how to fix it.

    Attributes:
        cls: the class that was checked.
        contract_name: the Protocol's name, e.g. ``StagingHost``.
        mixin_name: the enforcing mixin's name, or ``None`` for a standalone check.
        problems: one entry per problem, in member order.
        missing: names of members not declared (class) or not set (instance).
        mismatched: names of members whose declared type or value type is wrong.
        shadowed: names of mixin methods shadowed by a base listed before the mixin.
        witness: ``("__contract",)`` when the witness the class states is wrong, else empty.
        instance: ``True`` when raised by the per-instance check or an assignment check.
        assignment: ``True`` when raised by the check of an assignment to a member (the
            assignment did not happen: the member keeps its old value).
    """

    def __init__(
        self,
        cls: type,
        problems: Iterable[ContractProblem],
        *,
        contract_name: str,
        mixin_name: str | None,
        instance: bool = False,
        assignment: bool = False,
    ) -> None:
        self.cls = cls
        self.problems = tuple(problems)
        self.contract_name = contract_name
        self.mixin_name = mixin_name
        self.instance = instance or assignment
        self.assignment = assignment
        self.missing = self._names(ProblemKind.MISSING)
        self.mismatched = self._names(ProblemKind.MISMATCHED)
        self.shadowed = self._names(ProblemKind.SHADOWED)
        self.witness = tuple(dict.fromkeys(self._names(ProblemKind.WITNESS)))
        super().__init__(self._render())

    def _names(self, kind: ProblemKind) -> tuple[str, ...]:
        return tuple(p.member for p in self.problems if p.kind is kind)

    def _render(self) -> str:
        of_mixin = f" of {self.mixin_name}" if self.mixin_name else ""
        subject = f"{class_label(self.cls)} instance" if self.instance else class_label(self.cls)
        after = " after __init__" if self.instance else ""
        if self.assignment:
            after = " (assignment refused; the member is unchanged)"
        lines = [f"{subject} does not satisfy the {self.contract_name} contract{of_mixin}{after}:"]
        lines.extend(f"  - {p.describe(instance=self.instance)}" for p in self.problems)
        lines.append(self._fix())
        return "\n".join(lines)

    def _fix(self) -> str:
        hints: list[str] = []
        if self.assignment:
            hints.append("Assign a value of the expected type.")
        elif self.instance:
            hints.append("Assign each member a value of its expected type before __init__ returns.")
            label = class_label(self.cls)
            declaring = dict.fromkeys(
                p.where
                for p in self.problems
                if p.kind is ProblemKind.MISSING and p.where and p.where != label
            )
            if declaring:
                unset = [
                    repr(p.member)
                    for p in self.problems
                    if p.kind is ProblemKind.MISSING and p.where in declaring
                ]
                hints.append(
                    f"{', '.join(unset)} {'is' if len(unset) == 1 else 'are'} declared by "
                    f"{', '.join(declaring)}: did {label}.__init__ call super().__init__()? If "
                    "a member is assigned only on some paths, or by a later step, the contract "
                    "should mark it optional or set_later."
                )
        else:
            if self.missing:
                hints.append(self._declare_hint())
            if self.mismatched:
                hints.append("Change each mismatched declaration to the expected type.")
            if self.shadowed:
                mixin = self.mixin_name or "the mixin"
                bases = ", ".join(
                    dict.fromkeys(
                        repr(p.actual) for p in self.problems if p.kind is ProblemKind.SHADOWED
                    )
                )
                hints.append(f"List {mixin} before {bases} in the bases of the class.")
            if self.witness:
                hints.append(self._witness_hint())
        return "Fix: " + " ".join(hints)

    def _declare_hint(self) -> str:
        missing = [p for p in self.problems if p.kind is ProblemKind.MISSING]
        attribute = next((p for p in missing if not p.method), None)
        method = next((p for p in missing if p.method), None)
        ways: list[str] = []
        if attribute is not None:
            ways.append(
                f"annotate it, e.g. '{attribute.member}: {attribute.expected}', or assign it "
                "in __init__"
            )
        if method is not None:
            params = method.expected.removeprefix(f"a method {method.member}")
            lead = "for a method, define it" if ways else "define it"
            ways.append(f"{lead}, e.g. 'def {method.member}{_with_self(params)}: ...'")
        tail = ", or pass abstract=True for an intermediate base." if self.mixin_name else "."
        return (
            f"Declare each missing member on the class or one of its bases ({'; '.join(ways)})"
            + tail
        )

    def _witness_hint(self) -> str:
        witness = [p for p in self.problems if p.kind is ProblemKind.WITNESS]
        lines = dict.fromkeys(repr(p.expected) for p in witness if p.expected)
        if not lines:
            return (
                "Remove the witness, or define the witness class of the contract (a HostCheck "
                "subclass bound by its Protocol) and name the class itself in it."
            )
        runtime = any(p.detail.startswith("cannot be resolved") for p in witness)
        return f"State the witness as {', '.join(lines)}" + (
            ", its names imported at run time (not under TYPE_CHECKING)." if runtime else "."
        )


def _with_self(params: str) -> str:
    """``(a, b)`` -> ``(self, a, b)``; ``()`` -> ``(self)``."""
    inner = params.removeprefix("(").removesuffix(")")
    return f"(self, {inner})" if inner else "(self)"
