"""The declaration rule: where and how a class declares a member, as find_declaration reports it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import pytest

from staging_contracts._contract.declarations import (
    Declaration,
    DeclarationKind,
    find_declaration,
    init_assignment_sites,
    init_assignments,
    provided_methods,
)

NOTHING: frozenset[type] = frozenset()


def _found(cls: type, name: str, excluded: frozenset[type] = NOTHING) -> Declaration:
    decl = find_declaration(cls, name, excluded)
    assert decl is not None, f"{name!r} not found on {cls.__name__}"
    return decl


class Plain:
    """A non-data descriptor that is not callable: it declares no type."""

    def __get__(self, obj: object, owner: type | None = None) -> int:
        return 1


class CallableDescriptor:
    """A descriptor instance that can also be called: treated as a plain attribute."""

    def __get__(self, obj: object, owner: type | None = None) -> int:
        return 1

    def __call__(self) -> int:
        return 2


# --------------------------------------------------------------------------- annotations


def test_annotation_is_found_with_its_resolved_type() -> None:
    """A class annotation is an ANNOTATION declaration of the resolved type, on that class."""

    class Host:
        size: int

    assert find_declaration(Host, "size", NOTHING) == Declaration(
        Host, DeclarationKind.ANNOTATION, int, True
    )


def test_unresolvable_annotation_is_kept_unresolved() -> None:
    """An annotation naming an undefined type is kept as text and marked unresolved."""

    class Host:
        size: Undefined  # type: ignore[name-defined]  # noqa: F821 - the case under test

    decl = _found(Host, "size")
    assert decl == Declaration(Host, DeclarationKind.ANNOTATION, "Undefined", False)
    assert decl.declared_name == "Undefined"


def test_annotation_wins_over_a_value_in_the_same_class() -> None:
    """An annotated attribute with a value is declared by its annotation, not the value's type."""

    class Host:
        size: float = 3

    assert _found(Host, "size") == Declaration(Host, DeclarationKind.ANNOTATION, float, True)


def test_annotation_of_none_is_named_none() -> None:
    """An annotation of None renders as 'None', not as the '-' of an untyped declaration."""

    class Host:
        nothing: None

    decl = _found(Host, "nothing")
    assert decl.kind is DeclarationKind.ANNOTATION
    assert decl.declared is None
    assert decl.declared_name == "None"


def test_most_derived_class_declares_the_member() -> None:
    """The owner is the most derived class in the MRO that declares the name."""

    class Base:
        size: int

    class Child(Base):
        size: bool

    class Grandchild(Child):
        pass

    assert _found(Grandchild, "size") == Declaration(Child, DeclarationKind.ANNOTATION, bool, True)
    assert _found(Base, "size").owner is Base


def test_excluded_classes_are_skipped_and_the_search_goes_on() -> None:
    """An excluded class is passed over, and a base further up the MRO still declares it."""

    class Base:
        size: int

    class Child(Base):
        size: bool

    assert _found(Child, "size", frozenset({Child})) == Declaration(
        Base, DeclarationKind.ANNOTATION, int, True
    )
    assert find_declaration(Child, "size", frozenset({Child, Base})) is None


def test_undeclared_name_is_none() -> None:
    """A name no class of the MRO declares yields None."""

    class Host:
        other: int

    assert find_declaration(Host, "size", NOTHING) is None


# --------------------------------------------------------------------------- class attributes


@pytest.mark.parametrize(
    ("value", "declared"),
    [
        (None, type(None)),
        (True, bool),
        (3, int),
        (2.5, float),
        (1j, complex),
        ("text", str),
        (b"raw", bytes),
    ],
)
def test_literal_class_attribute_declares_its_value_type(value: object, declared: type) -> None:
    """A class attribute holding a literal declares the literal's type."""
    host = type("Host", (), {"member": value})
    decl = _found(host, "member")
    assert decl == Declaration(host, DeclarationKind.ATTRIBUTE, declared, True)
    assert decl.declared_name == declared.__name__.replace("NoneType", "None")


