"""ContractMixin: the contract enforced at class creation and once per instance, on any mixin.

Hosts (and, where the mixin's own creation is under test, mixins) are defined inside the tests,
so that their class statements run the enforcement code while the test runs.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, ClassVar, Protocol

import pytest

from staging_contracts import Contract, ContractError, ContractMixin
from staging_contracts._contract.contract import ABSTRACT_MARK
from staging_contracts._contract.enforcement import _active, contract_roots


class SizedHost(Protocol):
    """The contract of the mixins below: one integer member."""

    size: int


class NamedHost(Protocol):
    """A second contract, for hosts of two mixins."""

    name: str


SIZED = Contract(SizedHost)
NAMED = Contract(NamedHost)


class SizedMixin(ContractMixin, contract=SIZED):
    """Enforces SizedHost; provides one method."""

    def doubled(self: SizedHost) -> int:
        """Uses the contract's member."""
        return self.size * 2


class NamedMixin(ContractMixin, contract=NAMED):
    """Enforces NamedHost."""


class PlainBase:
    """A base that knows nothing of contracts; its __init__ takes the size."""

    def __init__(self, size: object = 1, *, name: object = "plain") -> None:
        self.size = size
        self.name = name


def _count_checks(monkeypatch: pytest.MonkeyPatch, contract: Contract) -> list[object]:
    calls: list[object] = []
    original = contract.check_instance

    def counting(obj: object) -> None:
        calls.append(obj)
        original(obj)

    monkeypatch.setattr(contract, "check_instance", counting)
    return calls


# --------------------------------------------------------------------------- the mixin itself


def test_defining_a_mixin_binds_and_exposes_its_contract() -> None:
    """contract= binds the contract to the mixin, which exposes it and becomes a root."""

    class LocalHost(Protocol):
        size: int

    contract = Contract(LocalHost)

    class LocalMixin(ContractMixin, contract=contract):
        pass

    assert contract.mixin is LocalMixin
    assert LocalMixin.__dict__["contract"] is contract
    assert contract_roots(LocalMixin) == (LocalMixin,)
    assert ABSTRACT_MARK not in LocalMixin.__dict__


def test_a_mixin_is_not_checked_against_its_own_contract() -> None:
    """The mixin lacks the members it requires, yet defining it raises nothing."""

    class LocalHost(Protocol):
        size: int
        name: str

    class LocalMixin(ContractMixin, contract=Contract(LocalHost)):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.from_mixin = True

    class Host(LocalMixin):
        size: int = 1
        name: str = "n"

    assert Host().from_mixin
    assert getattr(LocalMixin.__init__, "__contract_wrapper__", False)


def test_a_contract_mixin_cannot_be_abstract() -> None:
    """contract= and abstract=True together are a TypeError."""

    class LocalHost(Protocol):
        size: int

    with pytest.raises(TypeError, match=r"^a contract mixin cannot also be abstract=True$"):

        class LocalMixin(ContractMixin, contract=Contract(LocalHost), abstract=True):
            pass


