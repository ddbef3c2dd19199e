"""Where and how a class declares a member: annotation, attribute, property, descriptor, slot."""

from __future__ import annotations

import ast
import enum
import functools
import inspect
import textwrap
import types
from dataclasses import dataclass
from typing import Final

from .signatures import signature_text
from .typeforms import resolve_annotation, type_name

__all__ = [
    "Declaration",
    "DeclarationKind",
    "find_declaration",
    "init_assignment_sites",
    "init_assignments",
    "provided_methods",
]

_LITERAL_TYPES: Final = (type(None), bool, int, float, complex, str, bytes)


class DeclarationKind(enum.Enum):
    """How a class declares a member."""

    ANNOTATION = "annotation"
    ATTRIBUTE = "class attribute"
    PROPERTY = "property"
    DESCRIPTOR = "descriptor"
    SLOT = "__slots__"
    INIT = "assigned in __init__"
    """``self.<name> = ...`` in ``__init__``, or in a method of the same class that ``__init__``
    calls on ``self`` (then :attr:`Declaration.via` names it)."""
    METHOD = "method"
    """A function, ``classmethod``, ``staticmethod`` or other callable object in the class body
    (:attr:`Declaration.declared` is that value)."""


@dataclass(frozen=True, slots=True)
class Declaration:
    """Where and how a member is declared on a host class."""

    owner: type
    """The class in the MRO whose body declares it (the most derived one)."""
    kind: DeclarationKind
    """Annotation, class attribute, property, descriptor, slot or ``__init__`` assignment."""
    declared: object
    """The declared type (resolved when ``resolved``), or ``None`` when none is stated; for a
    ``METHOD``, the class body's value (the function)."""
    resolved: bool
    """False for a string or forward reference that cannot be evaluated at class creation."""
    via: str | None = None
    """For an ``INIT`` declaration made in a method ``__init__`` calls: that method's name."""

    @property
    def how(self) -> str:
        """How it is declared, as text: the kind, and for ``INIT`` the method if not ``__init__``
        (``assigned in _init_ctx, which __init__ calls``)."""
        if self.kind is DeclarationKind.INIT and self.via is not None:
            return f"assigned in {self.via}, which __init__ calls"
        return self.kind.value

    @property
    def declared_name(self) -> str:
        """The declared type as text, ``'-'`` when the declaration states no type; for a
        method, ``a method (PARAMS)``."""
        if self.kind is DeclarationKind.METHOD:
            return f"a method {signature_text(self.declared)}"
        if self.declared is None and self.kind is not DeclarationKind.ANNOTATION:
            return "-"
        return type_name(self.declared)


def find_declaration(cls: type, name: str, excluded: frozenset[type]) -> Declaration | None:
    """The most derived declaration of ``name`` in ``cls``'s MRO, skipping ``excluded`` classes.

    A member counts as declared by a class annotation, a class attribute, a property or other
    descriptor, a ``__slots__`` entry, or an assignment ``self.<name> = ...`` in the class's
    own ``__init__`` or in a method of the same class that ``__init__`` calls on ``self``
    (``self._init_ctx()``), directly or through another such method (found by reading their
    source; ``self.<name>: T = ...`` declares ``T``). Returns ``None`` when no class declares
    it.
    """
    for owner in cls.__mro__:
        if owner in excluded:
            continue
        namespace = owner.__dict__
        annotations = inspect.get_annotations(owner)
        if name in annotations:
            declared, resolved = resolve_annotation(annotations[name], owner)
            return Declaration(owner, DeclarationKind.ANNOTATION, declared, resolved)
        if name in namespace:
            return _declaration_from_attribute(owner, name, namespace[name])
        if name in _slot_names(owner):
            return Declaration(owner, DeclarationKind.SLOT, None, True)
        sites = init_assignment_sites(owner)
        if name in sites:
            raw, method = sites[name]
            via = None if method == "__init__" else method
            if raw is None:
                return Declaration(owner, DeclarationKind.INIT, None, True, via)
            declared, resolved = resolve_annotation(raw, owner)
            return Declaration(owner, DeclarationKind.INIT, declared, resolved, via)
    return None


def init_assignments(owner: type) -> dict[str, str | None]:
    """Attributes that ``owner``'s own ``__init__`` assigns on ``self``, itself or through the
    methods of ``owner`` it calls on ``self`` (see :func:`init_assignment_sites`).

    Returns:
        Attribute name -> its annotation's source text (``self.x: int = ...``), or ``None``
        when unannotated. Empty when the class defines no ``__init__`` or its source cannot
        be read (built-in, generated, or defined interactively).
    """
    return {name: raw for name, (raw, _) in init_assignment_sites(owner).items()}