@pytest.mark.parametrize(
    "value",
    [[1, 2], (1,), {"a": 1}, object(), int],
    ids=["list", "tuple", "dict", "object", "class"],
)
def test_non_literal_class_attribute_declares_no_type(value: object) -> None:
    """A class attribute holding anything but a literal or a callable (a class is not taken
    for a method) is an untyped ATTRIBUTE declaration."""
    host = type("Host", (), {"member": value})
    decl = _found(host, "member")
    assert decl == Declaration(host, DeclarationKind.ATTRIBUTE, None, True)
    assert decl.declared_name == "-"


@pytest.mark.parametrize(
    "value",
    [len, CallableDescriptor(), staticmethod(len), classmethod(lambda cls: None)],
    ids=["builtin", "callable-descriptor", "staticmethod", "classmethod"],
)
def test_a_callable_class_attribute_is_a_method_declaration(value: object) -> None:
    """A built-in, a callable object, a static or class method is a METHOD declaration whose
    declared value is the class body's own."""
    host = type("Host", (), {"member": value})
    decl = _found(host, "member")
    assert decl == Declaration(host, DeclarationKind.METHOD, value, True)
    assert decl.declared_name.startswith("a method (")


def test_a_function_is_a_method_declaration() -> None:
    """A function (callable, although its type has __get__) is a METHOD, not a DESCRIPTOR;
    its declared name shows its parameters without self."""

    class Host:
        def member(self, page: int, *, size: int = 2) -> int:
            return page + size

    decl = _found(Host, "member")
    assert decl == Declaration(Host, DeclarationKind.METHOD, Host.__dict__["member"], True)
    assert decl.declared_name == "a method (page, *, size=2)"
    assert decl.how == "method"


def test_plain_descriptor_is_a_descriptor_declaration() -> None:
    """A non-callable object whose type has __get__ is a DESCRIPTOR declaring no type."""

    class Host:
        member = Plain()

    decl = _found(Host, "member")
    assert decl == Declaration(Host, DeclarationKind.DESCRIPTOR, None, True)
    assert decl.declared_name == "-"


# --------------------------------------------------------------------------- properties


def test_property_declares_its_return_annotation() -> None:
    """A property declares the resolved return annotation of its getter."""

    class Host:
        @property
        def member(self) -> str:
            return "x"

    assert _found(Host, "member") == Declaration(Host, DeclarationKind.PROPERTY, str, True)


def test_property_with_unresolvable_return_is_unresolved() -> None:
    """A getter annotated with an undefined name leaves the property unresolved."""

    class Host:
        @property
        def member(self) -> Undefined:  # type: ignore[name-defined]  # noqa: F821 - under test
            raise NotImplementedError

    assert _found(Host, "member") == Declaration(Host, DeclarationKind.PROPERTY, "Undefined", False)


def test_property_without_return_annotation_declares_no_type() -> None:
    """A getter without a return annotation gives an untyped, resolved PROPERTY."""

    def getter(self: object):  # type: ignore[no-untyped-def]
        return 1

    host = type("Host", (), {"member": property(getter)})
    decl = _found(host, "member")
    assert decl == Declaration(host, DeclarationKind.PROPERTY, None, True)
    assert decl.declared_name == "-"


def test_property_without_getter_declares_no_type() -> None:
    """A property with no getter at all is an untyped, resolved PROPERTY."""
    host = type("Host", (), {"member": property(None, lambda self, value: None)})
    assert _found(host, "member") == Declaration(host, DeclarationKind.PROPERTY, None, True)


def test_property_getter_without_annotations_attribute() -> None:
    """A getter object without __annotations__ (a builtin) gives an untyped PROPERTY."""
    host = type("Host", (), {"member": property(len)})
    assert _found(host, "member") == Declaration(host, DeclarationKind.PROPERTY, None, True)


# --------------------------------------------------------------------------- slots


def test_slot_is_a_slot_declaration_not_a_descriptor() -> None:
    """A __slots__ entry (a member descriptor in the class) is a SLOT declaring no type."""

    class Host:
        __slots__ = ("member", "other")

    decl = _found(Host, "member")
    assert decl == Declaration(Host, DeclarationKind.SLOT, None, True)
    assert decl.declared_name == "-"
    assert _found(Host, "other").kind is DeclarationKind.SLOT


