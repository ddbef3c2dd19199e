"""Protocol methods and properties are members of a contract, checked like attributes."""

from __future__ import annotations

import types
from typing import Any, Protocol

import pytest

from staging_contracts import Contract, ContractError, ContractMixin, MemberKind, MemberStatus


class Capable(Protocol):
    """Set-up methods and a property, as a serving stack's staging host has them."""

    kv_args: int

    def set_kv_buffer_tensors(
        self, k_buffers: list[Any], v_buffers: list[Any], page_size: int, slot_ids: Any = None
    ) -> None: ...

    def _init_staging_allocator(self) -> None: ...

    @property
    def arrival(self) -> str: ...


CAPABLE = Contract(Capable)


class CapableMixin(ContractMixin, contract=CAPABLE):
    """Enforces Capable; provides a method of its own."""

    def provided(self) -> None:
        """A method of the mixin."""


class CommonBase:
    """Declares the data member only, like a common base without staging."""

    kv_args: int = 0


def test_methods_and_properties_are_members_in_protocol_order() -> None:
    """The members: the attribute, both methods and the property, kinds and flags set."""
    assert [(m.name, m.kind) for m in CAPABLE.members] == [
        ("kv_args", MemberKind.ATTRIBUTE),
        ("set_kv_buffer_tensors", MemberKind.METHOD),
        ("_init_staging_allocator", MemberKind.METHOD),
        ("arrival", MemberKind.ATTRIBUTE),
    ]
    assert CAPABLE.methods == ("set_kv_buffer_tensors", "_init_staging_allocator")
    spec = CAPABLE.members[1]
    assert spec.is_method
    assert spec.expected_name == (
        "a method set_kv_buffer_tensors(k_buffers, v_buffers, page_size, slot_ids=None)"
    )
    assert CAPABLE.members[3].expected is str


def test_a_contract_of_methods_only_has_members_and_rejects_a_class_without_them() -> None:
    """A Protocol of methods alone is no empty contract: a class lacking them fails."""

    class OnlyMethods(Protocol):
        def start(self) -> None: ...

    contract = Contract(OnlyMethods)
    assert contract.required == ("start",)
    report = contract.inspect_class(type("Nothing", (), {}))
    assert not report.conforms
    assert [p.member for p in report.problems] == ["start"]


def test_a_host_lacking_the_methods_is_rejected_in_one_report() -> None:
    """A Mori-like host with the data member from its base, but none of the capabilities."""
    with pytest.raises(ContractError, match=r"^MoriLike does not satisfy") as info:
        types.new_class("MoriLike", (CapableMixin, CommonBase))
    error = info.value
    assert error.missing == ("set_kv_buffer_tensors", "_init_staging_allocator", "arrival")
    text = str(error)
    assert (
        "  - has no declaration of 'set_kv_buffer_tensors' (expected a method "
        "set_kv_buffer_tensors(k_buffers, v_buffers, page_size, slot_ids=None))"
    ) in text
    assert "for a method, define it, e.g. 'def set_kv_buffer_tensors(self, k_buffers" in text
    assert [p.method for p in error.problems] == [True, True, False]


def test_a_method_the_mixin_provides_does_not_satisfy_the_host_requirement() -> None:
    """The mixin's own method of that name is not the host's."""

    class NeedsProvided(Protocol):
        def provided(self) -> None: ...

    class ProvidingMixin(ContractMixin, contract=Contract(NeedsProvided)):
        def provided(self) -> None:
            """Satisfies nothing: it is the mixin's."""

    with pytest.raises(ContractError) as info:
        types.new_class("Host", (ProvidingMixin,))
    assert info.value.missing == ("provided",)


def test_a_conforming_host_with_methods_and_a_property_is_accepted() -> None:
    """Methods with compatible signatures and a property satisfy the contract."""

    class Good(CapableMixin, CommonBase):
        def set_kv_buffer_tensors(
            self, k_buffers: list[Any], v_buffers: list[Any], page_size: int, slot_ids: Any = None
        ) -> None:
            self.pool = (k_buffers, v_buffers, page_size, slot_ids)

        def _init_staging_allocator(self, *extra: object) -> None:
            self.allocator = extra

        @property
        def arrival(self) -> str:
            return "zmq"

    host = Good()
    assert host.arrival == "zmq"
    statuses = {row.spec.name: row.status for row in CAPABLE.inspect_class(Good).members}
    assert statuses == dict.fromkeys(statuses, MemberStatus.OK)
    assert CAPABLE.explain(Good).splitlines()[-1] == "verdict: conforms"


def test_a_method_that_cannot_take_the_protocol_calls_is_mismatched() -> None:
    """A signature without a parameter the Protocol passes is reported with the failing call."""
    with pytest.raises(ContractError, match=r"^Narrow does not satisfy") as info:

        class Narrow(CapableMixin, CommonBase):  # type: ignore[staging-member-type]  # the mistake under test
            def set_kv_buffer_tensors(self, k_buffers: list[Any]) -> None: ...

            def _init_staging_allocator(self) -> None: ...

            arrival = "zmq"

    assert info.value.mismatched == ("set_kv_buffer_tensors",)
    assert (
        "declares 'set_kv_buffer_tensors' as a method (k_buffers) in Narrow (expected a method "
        "set_kv_buffer_tensors(k_buffers, v_buffers, page_size, slot_ids=None)): cannot be "
        "called as (k_buffers, v_buffers, page_size): too many positional arguments"
    ) in str(info.value)


def test_a_value_declared_where_a_method_is_required_is_mismatched() -> None:
    """'name = None' where a method is required is certainly not callable."""
    with pytest.raises(ContractError) as info:

        class NoneInstead(CapableMixin, CommonBase):  # type: ignore[staging-member-type]  # the mistake under test
            set_kv_buffer_tensors = None

            def _init_staging_allocator(self) -> None: ...

            arrival = "zmq"

    assert info.value.mismatched == ("set_kv_buffer_tensors",)
    assert "declares 'set_kv_buffer_tensors' as None in NoneInstead" in str(info.value)


def test_a_method_declared_where_a_value_is_required_is_mismatched() -> None:
    """A method where an int is expected cannot hold an int."""
    with pytest.raises(ContractError) as info:

        class MethodInstead(CapableMixin):  # type: ignore[staging-member-type]  # the mistake under test
            def kv_args(self) -> int:
                return 1

            def set_kv_buffer_tensors(
                self, k_buffers: Any, v_buffers: Any, page_size: Any, slot_ids: Any = None
            ) -> None: ...

            def _init_staging_allocator(self) -> None: ...

            arrival = "zmq"

    assert info.value.mismatched == ("kv_args",)


def test_an_instance_whose_method_member_is_not_callable_is_rejected() -> None:
    """A method member assigned a value in __init__ is checked per instance."""

    class Callables(Protocol):
        def hook(self) -> None: ...

    class HookMixin(ContractMixin, contract=Contract(Callables)):
        pass

    class Host(HookMixin):
        hook: Any

        def __init__(self, hook: object) -> None:
            self.hook = hook

    assert Host(print).hook is print
    with pytest.raises(ContractError, match=r"^Host instance does not satisfy") as info:
        Host(3)
    assert info.value.mismatched == ("hook",)
    assert "method 'hook' is int (expected a method hook())" in str(info.value)
