"""Where and how a class declares a member: annotation, attribute, property, descriptor, slot."""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass
from typing import Final

from .typeforms import resolve_annotation, type_name

__all__ = ["Declaration", "DeclarationKind", "find_declaration", "provided_methods"]

_LITERAL_TYPES: Final = (type(None), bool, int, float, complex, str, bytes)


class DeclarationKind(enum.Enum):
    """How a class declares a member."""

    ANNOTATION = "annotation"
    ATTRIBUTE = "class attribute"
    PROPERTY = "property"
    DESCRIPTOR = "descriptor"
    SLOT = "__slots__"


@dataclass(frozen=True, slots=True)
class Declaration:
    """Where and how a member is declared on a host class."""

    owner: type
    """The class in the MRO whose body declares it (the most derived one)."""
    kind: DeclarationKind
    """Annotation, class attribute, property, descriptor or slot."""
    declared: object
    """The declared type (resolved when ``resolved``), or ``None`` when none is stated."""
    resolved: bool
    """False for a string or forward reference that cannot be evaluated at class creation."""

    @property
    def declared_name(self) -> str:
        """The declared type as text, ``'-'`` when the declaration states no type."""
        if self.declared is None and self.kind is not DeclarationKind.ANNOTATION:
            return "-"
        return type_name(self.declared)


def find_declaration(cls: type, name: str, excluded: frozenset[type]) -> Declaration | None:
    """The most derived declaration of ``name`` in ``cls``'s MRO, skipping ``excluded`` classes.

    A member counts as declared by a class annotation, a class attribute, a property or other
    descriptor, or a ``__slots__`` entry. Returns ``None`` when no class declares it.
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