def test_single_string_slots_name_one_member() -> None:
    """__slots__ given as one string names that one member, not its letters."""

    class Host:
        __slots__ = "member"  # noqa: PLC0205 - the case under test

    assert _found(Host, "member") == Declaration(Host, DeclarationKind.SLOT, None, True)
    assert find_declaration(Host, "m", NOTHING) is None


def test_slot_listed_without_its_descriptor_still_declares() -> None:
    """A name in __slots__ declares the member even when its descriptor is gone from the class."""

    class Host:
        __slots__ = ("member",)

    delattr(Host, "member")
    assert "member" not in Host.__dict__
    assert _found(Host, "member") == Declaration(Host, DeclarationKind.SLOT, None, True)


def test_single_string_slot_without_its_descriptor() -> None:
    """A single-string __slots__ still names the member when its descriptor is gone."""

    class Host:
        __slots__ = "member"  # noqa: PLC0205 - the case under test

    delattr(Host, "member")
    assert _found(Host, "member") == Declaration(Host, DeclarationKind.SLOT, None, True)
    assert find_declaration(Host, "m", NOTHING) is None


# --------------------------------------------------------------------------- __init__ assignments


class InitHost:
    """Assigns in __init__ in every way the rule reads, and some it ignores."""

    def __init__(self, other: Any, items: list[int]) -> None:
        local = 1
        typed_local: int = 2
        self.plain = local
        self.annotated: int = typed_local
        self.first, self.second = 1, 2
        [self.third, (self.fourth, self.fifth)] = [3, (4, 5)]
        self.count = 0
        self.count += 1
        other.foreign = 1
        other.typed_foreign: int = 1  # type: ignore[misc]  # a non-self target under test
        self.plain_then_typed = None
        self.plain_then_typed: str | None = "x"  # type: ignore[no-redef]  # order under test
        self.items = items
        self.items[0] = 1
        self.chain = self
        self.chain.attr = 1  # type: ignore[attr-defined]  # a nested target under test
        if items:
            self.in_if = True
        for item in items:
            self.in_loop = item
        with open(__file__) as handle:
            self.in_with: bool = handle.readable()
        self.last = 1


class InitHostTypedFirst:
    """Annotates a member, then assigns it again without an annotation."""

    def __init__(self) -> None:
        self.member: int = 0
        self.member = 1


def test_init_assignments_reads_every_self_target() -> None:
    """Plain, annotated, unpacked, augmented and nested self assignments are all found."""
    assert init_assignments(InitHost) == {
        "plain": None,
        "annotated": "int",
        "first": None,
        "second": None,
        "third": None,
        "fourth": None,
        "fifth": None,
        "count": None,
        "plain_then_typed": "str | None",
        "items": None,
        "chain": None,
        "in_if": None,
        "in_loop": None,
        "in_with": "bool",
        "last": None,
    }


def test_annotation_wins_whatever_the_order_of_assignments() -> None:
    """An annotated assignment declares its type before or after a plain one."""
    assert init_assignments(InitHostTypedFirst) == {"member": "int"}
    assert _found(InitHostTypedFirst, "member") == Declaration(
        InitHostTypedFirst, DeclarationKind.INIT, int, True
    )


def test_init_declarations_carry_kind_owner_and_type() -> None:
    """An __init__ assignment is an INIT declaration: typed when annotated, untyped otherwise."""

    class Child(InitHost):
        pass

    assert _found(Child, "plain") == Declaration(InitHost, DeclarationKind.INIT, None, True)
    assert _found(Child, "annotated") == Declaration(InitHost, DeclarationKind.INIT, int, True)
    assert _found(Child, "second") == Declaration(InitHost, DeclarationKind.INIT, None, True)
    assert _found(Child, "in_with") == Declaration(InitHost, DeclarationKind.INIT, bool, True)
    assert _found(Child, "plain").declared_name == "-"
    assert _found(Child, "annotated").declared_name == "int"
    for name in ("local", "typed_local", "foreign", "typed_foreign", "attr", "handle", "item"):
        assert find_declaration(Child, name, NOTHING) is None, name