def init_assignment_sites(owner: type) -> dict[str, tuple[str | None, str]]:
    """Where ``owner``'s own ``__init__`` assigns attributes on ``self``.

    Reads ``__init__``, then every method defined in ``owner`` itself (a plain function of
    its ``__dict__``) that ``__init__`` calls as ``self.<method>(...)``, and the methods of
    ``owner`` those call on ``self`` in turn. Methods of other classes, and methods called
    any other way, are not read.

    Returns:
        Attribute name -> (its annotation's source text or ``None``, the name of the method
        that assigns it: ``"__init__"`` when ``__init__`` does). ``__init__``'s own
        assignments come first; an annotation found anywhere wins over a plain assignment.
    """
    found: dict[str, tuple[str | None, str]] = {}
    pending = ["__init__"]
    seen: set[str] = set()
    while pending:
        method = pending.pop(0)
        if method in seen:
            continue
        seen.add(method)
        code = _own_code(owner, method)
        if code is None:
            continue
        assigned, called = _assignments_in(code)
        for name, raw in assigned:
            known = found.get(name)
            if known is None or (known[0] is None and raw is not None):
                found[name] = (raw, method)
        pending.extend(called)
    return found


def _own_code(owner: type, method: str) -> types.CodeType | None:
    """The code of a plain function ``owner`` itself defines as ``method``, else ``None``."""
    value = owner.__dict__.get(method)
    if value is None or isinstance(value, staticmethod | classmethod | property | type):
        return None
    func = inspect.unwrap(value) if callable(value) else value
    code = getattr(func, "__code__", None)
    return code if isinstance(code, types.CodeType) else None


@functools.lru_cache(maxsize=512)
def _assignments_in(
    code: types.CodeType,
) -> tuple[tuple[tuple[str, str | None], ...], tuple[str, ...]]:
    """The ``self`` attributes a function assigns, and the methods it calls on ``self``."""
    try:
        source = textwrap.dedent(inspect.getsource(code))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return (), ()
    function = tree.body[0] if tree.body else None
    if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef) or not function.args.args:
        return (), ()
    self_name = function.args.args[0].arg
    found: dict[str, str | None] = {}
    called: dict[str, None] = {}
    pending: list[ast.AST] = list(reversed(function.body))
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue  # another scope: its ``self`` is not ours
        if isinstance(node, ast.AnnAssign):
            name = _self_attribute(node.target, self_name)
            if name is not None:
                found[name] = ast.unparse(node.annotation)
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets: list[ast.expr] = (
                list(node.targets) if isinstance(node, ast.Assign) else [node.target]
            )
            for target in _flatten(targets):
                name = _self_attribute(target, self_name)
                if name is not None:
                    found.setdefault(name, None)
        elif isinstance(node, ast.Call):
            method = _self_attribute(node.func, self_name)
            if method is not None:
                called.setdefault(method, None)
        pending.extend(reversed(list(ast.iter_child_nodes(node))))
    return tuple(found.items()), tuple(called)


def _flatten(targets: list[ast.expr]) -> list[ast.expr]:
    flat: list[ast.expr] = []
    for target in targets:
        if isinstance(target, ast.Tuple | ast.List):
            flat.extend(_flatten(list(target.elts)))
        else:
            flat.append(target)
    return flat


def _self_attribute(target: ast.expr, self_name: str) -> str | None:
    if (
        isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == self_name
    ):
        return target.attr
    return None


def _declaration_from_attribute(owner: type, name: str, attr: object) -> Declaration:
    if isinstance(attr, property):
        declared: object = None
        resolved = True
        if attr.fget is not None:
            raw = getattr(attr.fget, "__annotations__", {}).get("return")
            if raw is not None:
                declared, resolved = resolve_annotation(raw, owner)
        return Declaration(owner, DeclarationKind.PROPERTY, declared, resolved)
    if name in _slot_names(owner):
        return Declaration(owner, DeclarationKind.SLOT, None, True)
    if isinstance(attr, staticmethod | classmethod) or (
        callable(attr) and not isinstance(attr, type)
    ):
        return Declaration(owner, DeclarationKind.METHOD, attr, True)
    if hasattr(type(attr), "__get__") and not callable(attr):
        return Declaration(owner, DeclarationKind.DESCRIPTOR, None, True)
    if type(attr) in _LITERAL_TYPES:
        return Declaration(owner, DeclarationKind.ATTRIBUTE, type(attr), True)
    return Declaration(owner, DeclarationKind.ATTRIBUTE, None, True)


def _slot_names(owner: type) -> tuple[str, ...]:
    slots = owner.__dict__.get("__slots__", ())
    if isinstance(slots, str):
        return (slots,)
    return tuple(slots)


def provided_methods(mixin: type) -> tuple[str, ...]:
    """Names of the methods and properties a mixin provides (dunders excluded)."""
    names: dict[str, None] = {}
    for klass in mixin.__mro__:
        if klass is object:
            continue
        for name, value in vars(klass).items():
            if name.startswith("__") and name.endswith("__"):
                continue
            if isinstance(value, staticmethod | classmethod | property) or (
                callable(value) and not isinstance(value, type)
            ):
                names[name] = None
    return tuple(names)
