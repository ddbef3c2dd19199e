"""What a host class declares, as mypy sees it: the analysis behind the mypy plugin.

Private to :mod:`staging_contracts.mypy_plugin`, and the static twin of
:mod:`~staging_contracts._contract.declarations` and
:meth:`~staging_contracts._contract.contract.Contract.inspect_class`:
the same members, the same notion of *declared*, the same problems, computed on mypy's
``TypeInfo`` objects instead of live classes. It imports mypy, so nothing in the library
imports it at runtime.

A member counts as declared by a class-level annotation, a class attribute, a property or other
descriptor, a ``__slots__`` entry, or an assignment to ``self.<name>`` in ``__init__`` or in a
method of the same class that ``__init__`` calls on ``self`` (directly or through another such
method), in any class of the host's MRO except the enforcing mixin's own MRO (the mixin,
``ContractMixin`` and ``object``). The most derived declaration wins, as at runtime.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Final

import mypy.checker  # noqa: F401 - imported first: loads mypy's modules in an order that works
from mypy.expandtype import expand_type_by_instance
from mypy.maptype import map_instance_to_supertype
from mypy.nodes import (
    AssignmentStmt,
    CallExpr,
    ClassDef,
    Decorator,
    Expression,
    FuncBase,
    FuncDef,
    LambdaExpr,
    ListExpr,
    MemberExpr,
    NameExpr,
    Node,
    OverloadedFuncDef,
    SetExpr,
    StrExpr,
    SymbolNode,
    SymbolTableNode,
    TupleExpr,
    TypeInfo,
    Var,
)
from mypy.subtypes import find_member, is_subtype
from mypy.types import AnyType, CallableType, Instance, PartialType, Type, get_proper_type
from mypy.typevars import fill_typevars

from .problems import ProblemKind

__all__ = [
    "ABSTRACT_MEMBERS",
    "METADATA_KEY",
    "ContractInfos",
    "HostReport",
    "StaticDeclaration",
    "StaticMember",
    "StaticProblem",
    "check_host",
    "contract_members",
    "host_instance",
    "init_attributes",
    "init_self_assignments",
    "label",
    "protocol_member_order",
    "protocol_members",
    "self_assigned_in_methods",
    "slot_names",
    "stored_names",
]

METADATA_KEY: Final = "staging_contracts"
"""Key of this plugin's per-class facts in ``TypeInfo.metadata`` (kept in mypy's cache)."""

ABSTRACT_MEMBERS: Final = "abstract_members"
"""Facts key: the members the plugin declared on an ``abstract=True`` base for type checking
(so that the mixin's methods accept it as ``self``). They are not declarations of the host:
the search for a member's declaration passes over them."""


@dataclass(frozen=True, slots=True)
class ContractInfos:
    """A contract as mypy sees it: the enforcing mixin, the host Protocol, and the names
    its ``Contract(...)`` marks optional and set later."""

    mixin: TypeInfo
    protocol: TypeInfo
    optional: frozenset[str] = frozenset()
    set_later: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class StaticMember:
    """One member of the contract with the type the Protocol gives it."""

    name: str
    expected: Type
    optional: bool
    method: bool = False
    """A method of the Protocol (its expected type is the method's, ``self`` bound)."""


@dataclass(frozen=True, slots=True)
class StaticDeclaration:
    """Where and how a host declares a member."""

    owner: TypeInfo
    """The most derived class of the MRO that declares it."""
    kind: str
    """``annotation``, ``class attribute``, ``property``, ``method``, ``__slots__`` or
    ``assigned in __init__`` (the runtime's ``DeclarationKind`` values, plus ``method``)."""
    declared: Type | None
    """The declared type as seen on the host, or ``None`` when unknown or not stated."""


@dataclass(frozen=True, slots=True)
class StaticProblem:
    """One problem of a host class, with the facts its message is built from: the member (for
    ``SHADOWED`` the mixin method), the Protocol's and the declared type, and the declaring
    class (``MISMATCHED``) or the shadowing base (``SHADOWED``)."""

    kind: ProblemKind
    member: str
    expected: Type | None = None
    actual: Type | None = None
    where: str = ""
    method: bool = False


@dataclass(frozen=True, slots=True)
class HostReport:
    """Everything the plugin found about one host class."""

    members: tuple[tuple[StaticMember, StaticDeclaration | None], ...]
    problems: tuple[StaticProblem, ...]


# --------------------------------------------------------------------------- the contract


def contract_members(contract: ContractInfos, host: Instance) -> list[StaticMember]:
    """The Protocol's members in definition order (bases first), with expected types.

    Annotated attributes and properties are attribute members, as ``Contract`` reads them at
    runtime; methods are method members; ``ClassVar`` attributes are not members.
    """
    proto = contract.protocol
    proto_instance = _host_instance(proto)
    if proto_instance is None:
        return []
    members: list[StaticMember] = []
    seen: set[str] = set()
    for klass in reversed(proto.mro):
        if not klass.is_protocol:
            continue
        for name in protocol_member_order(klass):
            sym = klass.names.get(name)
            node = sym.node if sym is not None else None
            if name in seen or node is None or not _is_member_node(node):
                continue
            seen.add(name)
            expected = find_member(name, proto_instance, host)
            if expected is None:
                continue
            method = _is_method_node(node)
            members.append(StaticMember(name, expected, name in contract.optional, method))
    return members


_INTERNAL_NAMES: Final = frozenset({"__init__", "__new__", "__init_subclass__", "__slots__"})


def _is_member_node(node: SymbolNode) -> bool:
    if isinstance(node, Var):
        return not node.is_classvar
    return isinstance(node, FuncBase | Decorator)


def _is_method_node(node: SymbolNode) -> bool:
    """A method (not a property, not an attribute)."""
    return isinstance(node, FuncBase | Decorator) and _property_getter(node) is None


def protocol_member_order(protocol: TypeInfo) -> list[str]:
    """The Protocol's own members (attributes, properties, methods) in definition order.

    mypy's cache keeps neither the order of a class's names nor their lines, so the plugin
    stores the order in the Protocol's metadata while the Protocol is analysed
    (:func:`protocol_members`) and reads it back for a Protocol loaded from the cache.
    Without either, the names are sorted: the order is then stable, if not the source's.
    """
    fresh = protocol_members(protocol)
    if fresh is not None:
        return fresh
    stored = stored_names(protocol, "members")
    if stored is not None:
        return stored
    return sorted(name for name, sym in protocol.names.items() if _is_own_member(name, sym))


def stored_names(info: TypeInfo, key: str) -> list[str] | None:
    """A list of names the plugin kept in ``info.metadata``, or ``None`` if it kept none."""
    facts = info.metadata.get(METADATA_KEY)
    stored = facts.get(key) if isinstance(facts, Mapping) else None
    return [str(name) for name in stored] if isinstance(stored, list) else None


def _is_own_member(name: str, sym: SymbolTableNode) -> bool:
    if name in _INTERNAL_NAMES or sym.node is None or sym.plugin_generated:
        return False
    return _is_member_node(sym.node)


def protocol_members(protocol: TypeInfo) -> list[str] | None:
    """The members a Protocol's body declares, by source line; ``None`` when unknown."""
    found = [
        (_node_line(sym.node), name)
        for name, sym in protocol.names.items()
        if _is_own_member(name, sym)
    ]
    if any(line <= 0 for line, _ in found):
        return None
    return [name for _, name in sorted(found)]


def _node_line(node: SymbolNode | None) -> int:
    if isinstance(node, OverloadedFuncDef) and node.items:
        return node.items[0].line
    return node.line if node is not None else -1


def provided_methods(mixin: TypeInfo) -> list[str]:
    """Names of the methods and properties the mixin provides (dunders excluded)."""
    names: dict[str, None] = {}
    for klass in mixin.mro:
        if klass.fullname == "builtins.object":
            continue
        for name, sym in klass.names.items():
            if name.startswith("__") and name.endswith("__"):
                continue
            if isinstance(sym.node, FuncBase | Decorator):
                names[name] = None
    return list(names)


# --------------------------------------------------------------------------- declarations


def _line_span(node: SymbolNode | None) -> tuple[int, int] | None:
    """First and last line of a method's source, or ``None`` when unknown (from the cache)."""
    if isinstance(node, OverloadedFuncDef):
        node = node.impl  # the overloads themselves have no body
    if isinstance(node, Decorator):
        node = node.func
    if isinstance(node, FuncDef) and node.line > 0 and node.end_line is not None:
        return node.line, node.end_line
    return None


def _is_self_assigned(sym: SymbolTableNode) -> bool:
    """An attribute defined by ``self.<name> = ...`` in a method, not in the class body.

    (Dataclass fields without a default are marked implicit too, but are class-level.)
    """
    return sym.implicit and isinstance(sym.node, Var) and not sym.node.is_initialized_in_class


def _implicit_attributes(info: TypeInfo) -> Iterator[tuple[str, Var]]:
    for name, sym in info.names.items():
        if _is_self_assigned(sym) and isinstance(sym.node, Var):
            yield name, sym.node


_CHILDREN: Final = (
    "body",
    "else_body",
    "finally_body",
    "handlers",
    "expr",
    "exprs",
    "callee",
    "args",
    "rvalue",
    "lvalues",
    "index",
    "target",
    "items",
    "left",
    "right",
    "operands",
    "cond",
    "if_expr",
    "else_expr",
    "value",
    "base",
)
"""Attributes of mypy's statement and expression nodes that hold child nodes."""


def _walk(root: Node) -> Iterator[Node]:
    """Every node under ``root`` in source order, nested scopes (functions, classes, lambdas)
    not entered.

    mypy's visitor classes are compiled and cannot be subclassed here, so the walk follows
    the child attributes of the nodes it meets (:data:`_CHILDREN`).
    """
    pending: list[object] = [root]
    while pending:
        node = pending.pop()
        if isinstance(node, list | tuple):
            pending.extend(reversed(node))
            continue
        if not isinstance(node, Node):
            continue
        if node is not root and isinstance(node, FuncBase | Decorator | ClassDef | LambdaExpr):
            continue  # another scope: its ``self`` is not ours
        yield node
        children = [getattr(node, attribute, None) for attribute in _CHILDREN]
        pending.extend(reversed([child for child in children if child is not None]))


def _self_calls(func: FuncDef) -> list[str]:
    """Names of the methods ``func`` calls as ``<self>.<name>(...)`` (nested scopes skipped)."""
    if not func.arguments:
        return []
    self_name = func.arguments[0].variable.name
    return [
        node.callee.name
        for node in _walk(func.body)
        if isinstance(node, CallExpr)
        and isinstance(node.callee, MemberExpr)
        and isinstance(node.callee.expr, NameExpr)
        and node.callee.expr.name == self_name
    ]


def _function(node: SymbolNode | None) -> FuncDef | None:
    if isinstance(node, OverloadedFuncDef):
        node = node.impl
    if isinstance(node, Decorator):
        if node.func.is_static or node.func.is_class or node.func.is_property:
            return None
        node = node.func
    return node if isinstance(node, FuncDef) and not node.is_static else None


def _init_functions(info: TypeInfo) -> list[FuncDef] | None:
    """``__init__`` and the methods of ``info`` it calls on ``self`` (transitively); ``None``
    when one has no source here: a class from mypy's cache, or of a module mypy has finished
    checking (it frees function bodies then; a function always has a statement)."""
    functions: list[FuncDef] = []
    pending = ["__init__"]
    seen: set[str] = set()
    while pending:
        name = pending.pop(0)
        if name in seen:
            continue
        seen.add(name)
        sym = info.names.get(name)
        func = _function(sym.node if sym is not None else None)
        if func is None:
            continue
        if _line_span(func) is None or not func.body.body:
            return None  # from the cache, or its body freed once its module was checked
        functions.append(func)
        pending.extend(_self_calls(func))
    return functions


def _init_spans(info: TypeInfo) -> list[tuple[int, int]] | None:
    """Line spans of ``__init__`` and of the methods of ``info`` it calls on ``self``."""
    functions = _init_functions(info)
    if functions is None:
        return None
    return [span for span in map(_line_span, functions) if span is not None]


def init_attributes(info: TypeInfo) -> frozenset[str] | None:
    """Names ``info``'s own ``__init__`` assigns as ``self.<name>``, itself or in the methods
    of ``info`` it calls on ``self`` (transitively); ``None`` when unknown.

    Computed from source lines when the class was analysed in this run; for a class loaded
    from mypy's cache, read from the facts the plugin stored in its metadata then.
    """
    if info.names.get("__init__") is None:
        return frozenset()
    spans = _init_spans(info)
    implicit = list(_implicit_attributes(info))
    if spans is not None and all(var.line > 0 for _, var in implicit):
        return frozenset(
            name
            for name, var in implicit
            if any(first <= var.line <= last for first, last in spans)
        )
    stored = stored_names(info, "init_attributes")
    return None if stored is None else frozenset(stored)


def slot_names(info: TypeInfo) -> frozenset[str] | None:
    """The names ``info``'s own ``__slots__`` lists; ``None`` when it has one that is unreadable.

    mypy keeps ``TypeInfo.slots`` only when every base has ``__slots__`` too, so the literal is
    read from the class body when it was analysed in this run, else from the plugin's facts.
    """
    if info.slots is not None:
        return frozenset(info.slots)
    if "__slots__" not in info.names:
        return frozenset()
    for stmt in info.defn.defs.body:
        if (
            isinstance(stmt, AssignmentStmt)
            and len(stmt.lvalues) == 1
            and isinstance(stmt.lvalues[0], NameExpr)
            and stmt.lvalues[0].name == "__slots__"
        ):
            return _literal_names(stmt.rvalue)
    stored = stored_names(info, "slots")
    return None if stored is None else frozenset(stored)


def _literal_names(expr: Expression) -> frozenset[str] | None:
    if isinstance(expr, StrExpr):
        return frozenset({expr.value})
    if isinstance(expr, TupleExpr | ListExpr | SetExpr) and all(
        isinstance(item, StrExpr) for item in expr.items
    ):
        return frozenset(item.value for item in expr.items if isinstance(item, StrExpr))
    return None


def has_implicit_attributes(info: TypeInfo) -> bool:
    """True when some method of ``info`` assigns an attribute no class declares."""
    return next(_implicit_attributes(info), None) is not None


def host_instance(host: TypeInfo) -> Instance | None:
    """``host`` as an instance type, its type variables filled with themselves."""
    filled = get_proper_type(fill_typevars(host))
    return filled if isinstance(filled, Instance) else None


_host_instance = host_instance


def _declared_type(host: TypeInfo, owner: TypeInfo, name: str, node: SymbolNode) -> Type | None:
    """The type a declaration gives the member on the host, or ``None`` when not known yet."""
    itype = _host_instance(host)
    if itype is None:
        return None
    getter = _property_getter(node)
    if getter is not None:
        sig = get_proper_type(getter.type)
        if not isinstance(sig, CallableType):
            return None
        return expand_type_by_instance(sig.ret_type, map_instance_to_supertype(itype, owner))
    if isinstance(node, Var):
        if node.type is None:
            return None  # inferred type not known yet: left to the runtime checks
        resolved = host.get(name)
        if resolved is not None and resolved.node is node:
            return find_member(name, itype, itype)  # honours descriptors' __get__
        return expand_type_by_instance(node.type, map_instance_to_supertype(itype, owner))
    if isinstance(node, FuncBase | Decorator):
        resolved = host.get(name)
        if resolved is not None and resolved.node is node:
            return find_member(name, itype, itype)
    return None


def _property_getter(node: SymbolNode) -> FuncDef | None:
    if isinstance(node, Decorator) and node.func.is_property:
        return node.func
    if isinstance(node, OverloadedFuncDef) and node.is_property and node.items:
        first = node.items[0]
        if isinstance(first, Decorator):
            return first.func
    return None


def _kind(sym: SymbolTableNode, node: SymbolNode) -> str:
    if _is_self_assigned(sym):
        return "assigned in __init__"
    if _property_getter(node) is not None:
        return "property"
    if isinstance(node, FuncBase | Decorator):
        return "method"
    if isinstance(node, Var) and not node.is_inferred:
        return "annotation"
    return "class attribute"


def find_declaration(
    host: TypeInfo, name: str, excluded: frozenset[str]
) -> StaticDeclaration | None:
    """The most derived declaration of ``name`` in ``host``'s MRO, skipping ``excluded``.

    A member the plugin declared on an ``abstract=True`` base (:data:`ABSTRACT_MEMBERS`) is no
    declaration; an assignment to it in the ``__init__`` of that base or of a more derived
    class is (mypy binds such an assignment to the plugin's member, so it leaves no symbol of
    its own).

    Args:
        host: the class being checked.
        name: the member.
        excluded: fullnames of the classes whose declarations do not count.
    """
    for owner in host.mro:
        if owner.fullname in excluded:
            continue
        sym = owner.names.get(name)
        if sym is not None and sym.node is not None:
            if name in (stored_names(owner, ABSTRACT_MEMBERS) or ()):
                assigner = _init_assigner(host, owner, name, excluded)
                if assigner is not None:
                    return StaticDeclaration(assigner, "assigned in __init__", None)
                continue
            if _is_self_assigned(sym):
                assigned = init_attributes(owner)
                if assigned is not None and name not in assigned:
                    continue  # assigned in another method: not a declaration
            declared = _declared_type(host, owner, name, sym.node)
            return StaticDeclaration(owner, _kind(sym, sym.node), declared)
        slots = slot_names(owner)
        if slots is None or name in slots:  # unreadable __slots__ may declare it: no alarm
            return StaticDeclaration(owner, "__slots__", None)
    return None


def _init_assigner(
    host: TypeInfo, base: TypeInfo, name: str, excluded: frozenset[str]
) -> TypeInfo | None:
    """The most derived class from ``host`` down to ``base`` (included) whose ``__init__``
    assigns ``self.<name>``, or ``None``."""
    for owner in host.mro:
        if owner.fullname not in excluded and name in (init_self_assignments(owner) or ()):
            return owner
        if owner is base:
            return None
    return None


def init_self_assignments(info: TypeInfo) -> frozenset[str] | None:
    """Every ``self.<name>`` that ``info``'s ``__init__`` (or a method of ``info`` it calls
    on ``self``) assigns, whether or not mypy made it a symbol of ``info``; ``None`` when
    unknown (a class from mypy's cache without the plugin's facts)."""
    if info.names.get("__init__") is None:
        return frozenset()
    functions = _init_functions(info)
    if functions is None:
        stored = stored_names(info, "init_assigned")
        return None if stored is None else frozenset(stored)
    found: set[str] = set()
    for func in functions:
        if not func.arguments:
            continue
        self_name = func.arguments[0].variable.name
        for node in _walk(func.body):
            if isinstance(node, AssignmentStmt):
                for target in _flat_targets(node.lvalues):
                    if (
                        isinstance(target, MemberExpr)
                        and isinstance(target.expr, NameExpr)
                        and target.expr.name == self_name
                    ):
                        found.add(target.name)
    return frozenset(found)


def self_assigned_in_methods(info: TypeInfo) -> frozenset[str]:
    """Every ``self.<name>`` some method in ``info``'s class body assigns, read from the syntax
    tree (so also during semantic analysis, before mypy analysed the methods' bodies)."""
    found: set[str] = set()
    for stmt in info.defn.defs.body:
        func = _function(stmt) if isinstance(stmt, SymbolNode) else None
        if func is None or not func.arguments:
            continue
        self_name = func.arguments[0].variable.name
        for node in _walk(func.body):
            if isinstance(node, AssignmentStmt):
                for target in _flat_targets(node.lvalues):
                    if (
                        isinstance(target, MemberExpr)
                        and isinstance(target.expr, NameExpr)
                        and target.expr.name == self_name
                    ):
                        found.add(target.name)
    return frozenset(found)


def _flat_targets(targets: list[Expression]) -> list[Expression]:
    flat: list[Expression] = []
    for target in targets:
        if isinstance(target, TupleExpr | ListExpr):
            flat.extend(_flat_targets(list(target.items)))
        else:
            flat.append(target)
    return flat


# --------------------------------------------------------------------------- the check


def _compatible(declared: Type, expected: Type) -> bool:
    if isinstance(get_proper_type(declared), AnyType | PartialType):
        return True  # unknown, or not inferred yet: left to the runtime checks
    return is_subtype(declared, expected)


def label(owner: TypeInfo, host: TypeInfo, mixin: TypeInfo) -> str:
    """``owner``'s name in a message about ``host``: its full name when it shares its short
    name with ``host`` or the mixin without being that class (as at runtime)."""
    namesakes = [k for k in (host, mixin) if k.fullname != owner.fullname]
    return owner.fullname if any(k.name == owner.name for k in namesakes) else owner.name


def _shadowing(host: TypeInfo, contract: ContractInfos) -> Iterator[StaticProblem]:
    mixin = contract.mixin
    mixin_mro = frozenset(k.fullname for k in mixin.mro)
    before_mixin = host.mro[: host.mro.index(mixin)] if mixin in host.mro else host.mro
    searched = [(method, host.mro) for method in provided_methods(mixin)]
    if contract.set_later:
        # the mixin gains its checking __setattr__ at runtime: only a base before it hides it
        searched.append(("__setattr__", before_mixin))
    for method, mro in searched:
        owner = next((k for k in mro if method in k.names), None)
        if owner is None or owner.fullname in mixin_mro or owner.has_base(mixin.fullname):
            continue
        yield StaticProblem(ProblemKind.SHADOWED, method, where=label(owner, host, mixin))


def check_host(host: TypeInfo, contract: ContractInfos) -> HostReport:
    """Judge ``host`` against ``contract``: each member's declaration, and every problem.

    Members whose declared type is unknown (not inferred yet, or ``Any``) are not judged:
    whatever cannot be decided statically is left to the runtime checks.
    """
    itype = _host_instance(host)
    if itype is None:
        return HostReport((), ())
    excluded = frozenset(k.fullname for k in contract.mixin.mro)
    rows: list[tuple[StaticMember, StaticDeclaration | None]] = []
    problems: list[StaticProblem] = []
    for member in contract_members(contract, itype):
        decl = find_declaration(host, member.name, excluded)
        rows.append((member, decl))
        if decl is None:
            if not member.optional:
                problems.append(
                    StaticProblem(
                        ProblemKind.MISSING, member.name, member.expected, method=member.method
                    )
                )
        elif decl.declared is not None and not _compatible(decl.declared, member.expected):
            problems.append(
                StaticProblem(
                    ProblemKind.MISMATCHED,
                    member.name,
                    member.expected,
                    actual=decl.declared,
                    where=label(decl.owner, host, contract.mixin),
                    method=member.method,
                )
            )
    problems.extend(_shadowing(host, contract))
    return HostReport(tuple(rows), tuple(problems))
