"""mypy plugin: report a host that breaks its contract at its ``class`` statement.

The static twin of the class-creation check of every enforcing mixin: ours
(:class:`~staging_contracts.mixin.StagingManagerMixin`) and any other class created with
``ContractMixin, contract=Contract(P, ...)``, in any package (a serving stack's own mixin over
its own Protocol included). Enable it in the mypy configuration::

    [mypy]
    plugins = staging_contracts.mypy_plugin

or, in ``pyproject.toml``::

    [tool.mypy]
    plugins = ["staging_contracts.mypy_plugin"]

For every class that has an enforcing mixin in its MRO (directly or through a base, as Ascend
through Mooncake), except one created with ``abstract=True``, mypy then reports at the class
statement

* each required member of the mixin's Protocol (attribute, property or method) that no class
  of the MRO declares (``staging-missing-member``),
* each declared type, or method signature, that is not a subtype of the Protocol's
  (``staging-member-type``),
* each method of the mixin shadowed by a base listed before the mixin
  (``staging-shadowed-method``),

worded like :class:`~staging_contracts._contract.problems.ContractError`, one error per problem,
with type names qualified by their module where two of them share a short name. The members
and their types come from the Protocol as mypy sees it; the names the ``Contract(...)`` marks
``optional`` are checked only when declared. The contract is read from the mixin's
``contract=`` keyword (:mod:`~staging_contracts._contract.mypy_contracts` says which forms);
one the plugin cannot read is a note at the mixin's class statement, and its hosts are left to
the runtime checks.

An intermediate base created with ``abstract=True`` declares only some of the members; the
plugin declares the others on it, with the Protocol's types, for type checking only, so that
the mixin's methods (whose ``self`` is the Protocol) can be called on it: ``class
AcmeBase(StagingManagerMixin, CommonKVManager, abstract=True)`` may call
``self._dispatch_staging(frames)`` and ``staging_idle(self)``. Those declarations do not count
for its subclasses: a concrete subclass must still declare each member itself (or assign it
in ``__init__``), or mypy reports it as missing, as at runtime.

How: mypy type-checks the implicit ``__init_subclass__`` call of every class statement, after
the class body (so attributes assigned in ``__init__`` are known). The plugin's method hook
sees that call, finds the class being defined, and judges it. Classes whose metaclass is not
``type`` or ``ABCMeta`` are not seen (mypy skips that call for them); the runtime check
still applies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from mypy.checker import TypeChecker
from mypy.errorcodes import ErrorCode
from mypy.messages import format_type, format_type_distinctly, pretty_callable
from mypy.nodes import (
    GDEF,
    MDEF,
    CallExpr,
    ClassDef,
    MemberExpr,
    NameExpr,
    SymbolTable,
    SymbolTableNode,
    TypeInfo,
    Var,
)
from mypy.options import Options
from mypy.plugin import (
    ClassDefContext,
    DynamicClassDefContext,
    MethodContext,
    Plugin,
    ReportConfigContext,
)
from mypy.types import CallableType, PartialType, Type, get_proper_type

from ._contract import mypy_analysis, mypy_contracts
from ._contract.mypy_analysis import (
    ABSTRACT_MEMBERS,
    METADATA_KEY,
    ContractInfos,
    HostReport,
    StaticProblem,
    check_host,
    contract_members,
    has_implicit_attributes,
    init_attributes,
    init_self_assignments,
    protocol_members,
    self_assigned_in_methods,
    slot_names,
    stored_names,
)
from ._contract.mypy_contracts import (
    CONTRACT_CLASS,
    CONTRACT_MIXIN,
    FACTS_KEY,
    ContractFacts,
    facts_symbol,
    read_call,
    read_contract,
)
from ._contract.problems import ProblemKind

__all__ = [
    "MEMBER_TYPE",
    "MISSING_MEMBER",
    "SHADOWED_METHOD",
    "UNREAD_CONTRACT",
    "StagingContractsPlugin",
    "plugin",
]

PLUGIN_VERSION: Final = "3"
"""Bumped whenever what the plugin reports or stores changes (invalidates mypy's cache)."""

_CATEGORY: Final = "staging-contracts"

MISSING_MEMBER: Final = ErrorCode(
    "staging-missing-member",
    "A staging host declares a required member of its contract nowhere in its MRO",
    _CATEGORY,
)
MEMBER_TYPE: Final = ErrorCode(
    "staging-member-type",
    "A staging host declares a contract member with a type incompatible with the Protocol's",
    _CATEGORY,
)
SHADOWED_METHOD: Final = ErrorCode(
    "staging-shadowed-method",
    "A base listed before the staging mixin shadows one of the mixin's methods",
    _CATEGORY,
)
UNREAD_CONTRACT: Final = ErrorCode(
    "staging-unread-contract",
    "An enforcing mixin's contract= is not a form the plugin can read statically",
    _CATEGORY,
)
_CODES: Final = {
    ProblemKind.MISSING: MISSING_MEMBER,
    ProblemKind.MISMATCHED: MEMBER_TYPE,
    ProblemKind.SHADOWED: SHADOWED_METHOD,
}


_ROOT_KEY: Final = "contract_root"
"""Facts key of an enforcing mixin: its :class:`ContractFacts` (JSON)."""

_PROTOCOL_DIGEST_KEY: Final = "contract_protocol"
"""Facts key of an enforcing mixin: a digest of its Protocol's members and their types.

Kept so that editing the Protocol (in another module, say) changes the mixin's module as
mypy's cache sees it, and modules whose hosts use the mixin are checked again.
"""


def _source_digest() -> str:
    """A digest of the plugin's own source, so that editing it invalidates mypy's cache."""
    digest = hashlib.sha256()
    for path in (Path(__file__), Path(mypy_analysis.__file__), Path(mypy_contracts.__file__)):
        try:
            digest.update(path.read_bytes())
        except OSError:
            digest.update(path.name.encode())
    return digest.hexdigest()[:16]


class StagingContractsPlugin(Plugin):
    """Checks staging hosts against their contract at their class statement.

    Args:
        options: mypy's options (passed by mypy).
    """

    def __init__(self, options: Options) -> None:
        super().__init__(options)
        self._config: Final = {
            "plugin": __name__,
            "version": PLUGIN_VERSION,
            "source": _source_digest(),
        }

    def report_config_data(self, ctx: ReportConfigContext) -> Any:
        """What invalidates mypy's cache of a module: this plugin's version and source.

        The same for every module: what the plugin stores or reports may concern any class.
        """
        return self._config

    def get_base_class_hook(self, fullname: str) -> Callable[[ClassDefContext], None] | None:
        """Keep the member order of the Protocols in every class's MRO (any base will do), and
        declare the missing members of an ``abstract=True`` base for type checking.

        Semantic-analysis hooks also run for modules whose errors mypy silences (installed
        packages), where the type-checking hook below does not.
        """
        return self._on_class_def

    def _on_class_def(self, ctx: ClassDefContext) -> None:
        _remember_protocol_order(ctx)
        info = ctx.cls.info
        if "contract" in ctx.cls.keywords and info.has_base(CONTRACT_MIXIN):
            _remember_contract(ctx)
            return
        if not _is_abstract(ctx.cls) or info.is_protocol:
            return
        for contract in self._contracts_of(info):
            _declare_for_type_checking(ctx, info, contract)

    def get_dynamic_class_hook(
        self, fullname: str
    ) -> Callable[[DynamicClassDefContext], None] | None:
        """Read ``NAME = Contract(...)`` where it is bound, for mixins of other modules."""
        if fullname == CONTRACT_CLASS:
            return _remember_contract_binding
        return None

    def get_method_hook(self, fullname: str) -> Callable[[MethodContext], Type] | None:
        """Hook the implicit ``Base.__init_subclass__(**keywords)`` call of class statements."""
        if fullname.endswith(".__init_subclass__"):
            return self._on_init_subclass
        return None

    def _on_init_subclass(self, ctx: MethodContext) -> Type:
        info = _class_being_defined(ctx)
        if info is not None:
            # Facts mypy's cache would lose, kept for when this class comes from the cache.
            if has_implicit_attributes(info):
                _store(info, "init_attributes", sorted(init_attributes(info) or ()))
            assigned = init_self_assignments(info)
            if assigned:
                _store(info, "init_assigned", sorted(assigned))
            slots = slot_names(info)
            if slots:
                _store(info, "slots", sorted(slots))
            for contract in self._contracts_of(info):
                _check(info, contract, ctx)
        return ctx.default_return_type

    def _contracts_of(self, info: TypeInfo) -> list[ContractInfos]:
        """The contracts of the enforcing mixins in ``info``'s MRO (``info`` itself excluded)."""
        found: list[ContractInfos] = []
        if info.is_protocol:
            return found
        for root in info.mro[1:]:
            facts = ContractFacts.from_json(root.metadata.get(METADATA_KEY, {}).get(_ROOT_KEY))
            if facts is None:
                continue
            protocol = self._typeinfo(facts.protocol)
            if protocol is not None:
                found.append(
                    ContractInfos(
                        root, protocol, frozenset(facts.optional), frozenset(facts.set_later)
                    )
                )
        return found

    def _typeinfo(self, fullname: str) -> TypeInfo | None:
        sym = self.lookup_fully_qualified(fullname)
        return sym.node if sym is not None and isinstance(sym.node, TypeInfo) else None


def _remember_contract(ctx: ClassDefContext) -> None:
    """Keep the contract of an enforcing mixin's class statement in its metadata (or say, once,
    why it cannot be read statically)."""
    modules: mypy_contracts.ModuleLookup = getattr(ctx.api, "modules", {})
    module = ctx.cls.info.module_name
    facts = read_contract(ctx.cls.keywords["contract"], modules, module)
    if isinstance(facts, str):
        if not ctx.api.final_iteration:
            ctx.api.defer()
            return
        note = getattr(ctx.api, "note", None)
        if callable(note):
            note(
                f'the contract of "{ctx.cls.name}" cannot be read statically ({facts}): its '
                "hosts are checked at runtime only",
                ctx.cls,
                code=UNREAD_CONTRACT,
            )
        return
    _store(ctx.cls.info, _ROOT_KEY, facts.to_json())
    protocol = ctx.api.lookup_fully_qualified_or_none(facts.protocol)
    if protocol is not None and isinstance(protocol.node, TypeInfo):
        _store(ctx.cls.info, _PROTOCOL_DIGEST_KEY, _protocol_digest(protocol.node))


def _protocol_digest(protocol: TypeInfo) -> str:
    """A digest of the members (names and types) of ``protocol`` and its Protocol bases."""
    digest = hashlib.sha256()
    for klass in protocol.mro:
        if not klass.is_protocol:
            continue
        digest.update(klass.fullname.encode())
        for name in sorted(klass.names):
            node = klass.names[name].node
            digest.update(f"\0{name}:{type(node).__name__}:{getattr(node, 'type', None)}".encode())
    return digest.hexdigest()[:16]


def _remember_contract_binding(ctx: DynamicClassDefContext) -> None:
    """Keep the facts of a module-level ``NAME = Contract(...)`` in its module's symbol table
    (:func:`~staging_contracts._contract.mypy_contracts.facts_symbol`), where a mixin of another
    module finds them once this module's syntax tree is gone. A binding inside a function is
    read from the syntax tree of the module being analysed, which is still there."""
    api = ctx.api
    is_func_scope = getattr(api, "is_func_scope", None)
    if not callable(is_func_scope) or is_func_scope():
        return
    facts = read_call(ctx.call)
    if isinstance(facts, str):
        return  # the mixin that names it says why, once
    name = facts_symbol(ctx.name)
    kept = api.lookup_fully_qualified_or_none(api.qualified_name(name))
    if kept is None or not isinstance(kept.node, TypeInfo):
        info = api.basic_new_typeinfo(name, api.named_type("builtins.object"), ctx.call.line)
        api.add_symbol_table_node(name, SymbolTableNode(GDEF, info, plugin_generated=True))
    else:
        info = kept.node
    _store(info, FACTS_KEY, facts.to_json())


def _declare_for_type_checking(
    ctx: ClassDefContext, info: TypeInfo, contract: ContractInfos
) -> None:
    """Declare on an ``abstract=True`` base each required member no class of its MRO declares,
    with the Protocol's type, and note them (:data:`ABSTRACT_MEMBERS`) so that the contract
    check of its subclasses passes over them. Runs again, harmlessly, when mypy defers."""
    excluded = frozenset(k.fullname for k in contract.mixin.mro)
    added = stored_names(info, ABSTRACT_MEMBERS) or []
    assigned = self_assigned_in_methods(info)  # mypy declares those once it reads the methods
    host = mypy_analysis.host_instance(info)
    if host is None:
        return
    for member in contract_members(contract, host):
        name = member.name
        if member.optional or name in added or name in assigned:
            continue
        owner = next((k for k in info.mro if name in k.names), None)
        if owner is not None and owner.fullname not in excluded:
            continue  # declared (or assigned somewhere) by a class of the host
        if isinstance(member.expected, PartialType) or member.expected is None:
            if not ctx.api.final_iteration:
                ctx.api.defer()
            return
        var = Var(name, member.expected)
        var.info = info
        var._fullname = f"{info.fullname}.{name}"
        info.names[name] = SymbolTableNode(MDEF, var, plugin_generated=True)
        added.append(name)
    if added:
        _store(info, ABSTRACT_MEMBERS, added)


def _remember_protocol_order(ctx: ClassDefContext) -> None:
    for klass in ctx.cls.info.mro:
        if klass.is_protocol and not klass.metadata.get(METADATA_KEY, {}).get("members"):
            order = protocol_members(klass)
            if order:
                _store(klass, "members", order)


# --------------------------------------------------------------------------- finding the class


def _class_being_defined(ctx: MethodContext) -> TypeInfo | None:
    """The class of a class statement whose implicit ``__init_subclass__`` call this is.

    mypy builds that call as ``<Name>.__init_subclass__(**keywords)`` at the class line, with
    ``<Name>`` bound to the first base that defines ``__init_subclass__``; an explicit call
    looks different (a ``super()`` callee, or a name bound to the class itself).
    """
    call = ctx.context
    api = ctx.api
    if not (
        isinstance(call, CallExpr)
        and isinstance(call.callee, MemberExpr)
        and isinstance(call.callee.expr, NameExpr)
        and isinstance(api, TypeChecker)
    ):
        return None
    target = call.callee.expr
    base = target.node
    if not isinstance(base, TypeInfo):
        return None
    # With nothing but object above, no contract mixin is in the MRO: the class is looked up
    # only to keep its __init__ facts, and not searched for among nested classes.
    nested = base.fullname != "builtins.object"
    info = _lookup_class(api.globals, api.tree.fullname, target.name, call.line, nested=nested)
    if info is None or info is base or base not in info.mro[1:]:
        return None
    return info


def _lookup_class(
    names: SymbolTable, module: str, name: str, line: int, *, nested: bool
) -> TypeInfo | None:
    # Module-level classes by name; classes in functions as "Name@line" (mypy keeps those in
    # the module table for its cache); classes nested in classes through their parents.
    for key in (f"{name}@{line}", name):
        sym = names.get(key)
        if sym is not None and _is_class_at(sym.node, name, line):
            return sym.node if isinstance(sym.node, TypeInfo) else None
    if not nested:
        return None
    for sym in names.values():
        node = sym.node
        if isinstance(node, TypeInfo) and node.module_name == module:
            found = _lookup_nested(node, name, line)
            if found is not None:
                return found
    return None


def _lookup_nested(parent: TypeInfo, name: str, line: int) -> TypeInfo | None:
    for sym in parent.names.values():
        node = sym.node
        if not isinstance(node, TypeInfo) or not node.fullname.startswith(parent.fullname + "."):
            continue
        if _is_class_at(node, name, line):
            return node
        nested = _lookup_nested(node, name, line)
        if nested is not None:
            return nested
    return None


def _is_class_at(node: object, name: str, line: int) -> bool:
    return isinstance(node, TypeInfo) and node.name == name and node.line == line


# --------------------------------------------------------------------------- judging it


def _is_abstract(defn: ClassDef) -> bool:
    """``abstract=True`` among the class keywords (any value but a literal ``False`` counts)."""
    keyword = defn.keywords.get("abstract")
    if keyword is None:
        return False
    return not (isinstance(keyword, NameExpr) and keyword.fullname == "builtins.False")


def _check(info: TypeInfo, contract: ContractInfos, ctx: MethodContext) -> None:
    abstract = _is_abstract(info.defn)
    report = check_host(info, contract)
    _store(info, "contract", _facts(report, contract, abstract=abstract))
    if abstract:
        return
    mixin = contract.mixin
    namesake = any(p.where.rpartition(".")[2] == mixin.name for p in report.problems)
    header = (
        f"{info.name} does not satisfy the {contract.protocol.name} contract "
        f"of {mixin.fullname if namesake else mixin.name}: "
    )
    for problem in report.problems:
        text = header + _describe(problem, ctx.api.options)
        ctx.api.fail(text, ctx.context, code=_CODES[problem.kind])


def _describe(problem: StaticProblem, options: Options) -> str:
    """The fragment of :meth:`ContractProblem.describe`, quoted the way mypy quotes; two types
    that share a short name are written with their modules."""
    if problem.kind is ProblemKind.SHADOWED:
        return (
            f'method "{problem.member}" of the mixin is shadowed by base "{problem.where}", '
            "which is listed before the mixin"
        )
    if problem.kind is ProblemKind.MISSING:
        return f'has no declaration of "{problem.member}" (expected {_expected(problem, options)})'
    declared = get_proper_type(problem.actual) if problem.actual is not None else None
    if problem.method and isinstance(declared, CallableType):
        actual = f'a method "{pretty_callable(declared, options)}"'
        expected = _expected(problem, options)
    elif problem.expected is None or problem.actual is None:
        expected, actual = _format(problem.expected, options), _format(problem.actual, options)
    else:
        actual, expected = format_type_distinctly(problem.actual, problem.expected, options=options)
    return f'declares "{problem.member}" as {actual} in {problem.where} (expected {expected})'


def _expected(problem: StaticProblem, options: Options) -> str:
    typ = get_proper_type(problem.expected) if problem.expected is not None else None
    if problem.method and isinstance(typ, CallableType):
        return f'a method "{pretty_callable(typ, options)}"'
    return _format(problem.expected, options)


def _format(typ: Type | None, options: Options) -> str:
    return '"?"' if typ is None else format_type(typ, options)


def _facts(report: HostReport, contract: ContractInfos, *, abstract: bool) -> dict[str, Any]:
    """JSON-ready facts about a host, kept in its ``TypeInfo.metadata``."""

    def names(kind: ProblemKind) -> list[str]:
        return [p.member for p in report.problems if p.kind is kind]

    return {
        "mixin": contract.mixin.fullname,
        "protocol": contract.protocol.fullname,
        "abstract": abstract,
        "declared": {
            member.name: {"in": decl.owner.fullname, "kind": decl.kind}
            for member, decl in report.members
            if decl is not None
        },
        "missing": names(ProblemKind.MISSING),
        "mismatched": names(ProblemKind.MISMATCHED),
        "shadowed": names(ProblemKind.SHADOWED),
    }


def _store(info: TypeInfo, key: str, value: object) -> None:
    facts = info.metadata.setdefault(METADATA_KEY, {})
    facts[key] = value


def plugin(version: str) -> type[Plugin]:
    """mypy's entry point: the plugin class (any mypy version with this plugin API)."""
    return StagingContractsPlugin