def test_unresolvable_init_annotation_is_unresolved() -> None:
    """self.x: Undefined = ... declares the text, unresolved."""

    class Host:
        def __init__(self) -> None:
            self.member: Undefined = None  # type: ignore[name-defined]  # noqa: F821 - under test

    assert _found(Host, "member") == Declaration(Host, DeclarationKind.INIT, "Undefined", False)


def test_init_with_another_name_for_self() -> None:
    """The first parameter is self whatever it is called; 'self' then is just another name."""

    class Host:
        def __init__(this, self: Any) -> None:
            this.mine = 1
            self.theirs = 2

    assert init_assignments(Host) == {"mine": None}


def test_nested_scopes_are_skipped_but_later_statements_are_read() -> None:
    """Nested functions, lambdas and classes are another scope; statements around them count."""

    class Host:
        def __init__(self) -> None:
            self.before = 1

            def helper(self: Any) -> None:
                self.in_function = 1

            async def async_helper(self: Any) -> None:
                self.in_coroutine = 1

            class Inner:
                def __init__(self) -> None:
                    self.in_class = 1

            self.callback: Callable[[], None] = lambda: None
            del helper, async_helper, Inner
            self.after = 1

    assert init_assignments(Host) == {
        "before": None,
        "callback": "Callable[[], None]",
        "after": None,
    }


def test_nested_scope_as_the_last_statement_does_not_stop_the_search() -> None:
    """A nested function or class that ends __init__ does not hide the assignments before it."""

    class EndsWithFunction:
        def __init__(self) -> None:
            self.before = 1

            def helper(self: Any) -> None:
                self.inside = 1

    class EndsWithClass:
        def __init__(self) -> None:
            self.before = 1

            class Inner:
                inside = 1

    assert init_assignments(EndsWithFunction) == {"before": None}
    assert init_assignments(EndsWithClass) == {"before": None}


def test_wrapped_init_is_read_through_its_wrapper() -> None:
    """A decorated __init__ (functools.wraps) is unwrapped to the function that assigns."""

    def logged(init: Callable[[Any], None]) -> Callable[[Any], None]:
        @functools.wraps(init)
        def wrapper(self: Any) -> None:
            init(self)

        return wrapper

    class Host:
        @logged
        def __init__(self) -> None:
            self.member = 1

    assert init_assignments(Host) == {"member": None}
    assert _found(Host, "member") == Declaration(Host, DeclarationKind.INIT, None, True)


def test_without_own_init_there_are_no_assignments() -> None:
    """Only the class's own __init__ is read: an inherited one belongs to its base."""

    class Host(InitHost):
        pass

    assert init_assignments(Host) == {}
    assert init_assignments(object) == {}


def test_init_without_code_has_no_assignments() -> None:
    """A builtin __init__ has no source to read."""
    host = type("Host", (), {"__init__": object.__init__})
    assert init_assignments(host) == {}


def test_init_without_readable_source_has_no_assignments() -> None:
    """An __init__ compiled from a string has no source file: nothing is found."""
    namespace: dict[str, Any] = {}
    exec("def __init__(self):\n    self.member = 1\n", namespace)
    host = type("Host", (), {"__init__": namespace["__init__"]})
    assert init_assignments(host) == {}
    assert find_declaration(host, "member", NOTHING) is None


def test_lambda_init_has_no_assignments() -> None:
    """An __init__ that is a lambda is no function definition: nothing is found."""

    class Host:
        __init__ = lambda self: setattr(self, "member", 1)  # noqa: E731 - the case under test

    assert init_assignments(Host) == {}


def test_init_without_positional_parameters_has_no_assignments() -> None:
    """An __init__ taking only *args has no self parameter to read."""

    class Host:
        def __init__(*args: Any) -> None:
            args[0].member = 1

    assert init_assignments(Host) == {}


# --------------------------------------------------------------------------- methods __init__ calls


