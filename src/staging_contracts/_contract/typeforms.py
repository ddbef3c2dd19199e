"""Type expressions as the contract sees them at class creation.

Three jobs, all pure and without side effects:

* :func:`type_name` renders a type expression the way a reader writes it
  (``StagingHandler | None``, ``list[Tensor]``), for error messages and tables;
* :func:`resolve_annotation` turns a declared annotation, possibly a string (``from __future__
  import annotations``) or a forward reference, into a type object, or reports that it cannot
  be resolved yet;
* :func:`declared_compatibility` decides whether a declared type is a subtype of the type a
  Protocol expects, answering ``YES``, ``NO`` or ``UNKNOWN``. Only ``NO`` is ever reported as an
  error: whatever cannot be decided statically is left to the instance check, so there are no
  false alarms.
"""

from __future__ import annotations

import builtins
import enum
import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

__all__ = [
    "Compat",
    "class_label",
    "declared_compatibility",
    "is_protocol_class",
    "protocol_member_names",
    "resolve_annotation",
    "type_name",
    "union_arms",
]

_NONE_TYPES: Final = (None, type(None))
_MAX_QUOTING: Final = 3
# PEP 484 numeric tower: an int is acceptable where a float is expected, and so on.
_NUMERIC_PROMOTIONS: Final[Mapping[type, tuple[type, ...]]] = {
    float: (int,),
    complex: (int, float),
}
_PROTOCOL_INTERNALS: Final = frozenset(
    {
        "__abstractmethods__",
        "__annotations__",
        "__dict__",
        "__doc__",
        "__init__",
        "__module__",
        "__new__",
        "__slots__",
        "__subclasshook__",
        "__weakref__",
        "__class_getitem__",
        "__parameters__",
        "__orig_bases__",
        "__protocol_attrs__",
        "__non_callable_proto_members__",
        "__type_params__",
        "__static_attributes__",
        "__firstlineno__",
        "_is_protocol",
        "_is_runtime_protocol",
        "__callable_proto_members_only__",
        "_abc_impl",
        "__init_subclass__",
        "__qualname__",
    }
)


class Compat(enum.Enum):
    """Outcome of a static compatibility question."""

    YES = "yes"
    """The declared type is a subtype of the expected one."""
    NO = "no"
    """The declared type admits values the expected type forbids."""
    UNKNOWN = "unknown"
    """Cannot be decided without values (forward references, type variables, callables)."""


# --------------------------------------------------------------------------- naming


def type_name(tp: object) -> str:
    """Render a type expression compactly, without module prefixes.

    Args:
        tp: a class, ``None``, a union, a parametrised generic, a string or ``ForwardRef``.

    Returns:
        The expression as a reader would write it, e.g. ``DecodeStagingContext | None``.
    """
    if tp is None or tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    if isinstance(tp, str):
        return tp
    if isinstance(tp, typing.ForwardRef):
        return tp.__forward_arg__
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(type_name(arg) for arg in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin is typing.ClassVar:
        return f"ClassVar[{type_name(args[0])}]" if args else "ClassVar"
    if origin is not None:
        base = _class_name(origin)
        if not args:
            return base
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{type_name(args[0])}, ...]"
        if base == "Callable" and len(args) == 2 and isinstance(args[0], list):
            params = ", ".join(type_name(a) for a in args[0])
            return f"Callable[[{params}], {type_name(args[1])}]"
        return f"{base}[{', '.join(type_name(a) if a is not Ellipsis else '...' for a in args)}]"
    if isinstance(tp, type):
        return _class_name(tp)
    if isinstance(tp, typing.TypeVar):
        return tp.__name__
    return repr(tp).removeprefix("typing.")


def _class_name(cls: Any) -> str:
    name = getattr(cls, "__qualname__", None) or getattr(cls, "__name__", None)
    if name is None:
        return repr(cls).removeprefix("typing.")
    return str(name).rpartition("<locals>.")[2]


