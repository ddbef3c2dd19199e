"""Which classes enforce a contract, and which one, read from the source as mypy sees it.

Private to :mod:`staging_contracts.mypy_plugin`. An enforcing mixin is a class statement with
:class:`~staging_contracts._contract.enforcement.ContractMixin` among its bases and a
``contract=`` keyword::

    class CacheMixin(ContractMixin, contract=Contract(CacheHost, optional=("ttl",))): ...

    STAGING_CONTRACT = Contract(StagingHost, optional=("kv_buffer_tensors",), set_later=...)
    class StagingManagerMixin(ContractMixin, contract=STAGING_CONTRACT): ...

The keyword is either a ``Contract(...)`` call or a name (or ``module.NAME``) bound once to
one, at module level or in the function that defines the mixin. The call's first argument
names the Protocol; ``optional=`` and ``set_later=`` are literal tuples, lists or sets of
strings. :func:`read_contract` turns that
into :class:`ContractFacts`, which the plugin keeps in the mixin's ``TypeInfo.metadata`` (so
that they survive mypy's cache, and classes of other modules and packages find them).

A name bound to a ``Contract(...)`` at module level is read where it is bound, when mypy
analyses that module: the plugin keeps its facts in the module's symbol table, under
:func:`facts_symbol` of the name, because a module's syntax tree is gone (freed after type
checking, or never built when it comes from the cache) by the time another module's mixin
names it. A ``contract=`` the plugin cannot read statically (built by a function call, say)
is reported by :func:`read_contract` as the reason, and that mixin's hosts are left to the
runtime checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from mypy.nodes import (
    ARG_NAMED,
    ARG_POS,
    AssignmentStmt,
    Block,
    CallExpr,
    Expression,
    ListExpr,
    MemberExpr,
    MypyFile,
    NameExpr,
    RefExpr,
    SetExpr,
    StrExpr,
    TupleExpr,
    TypeInfo,
    Var,
)

from .mypy_analysis import METADATA_KEY

__all__ = [
    "CONTRACT_CLASS",
    "CONTRACT_MIXIN",
    "ContractFacts",
    "ModuleLookup",
    "facts_symbol",
    "read_call",
    "read_contract",
]

CONTRACT_CLASS: Final = "staging_contracts._contract.contract.Contract"
"""Fullname of ``Contract``, whatever name a module imports it under."""

CONTRACT_MIXIN: Final = "staging_contracts._contract.enforcement.ContractMixin"
"""Fullname of ``ContractMixin``."""

ModuleLookup = Mapping[str, MypyFile]
"""Module name -> its syntax tree (mypy's modules of this run)."""


@dataclass(frozen=True, slots=True)
class ContractFacts:
    """A contract as its ``Contract(...)`` expression states it."""

    protocol: str
    """Fullname of the Protocol."""
    optional: tuple[str, ...] = ()
    """Members checked only when declared."""
    set_later: tuple[str, ...] = ()
    """Members assigned after construction (every assignment checked at runtime)."""

    def to_json(self) -> dict[str, object]:
        """The facts as stored in ``TypeInfo.metadata``."""
        return {
            "protocol": self.protocol,
            "optional": list(self.optional),
            "set_later": list(self.set_later),
        }

    @classmethod
    def from_json(cls, data: object) -> ContractFacts | None:
        """The facts back from ``TypeInfo.metadata``; ``None`` when absent or malformed."""
        if not isinstance(data, Mapping) or not isinstance(data.get("protocol"), str):
            return None
        return cls(
            str(data["protocol"]),
            tuple(str(name) for name in data.get("optional", ())),
            tuple(str(name) for name in data.get("set_later", ())),
        )


FACTS_KEY: Final = "contract_binding"
"""Metadata key (under the plugin's) of the facts of a module-level ``NAME = Contract(...)``."""


def facts_symbol(name: str) -> str:
    """The symbol-table name under which the facts of ``name = Contract(...)`` are kept.

    Not an identifier, so that it can never be a name of the module's own code.
    """
    return f"{name}@staging-contract"


def read_contract(keyword: Expression, modules: ModuleLookup, module: str) -> ContractFacts | str:
    """The contract a ``contract=`` class keyword names, or why it cannot be read statically.

    Args:
        keyword: the keyword's expression, after semantic analysis (names are bound).
        modules: the syntax trees of this run, where a name's assignment is looked up.
        module: the module of the class statement (where a local name is bound).
    """
    call = _contract_call(keyword, modules, module)
    if isinstance(call, str | ContractFacts):
        return call
    return read_call(call)


def read_call(call: CallExpr) -> ContractFacts | str:
    """The facts of a ``Contract(...)`` call, or why they cannot be read statically."""
    protocol: str | None = None
    lists: dict[str, tuple[str, ...]] = {}
    for arg, kind, name in zip(call.args, call.arg_kinds, call.arg_names, strict=True):
        if kind is ARG_POS and protocol is None:
            if not isinstance(arg, RefExpr) or not isinstance(arg.node, TypeInfo):
                return "its Protocol is not a class name"
            protocol = arg.node.fullname
        elif kind is ARG_NAMED and name in ("optional", "set_later"):
            names = _literal_names(arg)
            if names is None:
                return f"its {name}= is not a literal tuple, list or set of strings"
            lists[name] = names
        elif kind is not ARG_NAMED or name != "name":
            return "it passes arguments the plugin does not read"
    if protocol is None:
        return "it names no Protocol"
    return ContractFacts(protocol, lists.get("optional", ()), lists.get("set_later", ()))


def _contract_call(
    keyword: Expression, modules: ModuleLookup, module: str
) -> CallExpr | ContractFacts | str:
    if isinstance(keyword, CallExpr):
        if _is_contract(keyword.callee):
            return keyword
        return "it is not a Contract(...) call"
    if not (isinstance(keyword, NameExpr | MemberExpr) and isinstance(keyword.node, Var)):
        return "it is neither a Contract(...) call nor a name bound to one"
    var = keyword.node
    owner = var.fullname.rpartition(".")[0] if "." in var.fullname else module
    tree = modules.get(owner)
    if tree is None:
        return f"module {owner!r} is not in this run"
    kept = tree.names.get(facts_symbol(var.name))
    if kept is not None and isinstance(kept.node, TypeInfo):
        facts = ContractFacts.from_json(kept.node.metadata.get(METADATA_KEY, {}).get(FACTS_KEY))
        if facts is not None:
            return facts
    assignment = _assignment_of(tree, var)
    if assignment is None:
        return f"no assignment of {var.name!r} found in {owner!r}"
    if isinstance(assignment, CallExpr) and _is_contract(assignment.callee):
        return assignment
    return f"{var.name!r} is not bound to a Contract(...) call"


def _assignment_of(tree: MypyFile, var: Var) -> Expression | None:
    """The value of the one assignment that binds ``var`` (at any depth: a contract defined in
    a function), or ``None`` if none or several do."""
    found: list[Expression] = []
    pending: list[object] = list(tree.defs)
    while pending:
        node = pending.pop()
        if isinstance(node, AssignmentStmt):
            if (
                len(node.lvalues) == 1
                and isinstance(node.lvalues[0], NameExpr)
                and node.lvalues[0].node is var
            ):
                found.append(node.rvalue)
            continue
        body = getattr(node, "body", None)
        if isinstance(body, Block):
            pending.extend(body.body)
        elif isinstance(body, list):
            pending.extend(body)
        for branch in ("else_body", "finally_body"):
            block = getattr(node, branch, None)
            if isinstance(block, Block):
                pending.extend(block.body)
        defs = getattr(node, "defs", None)
        if isinstance(defs, Block):
            pending.extend(defs.body)
    return found[0] if len(found) == 1 else None


def _is_contract(callee: Expression) -> bool:
    return isinstance(callee, RefExpr) and callee.fullname == CONTRACT_CLASS


def _literal_names(expr: Expression) -> tuple[str, ...] | None:
    if isinstance(expr, StrExpr):
        return None  # a lone string is a bug (its characters are not names): no guess
    if isinstance(expr, TupleExpr | ListExpr | SetExpr) and all(
        isinstance(item, StrExpr) for item in expr.items
    ):
        return tuple(item.value for item in expr.items if isinstance(item, StrExpr))
    return None