class CallsHelpers:
    """Sets its members through helpers, as the reference stack's _init_staging_decode_ctx."""

    def __init__(self, flag: bool) -> None:
        self.direct = 1
        self._init_ctx(flag)
        if flag:
            self._second()

    def _init_ctx(self, flag: bool) -> None:
        self.ctx: int | None = None
        self._nested()

    def _nested(self) -> None:
        self.nested = "n"
        self._init_ctx(True)  # a cycle: read once

    def _second(this) -> None:
        this.other_self_name = 2.0

    def _never_called(self) -> None:
        self.later = 0

    @staticmethod
    def _static(host: Any) -> None:
        host.static = 1


class CallsInheritedHelper(CallsHelpers):
    """Calls a helper its base defines: not read (only the class's own methods are)."""

    def __init__(self) -> None:
        super().__init__(True)
        self._never_called()
        self._static(self)


def test_methods_init_calls_on_self_declare_what_they_assign() -> None:
    """Assignments in methods of the class that __init__ calls (transitively) declare."""
    assert init_assignment_sites(CallsHelpers) == {
        "direct": (None, "__init__"),
        "ctx": ("int | None", "_init_ctx"),
        "nested": (None, "_nested"),
        "other_self_name": (None, "_second"),
    }
    assert init_assignments(CallsHelpers) == {
        "direct": None,
        "ctx": "int | None",
        "nested": None,
        "other_self_name": None,
    }


def test_declaration_in_a_called_method_names_it() -> None:
    """find_declaration reports the method as ``via``; ``how`` says it for explain."""
    decl = _found(CallsHelpers, "ctx")
    assert decl == Declaration(CallsHelpers, DeclarationKind.INIT, int | None, True, "_init_ctx")
    assert decl.how == "assigned in _init_ctx, which __init__ calls"
    direct = _found(CallsHelpers, "direct")
    assert direct.via is None
    assert direct.how == "assigned in __init__"


def test_methods_not_called_by_init_and_inherited_methods_do_not_declare() -> None:
    """A method __init__ never calls, a base's method and a static method are not read."""
    assert find_declaration(CallsHelpers, "later", NOTHING) is None
    assert init_assignments(CallsInheritedHelper) == {}
    assert find_declaration(CallsInheritedHelper, "static", NOTHING) is None
    assert _found(CallsInheritedHelper, "ctx").owner is CallsHelpers


# --------------------------------------------------------------------------- provided methods


class MixinBase:
    """Provides methods of every kind, and attributes that are not methods."""

    CONSTANT = 3
    table: ClassVar[dict[str, int]] = {}

    class Nested:
        """A nested class is not a method."""

    def base_method(self) -> None:
        """A method."""

    def shared(self) -> None:
        """Overridden below: listed once."""

    def trailing__(self) -> None:
        """Ends with two underscores but does not start with them: not a dunder."""

    def __private(self) -> None:
        """Name-mangled: stored as _MixinBase__private."""

    def __repr__(self) -> str:
        return "dunder"


class MixinChild(MixinBase):
    """Adds static, class, property and callable-object members."""

    helper = functools.partial(print)

    def shared(self) -> None:
        """Overrides the base."""

    @staticmethod
    def static() -> None:
        """A static method."""

    @classmethod
    def klass(cls) -> None:
        """A class method."""

    @property
    def prop(self) -> int:
        """A property."""
        return 1

    def __init__(self) -> None:
        """A dunder: left out."""


def test_provided_methods_lists_methods_in_mro_order_without_dunders() -> None:
    """Methods, static and class methods, properties and callables, each once, in MRO order."""
    assert provided_methods(MixinChild) == (
        "helper",
        "shared",
        "static",
        "klass",
        "prop",
        "base_method",
        "trailing__",
        "_MixinBase__private",
    )


def test_provided_methods_of_a_class_without_methods_is_empty() -> None:
    """A class with only data and dunders provides nothing."""

    class Empty:
        value = 1

        def __init__(self) -> None:
            pass

    assert provided_methods(Empty) == ()
    assert provided_methods(object) == ()