def class_label(cls: type) -> str:
    """A class's qualified name without module or ``<locals>`` noise (``Outer.Inner``)."""
    return _class_name(cls)


# --------------------------------------------------------------------------- resolving


def resolve_annotation(annotation: object, owner: type) -> tuple[object, bool]:
    """Resolve an annotation declared in the body of ``owner``.

    Strings (postponed annotations) and ``ForwardRef`` objects are evaluated in the
    namespace of ``owner``'s module, with ``owner``'s own attributes layered on top, as
    :func:`typing.get_type_hints` would. A name that does not exist yet (a class defined
    later in the module, or imported only under ``TYPE_CHECKING``) makes the annotation
    unresolved rather than wrong.

    Args:
        annotation: the raw value from ``owner.__dict__["__annotations__"]``.
        owner: the class whose body declares the annotation.

    Returns:
        ``(type, True)`` when resolved, ``(annotation, False)`` otherwise.
    """
    module = sys.modules.get(owner.__module__)
    global_ns: dict[str, Any] = dict(vars(module)) if module is not None else {}
    global_ns.setdefault("__builtins__", builtins)
    local_ns = dict(vars(owner))
    value = annotation
    # A quoted annotation in a module with postponed annotations is a string of a string.
    for _ in range(_MAX_QUOTING):
        if isinstance(value, typing.ForwardRef):
            value = value.__forward_arg__
        if not isinstance(value, str):
            return value, True
        try:
            value = eval(value, global_ns, local_ns)
        except Exception:  # noqa: BLE001 - any failure means "not resolvable yet", no verdict
            return annotation, False
    return annotation, False


# --------------------------------------------------------------------------- protocols


def is_protocol_class(tp: object) -> bool:
    """True for a class defined with ``typing.Protocol`` in its bases (not a concrete class)."""
    return isinstance(tp, type) and bool(getattr(tp, "_is_protocol", False))


def protocol_member_names(proto: type) -> frozenset[str]:
    """The member names a Protocol class requires: annotations, methods and properties."""
    names: set[str] = set()
    for klass in proto.__mro__:
        if klass in (object, typing.Protocol, typing.Generic):
            continue
        if not is_protocol_class(klass):
            continue
        names.update(inspect.get_annotations(klass))
        names.update(
            name
            for name in klass.__dict__
            if name not in _PROTOCOL_INTERNALS and not name.startswith("_abc_")
        )
    return frozenset(names)


def _declares(cls: type, name: str) -> bool:
    if hasattr(cls, name):
        return True
    return any(name in inspect.get_annotations(klass) for klass in cls.__mro__)


# --------------------------------------------------------------------------- compatibility


