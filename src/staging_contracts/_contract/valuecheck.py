"""Value checkers compiled once from a type expression, backed by typeguard.

A contract checks each member of a new instance once, after construction. Calling
``typeguard.check_type`` afresh for every member re-derives the same facts each time (it
re-inspects every method signature of a Protocol, for instance). :func:`compile_checker`
derives them once per member type:

* a plain class or a union of plain classes and ``None`` becomes one ``isinstance`` call,
  which is exactly what typeguard would do for it;
* a Protocol made only of methods and properties is checked by typeguard once per *class* of
  value (conformance of methods is a property of the class), then remembered; each property's
  value is then checked against its return annotation on every instance, which typeguard
  itself does not do;
* everything else (``list[Tensor]``, ``dict[str, int]``, ``Callable``, ``Literal``, Protocols
  with plain attributes) goes to ``typeguard.check_type`` with every item of every collection
  checked.

Checkers raise :class:`typeguard.TypeCheckError`; callers turn that into their own errors.
"""

from __future__ import annotations

import threading
import types
import typing
import weakref
from collections.abc import Callable
from typing import Any, Final

from typeguard import CollectionCheckStrategy, TypeCheckError, check_type

from .typeforms import is_protocol_class, protocol_member_names, type_name, union_arms

__all__ = ["ValueChecker", "compile_checker"]

ValueChecker = Callable[[object], None]
"""Checks one value; raises ``typeguard.TypeCheckError`` when it does not match."""

_ALL_ITEMS: Final = CollectionCheckStrategy.ALL_ITEMS


def compile_checker(tp: object) -> ValueChecker:
    """Build a checker for values of type ``tp``.

    Args:
        tp: a resolved type expression (no strings or forward references left).

    Returns:
        A callable that returns ``None`` for a matching value and raises
        ``typeguard.TypeCheckError`` otherwise. Safe to call from any thread.
    """
    arms = union_arms(tp)
    if tp is Any or tp is object:
        return _accept_anything
    if all(_is_plain_class(arm) for arm in arms):
        return _isinstance_checker(tuple(typing.cast("type", arm) for arm in arms), tp)
    if len(arms) > 1:
        return _union_checker([compile_checker(arm) for arm in arms], tp)
    (only,) = arms
    if is_protocol_class(only) and _methods_and_properties_only(typing.cast("type", only)):
        return _ProtocolChecker(typing.cast("type", only))
    return _typeguard_checker(tp)


def _accept_anything(value: object) -> None:
    return None


def _is_plain_class(tp: object) -> bool:
    return (
        isinstance(tp, type)
        and not is_protocol_class(tp)
        and typing.get_origin(tp) is None
        and not isinstance(tp, types.GenericAlias)
    )


def _isinstance_checker(classes: tuple[type, ...], tp: object) -> ValueChecker:
    expected = type_name(tp)

    def check(value: object) -> None:
        if not isinstance(value, classes):
            raise TypeCheckError(f"is not an instance of {expected}")

    return check


def _union_checker(arms: list[ValueChecker], tp: object) -> ValueChecker:
    expected = type_name(tp)

    def check(value: object) -> None:
        for arm in arms:
            try:
                arm(value)
            except TypeCheckError:
                continue
            return
        raise TypeCheckError(f"did not match any element in the union {expected}")

    return check


def _typeguard_checker(tp: object) -> ValueChecker:
    def check(value: object) -> None:
        check_type(value, tp, collection_check_strategy=_ALL_ITEMS)

    return check


def _methods_and_properties_only(proto: type) -> bool:
    for name in protocol_member_names(proto):
        attr = _lookup(proto, name)
        if attr is None or not (callable(attr) or isinstance(attr, property)):
            return False
    return True


def _lookup(proto: type, name: str) -> object | None:
    for klass in proto.__mro__:
        if name in klass.__dict__:
            return typing.cast("object", klass.__dict__[name])
    return None


class _ProtocolChecker:
    """Checks values against a Protocol of methods and properties.

    Typeguard verifies the methods once per class of value (signatures included); the
    properties' values are checked on every call against their declared return types.
    """

    def __init__(self, proto: type) -> None:
        self._proto = proto
        self._conforming: weakref.WeakSet[type] = weakref.WeakSet()
        self._lock = threading.Lock()
        hints = typing.get_type_hints(proto)
        self._properties: tuple[tuple[str, ValueChecker], ...] = tuple(
            (name, compile_checker(_property_type(proto, name, hints)))
            for name in sorted(protocol_member_names(proto))
            if isinstance(_lookup(proto, name), property)
        )

    def __call__(self, value: object) -> None:
        cls = type(value)
        if cls not in self._conforming:
            check_type(value, self._proto, collection_check_strategy=_ALL_ITEMS)
            with self._lock:
                self._conforming.add(cls)
        for name, checker in self._properties:
            try:
                member = getattr(value, name)
            except AttributeError:
                raise TypeCheckError(f"has no attribute {name!r}") from None
            try:
                checker(member)
            except TypeCheckError as exc:
                raise TypeCheckError(f"has attribute {name!r} that {exc}") from None


def _property_type(proto: type, name: str, hints: dict[str, Any]) -> object:
    if name in hints:
        return hints[name]
    prop = _lookup(proto, name)
    if isinstance(prop, property) and prop.fget is not None:
        fget_hints = typing.get_type_hints(prop.fget)
        return fget_hints.get("return", Any)
    return Any
