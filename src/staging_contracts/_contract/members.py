"""The members of a contract, read once from its Protocol: attributes, properties and methods.

A Protocol states what a host must have in three ways, and each is a member:

* an annotated attribute (``kv_args: KVArgs``): the host holds a value of that type;
* a property (``@property def arrival(self) -> ArrivalMode``): the host holds, or computes,
  a value of the getter's return type (an *attribute* member too: a host may satisfy it with
  a plain attribute, an annotation or a property of its own);
* a method (``def set_kv_buffer_tensors(self, k_buffers, v_buffers, page_size)``): the host
  has a callable of that name that accepts every call the Protocol's signature allows.

``ClassVar`` annotations and the Protocol machinery's own names are not members.
"""

from __future__ import annotations

import enum
import inspect
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from .signatures import overloads_of, signature_text
from .typeforms import class_label, is_protocol_class, protocol_member_names, type_name

__all__ = ["MemberKind", "MemberSpec", "protocol_members"]


class MemberKind(enum.Enum):
    """What kind of thing a member is."""

    ATTRIBUTE = "attribute"
    """An annotated attribute or a property of the Protocol: a value of a type."""
    METHOD = "method"
    """A method of the Protocol (plain, class or static): a callable with a signature."""


@dataclass(frozen=True, slots=True)
class MemberSpec:
    """A member of a contract: its name, what the Protocol requires of it, and its flags."""

    name: str
    expected: object
    """For an attribute, the type the Protocol declares; for a method, the Protocol's own
    function (or ``classmethod``/``staticmethod`` object), whose signature callers use, or
    its :class:`~staging_contracts._contract.signatures.Overloaded` variants."""
    optional: bool
    """Checked only when the host declares (class) or holds (instance) it."""
    kind: MemberKind = MemberKind.ATTRIBUTE
    set_later: bool = False
    """Assigned after construction (by the host's own code, at a later step): it may be unset
    when ``__init__`` returns, and every assignment to it is checked."""

    @property
    def is_method(self) -> bool:
        """True for a method member."""
        return self.kind is MemberKind.METHOD

    @property
    def expected_name(self) -> str:
        """What is expected, as text: the type, or ``a method NAME(PARAMS)`` for a method."""
        if self.kind is MemberKind.METHOD:
            return f"a method {self.name}{signature_text(self.expected)}"
        return type_name(self.expected)


def protocol_members(
    protocol: type, *, optional: Iterable[str] = (), set_later: Iterable[str] = ()
) -> tuple[MemberSpec, ...]:
    """The members of ``protocol`` (and of the Protocols it extends), bases first.

    Args:
        protocol: a ``typing.Protocol`` class.
        optional: names of members checked only when present.
        set_later: names of attribute members assigned after construction.

    Raises:
        TypeError: ``protocol`` is not a Protocol; an annotation or a property's return
            annotation cannot be resolved; a name in ``optional`` or ``set_later`` is not a
            member; a ``set_later`` name is a method.
    """
    if not is_protocol_class(protocol):
        raise TypeError(f"Contract needs a typing.Protocol class, got {protocol!r}")
    try:
        hints = typing.get_type_hints(protocol)
    except Exception as exc:
        raise TypeError(
            f"cannot resolve the annotations of {class_label(protocol)}: {exc}"
        ) from exc
    optional_names = frozenset(optional)
    later_names = frozenset(set_later)
    members: dict[str, MemberSpec] = {}
    for name, kind, expected in _declared(protocol, hints):
        members.setdefault(
            name,
            MemberSpec(name, expected, name in optional_names, kind, name in later_names),
        )
    for label, names in (("optional", optional_names), ("set_later", later_names)):
        unknown = sorted(names - members.keys())
        if unknown:
            raise TypeError(f"{label} names {unknown!r} are not members of {protocol!r}")
    methods = sorted(name for name in later_names if members[name].is_method)
    if methods:
        raise TypeError(f"set_later names {methods!r} are methods of {protocol!r}, not attributes")
    return tuple(members.values())


def _declared(protocol: type, hints: dict[str, Any]) -> Iterator[tuple[str, MemberKind, object]]:
    """Each member as the Protocol classes declare it, bases first, most derived value."""
    own_names = protocol_member_names(protocol)
    for klass in reversed(protocol.__mro__):
        if klass in (object, typing.Protocol, typing.Generic) or not is_protocol_class(klass):
            continue
        for name in inspect.get_annotations(klass):
            if name in hints and typing.get_origin(hints[name]) is not ClassVar:
                yield name, MemberKind.ATTRIBUTE, hints[name]
        for name in klass.__dict__:
            if name not in own_names or name in hints:
                continue
            owner, current = _most_derived(protocol, name)
            if isinstance(current, property):
                yield name, MemberKind.ATTRIBUTE, _property_type(protocol, current)
            elif _is_method(current):
                yield name, MemberKind.METHOD, overloads_of(owner, name) or current


def _most_derived(protocol: type, name: str) -> tuple[type, object]:
    for klass in protocol.__mro__:
        if name in klass.__dict__:
            found: object = klass.__dict__[name]
            return klass, found
    return protocol, None


def _is_method(value: object) -> bool:
    return isinstance(value, staticmethod | classmethod) or (
        callable(value) and not isinstance(value, type)
    )


def _property_type(protocol: type, prop: property) -> object:
    if prop.fget is None:
        return Any
    try:
        hints = typing.get_type_hints(prop.fget)
    except Exception as exc:
        raise TypeError(
            f"cannot resolve the return annotation of {class_label(protocol)}."
            f"{prop.fget.__name__}: {exc}"
        ) from exc
    return hints.get("return", Any)