def test_other_class_keywords_reach_the_next_base() -> None:
    """Class keywords the mixin does not know are passed on to the next __init_subclass__."""

    class Tagged:
        tag: ClassVar[str] = ""

        def __init_subclass__(cls, *, tag: str = "", **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            cls.tag = tag

    class Host(SizedMixin, Tagged, tag="hello"):
        size: int = 1

    class LocalHost(Protocol):
        size: int

    class LocalMixin(ContractMixin, Tagged, contract=Contract(LocalHost), tag="mixin"):
        pass

    assert Host.tag == "hello"
    assert LocalMixin.tag == "mixin"


def test_contract_roots_are_the_enforcing_mixins_nearest_first() -> None:
    """contract_roots lists every enforcing mixin of the MRO, nearest first, and no host."""

    class Both(NamedMixin, SizedMixin):
        size: int = 1
        name: str = "n"

    class Child(Both):
        pass

    assert contract_roots(Child) == (NamedMixin, SizedMixin)
    assert contract_roots(PlainBase) == ()


# --------------------------------------------------------------------------- class creation


def test_every_contract_is_checked_at_class_creation() -> None:
    """A host of two mixins is checked against both; the error names the failing one."""
    with pytest.raises(
        ContractError, match=r"^Host does not satisfy the SizedHost contract"
    ) as info:

        class Host(NamedMixin, SizedMixin):  # type: ignore[staging-missing-member]  # the mistake under test
            name: str = "n"

    assert info.value.missing == ("size",)
    assert info.value.mixin_name == "SizedMixin"


def test_abstract_flag_is_set_for_the_class_only() -> None:
    """abstract=True marks that class; its subclass is marked False and is checked."""

    class Base(SizedMixin, abstract=True):
        pass

    class Complete(Base):
        size: int = 3

    assert Base.__dict__[ABSTRACT_MARK] is True
    assert Complete.__dict__[ABSTRACT_MARK] is False
    with pytest.raises(ContractError, match=r"^Incomplete does not satisfy"):

        class Incomplete(Base):  # type: ignore[staging-missing-member]  # the mistake under test
            pass


# --------------------------------------------------------------------------- per instance


def test_instances_of_every_contract_are_checked() -> None:
    """An instance is checked against each contract of its mixins, the farther one too."""

    class Host(NamedMixin, SizedMixin):
        size: int
        name: str = "n"

        def __init__(self, size: object) -> None:
            self.size = size  # type: ignore[assignment]  # tests pass bad values

    assert Host(3).doubled() == 6
    with pytest.raises(ContractError, match=r"^Host instance does not satisfy the SizedHost"):
        Host("3")


def test_own_init_is_wrapped_keeping_its_identity() -> None:
    """A host's own __init__ is replaced by a wrapper that keeps its name, doc and module."""

    class Host(SizedMixin):
        size: int

        def __init__(self, size: int) -> None:
            """Sets the size."""
            self.size = size

    init: Any = Host.__init__
    assert init.__contract_wrapper__ is True
    assert init.__name__ == "__init__"
    assert init.__qualname__.endswith("<locals>.Host.__init__")
    assert init.__doc__ == "Sets the size."
    assert init.__module__ == __name__
    assert init.__wrapped__.__doc__ == "Sets the size."
    assert not hasattr(init.__wrapped__, "__contract_wrapper__")


def test_callable_object_as_init_is_wrapped_with_default_names() -> None:
    """An __init__ that is a callable object without a name is wrapped as '__init__'."""

    class SetSize:
        """Sets the size of the object it is given."""

        def __call__(self, obj: Any, size: object) -> None:
            obj.size = size

    setter = SetSize()

    class Host(SizedMixin):
        size: int
        __init__ = setter

    init: Any = Host.__init__
    assert init.__name__ == "__init__"
    assert init.__qualname__ == "__init__"
    assert init.__doc__ == "Sets the size of the object it is given."
    assert init.__module__ == __name__
    assert init.__wrapped__ is setter
    host: Any = Host
    assert host(4).size == 4
    with pytest.raises(ContractError, match=r"^Host instance"):
        host("4")


def test_an_init_already_wrapped_is_not_wrapped_again() -> None:
    """An __init__ taken from another host keeps its single wrapper."""

    class First(SizedMixin):
        size: int

        def __init__(self) -> None:
            self.size = 1

    class Second(SizedMixin):
        size: int
        __init__ = First.__init__

    assert Second.__dict__["__init__"] is First.__dict__["__init__"]
    assert Second().size == 1


def test_positional_and_keyword_arguments_reach_a_nested_init(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Arguments pass through the inner, re-entrant wrapper; the check runs once, at the end."""
    calls = _count_checks(monkeypatch, SIZED)
    seen: list[object] = []

    class Parent(SizedMixin):
        size: int

        def __init__(self, size: object, *extra: object, label: str = "") -> None:
            seen.append(id(self) in _active())
            self.size = size  # type: ignore[assignment]  # tests pass bad values
            self.extra = extra
            self.label = label

    class Child(Parent):
        def __init__(self, size: object, *extra: object, label: str = "") -> None:
            seen.append(id(self) in _active())
            super().__init__("pending", *extra, label=label)
            self.size = size  # type: ignore[assignment]  # tests pass bad values

    child = Child(5, "a", "b", label="c")
    assert (child.size, child.extra, child.label) == (5, ("a", "b"), "c")
    assert seen == [True, True]
    assert calls == [child]
    assert _active() == set()


def test_each_thread_keeps_its_own_constructing_set() -> None:
    """A thread that has never constructed anything gets a set of its own, kept between calls."""
    outcome: list[object] = []

    class Parent(SizedMixin):
        size: int

        def __init__(self, size: object) -> None:
            self.size = size  # type: ignore[assignment]  # tests pass bad values

    class Child(Parent):
        def __init__(self) -> None:
            super().__init__("pending")
            outcome.append(id(self) in _active())
            self.size = 1

    def build() -> None:
        try:
            outcome.append(_active() is _active())
            outcome.append(Child().size)
            outcome.append(_active())
        except Exception as exc:  # noqa: BLE001 - reported to the main thread
            outcome.append(exc)

    worker = threading.Thread(target=build)
    worker.start()
    worker.join()
    assert outcome == [True, True, 1, set()]


def test_constructing_set_is_cleared_after_a_failed_init() -> None:
    """An __init__ that raises leaves nothing in the constructing set, and no check runs."""

    class Host(SizedMixin):
        size: int

        def __init__(self, size: object, fail: bool) -> None:
            self.size = size  # type: ignore[assignment]  # tests pass bad values
            if fail:
                raise ValueError("no")

    with pytest.raises(ValueError, match=r"^no$"):
        Host("bad", True)
    assert _active() == set()
    with pytest.raises(ContractError, match=r"^Host instance"):
        Host("bad", False)
    assert _active() == set()


def test_instance_is_checked_again_when_its_id_is_reused() -> None:
    """Each construction is checked, also one following a bad one (the set was emptied)."""

    class Host(SizedMixin):
        size: int

        def __init__(self, size: object) -> None:
            self.size = size  # type: ignore[assignment]  # tests pass bad values

    for _ in range(3):
        with pytest.raises(ContractError, match=r"^Host instance"):
            Host("bad")
        assert Host(1).size == 1
    assert _active() == set()


def test_mixin_first_forwards_positional_arguments_to_the_base() -> None:
    """With the mixin first and no __init__ of its own, the base's __init__ gets every argument."""

    class Host(SizedMixin, PlainBase):
        size: int
        name: str

    assert "__init__" not in Host.__dict__
    host = Host(7, name="x")
    assert (host.size, host.name) == (7, "x")
    with pytest.raises(ContractError, match=r"^Host instance"):
        Host("7")
    assert _active() == set()


def test_base_first_gets_a_forwarding_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain base listed first: the host gets its own __init__ that forwards every argument."""
    calls = _count_checks(monkeypatch, SIZED)

    class Host(PlainBase, SizedMixin):
        size: int
        name: str

    init: Any = Host.__dict__["__init__"]
    assert init.__contract_wrapper__ is True
    assert init.__qualname__ == f"{Host.__qualname__}.__init__"
    assert init.__module__ == __name__
    host = Host(9, name="y")
    assert (host.size, host.name) == (9, "y")
    assert calls == [host]
    with pytest.raises(ContractError, match=r"^Host instance") as info:
        Host("9")
    assert info.value.mismatched == ("size",)


def test_forwarding_init_is_inherited_not_duplicated() -> None:
    """A subclass of a host with a forwarding __init__ inherits that one."""

    class Host(PlainBase, SizedMixin):
        size: int

    class Child(Host):
        pass

    assert "__init__" not in Child.__dict__
    assert Child(2).size == 2
    with pytest.raises(ContractError, match=r"^Child instance"):
        Child("2")


def test_subclass_of_the_mixin_keeps_its_inherited_init() -> None:
    """A host whose inherited __init__ comes from the mixin side gets no forwarding __init__."""

    class Host(SizedMixin):
        size: int = 1

    assert "__init__" not in Host.__dict__
    assert Host().size == 1


# --------------------------------------------------------------------------- dataclasses


def test_dataclass_host_with_its_own_post_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dataclass host's own __post_init__ runs before the single check, which sees its fixes."""
    calls = _count_checks(monkeypatch, SIZED)

    @dataclasses.dataclass
    class Host(SizedMixin):
        size: int
        text: str = ""

        def __post_init__(self) -> None:
            """Parses text into size."""
            if self.text:
                self.size = int(self.text)
            super().__post_init__()  # type: ignore[misc]  # the mixin's, at runtime

    post_init: Any = Host.__post_init__
    assert post_init.__contract_wrapper__ is True
    assert post_init.__name__ == "__post_init__"
    assert post_init.__doc__ == "Parses text into size."
    host = Host("pending", "12")  # type: ignore[arg-type]  # fixed by __post_init__
    assert host.size == 12
    assert calls == [host]
    with pytest.raises(ContractError, match=r"^Host instance") as info:
        Host("bad")  # type: ignore[arg-type]  # the mistake under test
    assert info.value.mismatched == ("size",)
    assert len(calls) == 2
    assert _active() == set()


def test_dataclass_host_post_init_passes_init_vars_to_the_next_base() -> None:
    """The mixin's __post_init__ hands the InitVars on to a base's __post_init__, then checks."""
    seen: list[tuple[object, ...]] = []

    class Recording:
        def __post_init__(self, *args: object) -> None:
            seen.append(args)

    @dataclasses.dataclass
    class Host(SizedMixin, Recording):
        size: int
        first: dataclasses.InitVar[int]
        second: dataclasses.InitVar[str]

    assert Host(1, 2, "3").size == 1
    assert seen == [(2, "3")]
    with pytest.raises(ContractError, match=r"^Host instance"):
        Host("1", 2, "3")  # type: ignore[arg-type]  # the mistake under test
    assert len(seen) == 2


def test_dataclass_host_without_post_init_is_checked_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The generated __init__ calls the mixin's __post_init__, which checks exactly once."""
    calls = _count_checks(monkeypatch, SIZED)

    @dataclasses.dataclass
    class Host(SizedMixin):
        size: int

    host = Host(3)
    assert calls == [host]
    assert _active() == set()
