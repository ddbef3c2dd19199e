"""Signature compatibility: can a host's method take every call its Protocol's method allows?"""

from __future__ import annotations

from typing import Any

import pytest

from staging_contracts._contract.signatures import call_problem, callable_signature, signature_text


class Proto:
    """Methods as a Protocol would state them."""

    def plain(self, a: int, b: int = 0) -> None: ...

    def keyword_only(self, *, room: int, size: int = 1) -> None: ...

    def variadic(self, *args: Any, **kwargs: Any) -> None: ...

    def positional_only(self, a: int, /) -> None: ...

    @staticmethod
    def static(a: int) -> None: ...

    @classmethod
    def klass(cls, a: int) -> None: ...


def _raw(name: str) -> object:
    return Proto.__dict__[name]


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("plain", "(a, b=0)"),
        ("keyword_only", "(*, room, size=1)"),
        ("variadic", "(*args, **kwargs)"),
        ("positional_only", "(a, /)"),
        ("static", "(a)"),
        ("klass", "(a)"),
    ],
)
def test_signature_text_leaves_out_self_cls_and_annotations(name: str, text: str) -> None:
    """The text a message shows: parameters as a call's shape."""
    assert signature_text(_raw(name)) == text


def test_unreadable_and_non_callable_values_have_no_signature() -> None:
    """A value that is not callable has no signature; its text says so."""
    assert callable_signature(3) is None
    assert signature_text(3) == "(...)"


def host(body: str) -> object:
    """The raw class-body value of a method defined by ``body`` (``def m(...): ...``)."""
    namespace: dict[str, Any] = {"Any": Any}
    exec(f"class H:\n    {body}\n", namespace)
    value: object = namespace["H"].__dict__["m"]
    return value


@pytest.mark.parametrize(
    ("protocol", "body"),
    [
        ("plain", "def m(self, a, b=0): ..."),
        ("plain", "def m(self, a, b=0, c=None): ..."),
        ("plain", "def m(self, *args, **kwargs): ..."),
        ("keyword_only", "def m(self, *, room, size=2): ..."),
        ("keyword_only", "def m(self, room=0, size=0): ..."),
        ("keyword_only", "def m(self, **kwargs): ..."),
        ("variadic", "def m(self, *a, **k): ..."),
        ("positional_only", "def m(self, x): ..."),
        ("static", "@staticmethod\n    def m(a): ..."),
        ("static", "@classmethod\n    def m(cls, a): ..."),
        ("klass", "@classmethod\n    def m(cls, a): ..."),
        ("plain", "@staticmethod\n    def m(a, b=0): ..."),
    ],
)
def test_compatible_signatures_have_no_problem(protocol: str, body: str) -> None:
    """Wider or equal signatures take every call the Protocol allows."""
    assert call_problem(_raw(protocol), host(body)) is None


@pytest.mark.parametrize(
    ("protocol", "body", "problem"),
    [
        ("plain", "def m(self, a): ...", "cannot be called as (a, b): too many positional"),
        ("plain", "def m(self, a, b): ...", "cannot be called as (a): missing a required"),
        ("plain", "def m(self, x, b=0): ...", "cannot be called as (a=a, b=b): missing a"),
        ("plain", "def m(self, a, *rest): ...", "cannot be called as (a=a, b=b): got an"),
        ("keyword_only", "def m(self, room): ...", "cannot be called as (room=room, size=size)"),
        ("variadic", "def m(self, *args): ...", "cannot be called as (**kwargs)"),
        ("variadic", "def m(self, **kwargs): ...", "cannot be called as (*args, *args)"),
        ("plain", "def m(self, a, b=0, *, c): ...", "cannot be called as (a): missing a required"),
        ("static", "@staticmethod\n    def m(): ...", "cannot be called as (a): too many"),
        ("static", "def m(self, a): ...", "is a plain method: it cannot be called on the class"),
        ("klass", "def m(self, a): ...", "is a plain method: it cannot be called on the class"),
    ],
)
def test_incompatible_signatures_name_the_call_they_cannot_take(
    protocol: str, body: str, problem: str
) -> None:
    """The first telling call that does not bind is named, with the reason."""
    found = call_problem(_raw(protocol), host(body))
    assert found is not None
    assert found.startswith(problem), found


def test_no_verdict_without_a_readable_signature() -> None:
    """A host value whose signature cannot be read gets no verdict (no false alarm)."""
    assert call_problem(_raw("plain"), 3) is None
    assert call_problem(3, host("def m(self): ...")) is None


def test_an_overloaded_protocol_method_allows_the_calls_of_every_overload() -> None:
    """Overloads (here with no implementation, as Protocols write them) are what callers
    see: a host taking the calls of both passes, one taking only the first's does not; the
    placeholder body's ``(*args, **kwargs)`` is not asked of the host."""
    from typing import Protocol, overload

    from staging_contracts._contract.members import protocol_members

    class Lookup(Protocol):
        @overload
        def get(self, key: int) -> int: ...
        @overload
        def get(self, key: str, default: str) -> str: ...

    (member,) = protocol_members(Lookup)
    assert member.expected_name == "a method get(key) (+1 overloads)"
    assert call_problem(member.expected, host("def m(self, key, default=None): ...")) is None
    found = call_problem(member.expected, host("def m(self, key): ..."))
    assert found is not None
    assert found.startswith("cannot be called as (key, default): too many positional"), found
