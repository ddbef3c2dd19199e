"""Method signatures: can a host's method take every call its Protocol's method allows?

A Protocol method's signature says how callers may call it: which arguments are required,
which may be left out, which may be passed by keyword. A host's method satisfies it when
each such call binds to the host's own signature. :func:`call_problem` tries the telling
calls (the fewest arguments, every argument by position, every argument by keyword, extra
positional and keyword arguments where the Protocol takes ``*args`` or ``**kwargs``) with
:meth:`inspect.Signature.bind`: no code of the host runs. Types of the arguments are not
compared: that is the type checker's part (the mypy plugin compares them).

An overloaded Protocol method allows the calls of each of its overloads (its runtime body,
when it has one, is not what callers see). A ``classmethod`` or ``staticmethod`` of the
Protocol may also be called on the class, so a host's plain method, which cannot, does not
satisfy it.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["Overloaded", "call_problem", "callable_signature", "overloads_of", "signature_text"]

_P = inspect.Parameter
_POSITIONAL: Final = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)
_EXTRA_KEYWORD: Final = "_extra_keyword_of_the_contract"


def callable_signature(raw: object) -> inspect.Signature | None:
    """The signature a caller sees through an instance (``self`` or ``cls`` removed).

    Args:
        raw: a class body's value: a function, ``classmethod``, ``staticmethod`` or another
            callable object.

    Returns:
        The signature, or ``None`` when it cannot be read (some built-ins) or ``raw`` is not
        callable.
    """
    bound = True
    func: Any = raw
    if isinstance(raw, staticmethod):
        func, bound = raw.__func__, False
    elif isinstance(raw, classmethod):
        func = raw.__func__
    elif not inspect.isfunction(raw):
        if not callable(raw):
            return None
        bound = False  # a callable object: its signature is already that of a call
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    if bound and params and params[0].kind in _POSITIONAL:
        params = params[1:]
    return signature.replace(parameters=params)


def signature_text(raw: object) -> str:
    """The parameters of a method as a reader writes a call's shape: ``(a, b, c=None)``.

    Annotations are left out (they are the type checker's part); ``(...)`` when unreadable;
    the first overload's, with how many more there are, for :class:`Overloaded`.
    """
    if isinstance(raw, Overloaded):
        more = len(raw.variants) - 1
        return signature_text(raw.variants[0]) + (f" (+{more} overloads)" if more else "")
    signature = callable_signature(raw)
    if signature is None:
        return "(...)"
    bare = [p.replace(annotation=_P.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=bare, return_annotation=inspect.Signature.empty))


@dataclass(frozen=True, slots=True)
class Overloaded:
    """A Protocol method declared with ``@overload``: callers may make the calls of each
    variant (the function, ``classmethod`` or ``staticmethod`` each overload decorates)."""

    variants: tuple[object, ...]


def overloads_of(owner: type, name: str) -> Overloaded | None:
    """The overloads ``owner``'s body declares for method ``name``, or ``None`` if none."""
    # typing files overloads under the method's module and qualified name; the class body's
    # value is the last overload (a placeholder) or the implementation, neither of which
    # callers see
    key = types.SimpleNamespace(
        __module__=owner.__module__, __qualname__=f"{owner.__qualname__}.{name}"
    )
    variants = typing.get_overloads(key)  # type: ignore[arg-type]  # reads only those two
    return Overloaded(tuple(variants)) if variants else None


def call_problem(expected: object, declared: object) -> str | None:
    """Why the host's ``declared`` method cannot take a call the Protocol's ``expected`` allows.

    Args:
        expected: the Protocol's function, ``classmethod`` or ``staticmethod``, or its
            :class:`Overloaded` variants.
        declared: the host's class-body value of that name.

    Returns:
        ``None`` when every telling call binds, or when either signature cannot be read (no
        verdict without facts); else a fragment naming the call and the reason.
    """
    variants = expected.variants if isinstance(expected, Overloaded) else (expected,)
    kind = next((k for k in map(_class_callable_kind, variants) if k is not None), None)
    if kind is not None and inspect.isfunction(declared):
        return f"is a plain method: it cannot be called on the class, as the Protocol's {kind} can"
    have = callable_signature(declared)
    if have is None:
        return None
    for variant in variants:
        want = callable_signature(variant)
        if want is None:
            continue
        for args, kwargs in _telling_calls(want):
            try:
                have.bind(*args, **kwargs)
            except TypeError as exc:
                return f"cannot be called as {_call_text(args, kwargs)}: {exc}"
    return None


def _class_callable_kind(raw: object) -> str | None:
    if isinstance(raw, classmethod):
        return "classmethod"
    if isinstance(raw, staticmethod):
        return "staticmethod"
    return None


def _telling_calls(signature: inspect.Signature) -> Iterator[tuple[list[str], dict[str, str]]]:
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    keyword_only = [p for p in params if p.kind is _P.KEYWORD_ONLY]
    required = [p.name for p in positional if p.default is _P.empty]
    all_positional = [p.name for p in positional]
    all_keywords = {p.name: p.name for p in keyword_only}
    yield required, {p.name: p.name for p in keyword_only if p.default is _P.empty}
    yield all_positional, dict(all_keywords)
    by_keyword = {p.name: p.name for p in positional if p.kind is _P.POSITIONAL_OR_KEYWORD}
    only_positional = [p.name for p in positional if p.kind is _P.POSITIONAL_ONLY]
    yield only_positional, {**by_keyword, **all_keywords}
    if any(p.kind is _P.VAR_POSITIONAL for p in params):
        yield [*all_positional, "*args", "*args"], dict(all_keywords)
    if any(p.kind is _P.VAR_KEYWORD for p in params):
        yield all_positional, {**all_keywords, _EXTRA_KEYWORD: "**kwargs"}


def _call_text(args: list[str], kwargs: dict[str, str]) -> str:
    parts = [*args, *(f"{k}={v}" if k != _EXTRA_KEYWORD else v for k, v in kwargs.items())]
    return f"({', '.join(parts)})"