def union_arms(tp: object) -> tuple[object, ...]:
    """Split a union into its arms (``None`` normalised to ``type(None)``); else ``(tp,)``."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return tuple(arm for arg in typing.get_args(tp) for arm in union_arms(arg))
    if origin is typing.Annotated:
        return union_arms(typing.get_args(tp)[0])
    if origin is typing.ClassVar or origin is typing.Final:
        args = typing.get_args(tp)
        return union_arms(args[0]) if args else (Any,)
    if tp is None:
        return (type(None),)
    return (tp,)


def declared_compatibility(declared: object, expected: object) -> Compat:
    """Is every value the declared type admits also admitted by the expected type?

    Args:
        declared: the resolved annotation of a member on the host class.
        expected: the type the Protocol requires for that member.

    Returns:
        ``Compat.NO`` only when some arm of ``declared`` is certainly outside ``expected``.
    """
    verdicts = [_arm_against_union(arm, union_arms(expected)) for arm in union_arms(declared)]
    if Compat.NO in verdicts:
        return Compat.NO
    if Compat.UNKNOWN in verdicts:
        return Compat.UNKNOWN
    return Compat.YES


def _arm_against_union(arm: object, expected_arms: tuple[object, ...]) -> Compat:
    verdicts = [_arm_compat(arm, expected) for expected in expected_arms]
    if Compat.YES in verdicts:
        return Compat.YES
    if Compat.UNKNOWN in verdicts:
        return Compat.UNKNOWN
    return Compat.NO


def _is_opaque(tp: object) -> bool:
    return isinstance(tp, str | typing.ForwardRef | typing.TypeVar) or tp is Ellipsis


def _arm_compat(declared: object, expected: object) -> Compat:
    if expected is Any or expected is object or declared is Any:
        return Compat.YES
    if _is_opaque(declared) or _is_opaque(expected):
        return Compat.UNKNOWN
    if (
        typing.get_origin(declared) is typing.Literal
        or typing.get_origin(expected) is typing.Literal
    ):
        return _literal_compat(declared, expected)
    if expected in _NONE_TYPES or declared in _NONE_TYPES:
        return Compat.YES if (expected in _NONE_TYPES and declared in _NONE_TYPES) else Compat.NO
    d_origin = typing.get_origin(declared) or declared
    e_origin = typing.get_origin(expected) or expected
    if not isinstance(d_origin, type) or not isinstance(e_origin, type):
        # Literal, Callable, NewType and friends: leave them to the instance check.
        return Compat.UNKNOWN
    if is_protocol_class(e_origin):
        return _protocol_compat(d_origin, e_origin)
    if is_protocol_class(d_origin):
        return Compat.NO
    if not _nominal_subclass(d_origin, e_origin):
        return Compat.NO
    return _args_compat(declared, expected)


def _literal_compat(declared: object, expected: object) -> Compat:
    """``Literal`` on either side: the declared values must be among the expected ones, or
    instances of the expected class; a class declared where values are expected is wider
    (``str`` for ``Literal['zmq']``) unless its values are known, which they are not here."""
    if typing.get_origin(declared) is not typing.Literal:
        return Compat.UNKNOWN
    values = typing.get_args(declared)
    if typing.get_origin(expected) is typing.Literal:
        allowed = typing.get_args(expected)
        return Compat.YES if all(_among(value, allowed) for value in values) else Compat.NO
    origin = typing.get_origin(expected) or expected
    if not isinstance(origin, type) or is_protocol_class(origin):
        return Compat.UNKNOWN
    return Compat.YES if all(isinstance(value, origin) for value in values) else Compat.NO


def _among(value: object, allowed: tuple[object, ...]) -> bool:
    """``value`` is one of ``allowed`` by type and value (``True`` is not ``1``)."""
    return any(type(value) is type(other) and value == other for other in allowed)


def _nominal_subclass(declared: type, expected: type) -> bool:
    try:
        if issubclass(declared, expected):
            return True
    except TypeError:
        return False
    return declared in _NUMERIC_PROMOTIONS.get(expected, ())


def _protocol_compat(declared: type, proto: type) -> Compat:
    if declared is proto:
        return Compat.YES
    missing = [name for name in protocol_member_names(proto) if not _declares(declared, name)]
    return Compat.NO if missing else Compat.YES


def _args_compat(declared: object, expected: object) -> Compat:
    d_args = typing.get_args(declared)
    e_args = typing.get_args(expected)
    if not d_args or not e_args or len(d_args) != len(e_args):
        # A bare generic (``list``) is ``list[Any]``; variadic tuples are not worth guessing.
        return Compat.YES if not d_args or not e_args else Compat.UNKNOWN
    verdicts = list(_pairwise(d_args, e_args, declared_compatibility))
    if Compat.NO in verdicts:
        return Compat.NO
    if Compat.UNKNOWN in verdicts:
        return Compat.UNKNOWN
    return Compat.YES


def _pairwise(
    left: tuple[object, ...], right: tuple[object, ...], judge: Callable[[object, object], Compat]
) -> Iterator[Compat]:
    for d_arg, e_arg in zip(left, right, strict=True):
        if d_arg is Ellipsis or e_arg is Ellipsis or isinstance(d_arg, list):
            yield Compat.UNKNOWN
        else:
            yield judge(d_arg, e_arg)
