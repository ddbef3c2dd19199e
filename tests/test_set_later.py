"""Members set after construction: unset after __init__ is fine; every assignment is checked."""

from __future__ import annotations

import types
from typing import Protocol

import pytest

from staging_contracts import Contract, ContractError, ContractMixin, StagingManagerMixin
from tests.hosts import CommonBase, RecordingHandler


class Handler(Protocol):
    """What the scheduler attaches later."""

    def handle(self, room: int) -> None: ...


class Attached(Protocol):
    """A handler attached later, a pool handed over later (optional), a size set at once."""

    handler: Handler | None
    pool: dict[str, int] | None
    size: int


ATTACHED = Contract(Attached, optional=("pool",), set_later=("handler", "pool"))


class AttachedMixin(ContractMixin, contract=ATTACHED):
    """Enforces Attached."""


class GoodHandler:
    """A Handler."""

    def handle(self, room: int) -> None:
        self.room = room


class Host(AttachedMixin):
    """Declares every member; sets only the size in __init__."""

    handler: Handler | None
    pool: dict[str, int] | None
    size: int

    def __init__(self) -> None:
        self.size = 1


def test_unset_members_set_later_pass_the_instance_check() -> None:
    """After __init__, a set-later member may be unset; a required one set at once may not."""
    host = Host()
    assert "handler" not in vars(host)
    ATTACHED.check_instance(host)
    assert ATTACHED.set_later == ("handler", "pool")


def test_a_wrong_typed_assignment_raises_and_keeps_the_old_value() -> None:
    """The assignment is refused at the assignment, naming the member and both types."""
    host = Host()
    handler = GoodHandler()
    host.handler = handler
    with pytest.raises(
        ContractError,
        match=(
            r"^Host instance does not satisfy the Attached contract of AttachedMixin "
            r"\(assignment refused; the member is unchanged\):\n"
            r"  - attribute 'handler' is str \(expected Handler \| None\)"
        ),
    ) as info:
        host.handler = "not a handler"  # type: ignore[assignment]  # the mistake under test
    assert host.handler is handler
    assert info.value.assignment
    assert info.value.instance
    assert info.value.mismatched == ("handler",)
    assert str(info.value).endswith("Fix: Assign a value of the expected type.")


def test_none_passes_where_the_type_allows_it() -> None:
    """None is a valid value of Handler | None, so detaching is an ordinary assignment."""
    host = Host()
    host.handler = GoodHandler()
    host.handler = None
    assert host.handler is None


def test_items_of_a_collection_are_checked_at_the_assignment() -> None:
    """Every item of a dict[str, int] is checked, not only the container."""
    host = Host()
    host.pool = {"pages": 4}
    with pytest.raises(ContractError, match=r"attribute 'pool' is dict") as info:
        host.pool = {"pages": "4"}  # type: ignore[dict-item]  # the mistake under test
    assert host.pool == {"pages": 4}
    assert "did not match any element in the union dict[str, int] | None" in str(info.value)


def test_other_attributes_are_assigned_unchecked() -> None:
    """A member that is not set later, and any other attribute, are not checked on assignment."""
    host = Host()
    host.size = 2
    host.anything = object()  # type: ignore[attr-defined]  # any attribute at all
    setattr(host, "size", "two")  # noqa: B010 - not watched: the instance check would see it
    assert getattr(host, "size") == "two"  # noqa: B009


def test_a_wrong_value_assigned_in_init_fails_construction_at_that_line() -> None:
    """An __init__ that assigns a wrong-typed set-later member fails there."""

    class EagerHost(AttachedMixin):
        handler: Handler | None
        size: int = 1

        def __init__(self) -> None:
            self.handler = 3  # type: ignore[assignment]  # the mistake under test

    with pytest.raises(ContractError, match=r"assignment refused") as info:
        EagerHost()
    assert info.value.mismatched == ("handler",)


def test_the_check_runs_before_a_base_setattr_further_down_the_mro() -> None:
    """A base after the mixin with its own __setattr__ still sees only accepted values."""
    seen: list[tuple[str, object]] = []

    class Recording:
        def __setattr__(self, name: str, value: object) -> None:
            seen.append((name, value))
            object.__setattr__(self, name, value)

    class Both(AttachedMixin, Recording):
        handler: Handler | None
        size: int = 1

    host = Both()
    handler = GoodHandler()
    host.handler = handler
    with pytest.raises(ContractError):
        host.handler = 5  # type: ignore[assignment]  # the mistake under test
    assert seen == [("handler", handler)]


def test_a_base_before_the_mixin_that_defines_setattr_is_a_shadowing_problem() -> None:
    """Listed before the mixin, a base's __setattr__ would skip the check: rejected."""

    class Recording:
        def __setattr__(self, name: str, value: object) -> None:
            object.__setattr__(self, name, value)

    with pytest.raises(ContractError) as info:
        types.new_class(
            "Hidden",
            (Recording, AttachedMixin),
            exec_body=lambda ns: ns.update(
                {"__annotations__": {"handler": Handler | None, "size": int}}
            ),
        )
    assert info.value.shadowed == ("__setattr__",)


def test_a_contract_without_set_later_members_adds_no_setattr() -> None:
    """No set-later member, no __setattr__: assignments stay Python's own."""

    class Plain(Protocol):
        size: int

    class PlainMixin(ContractMixin, contract=Contract(Plain)):
        pass

    assert "__setattr__" not in vars(PlainMixin)
    assert "__setattr__" in vars(AttachedMixin)


def test_staging_handler_is_checked_when_assigned_directly() -> None:
    """Our own contract: assigning _staging_handler on a built host is checked, as SGLang's
    decode assigns it after construction."""
    from tests.test_mixin import MooncakeLike

    host = MooncakeLike()
    handler = RecordingHandler()
    host._staging_handler = handler
    with pytest.raises(ContractError, match=r"attribute '_staging_handler' is int"):
        host._staging_handler = 7  # type: ignore[assignment]  # the mistake under test
    assert host._staging_handler is handler
    with pytest.raises(ContractError, match=r"attribute 'kv_buffer_tensors' is dict"):
        setattr(host, "kv_buffer_tensors", {"k_buffers": []})  # noqa: B010 - the mistake under test
    assert isinstance(host, StagingManagerMixin)


def test_common_base_assignments_are_not_checked() -> None:
    """The common base's own attributes go straight through."""
    from tests.test_mixin import MooncakeLike

    host = MooncakeLike()
    host.attn_tp_size = 4
    assert isinstance(host, CommonBase)
    assert host.attn_tp_size == 4


def test_set_later_must_name_attribute_members() -> None:
    """A method, or a name that is no member, cannot be set later."""

    class WithMethod(Protocol):
        size: int

        def start(self) -> None: ...

    with pytest.raises(TypeError, match=r"^set_later names \['start'\] are methods"):
        Contract(WithMethod, set_later=("start",))
    with pytest.raises(TypeError, match=r"^set_later names \['nope'\] are not members"):
        Contract(WithMethod, set_later=("nope",))


def test_two_mixins_with_set_later_members_share_a_host_in_either_order() -> None:
    """Each mixin's __setattr__ hands assignments on, so both checks run whichever is first."""

    class Pooled(Protocol):
        pool: dict[str, int] | None

    class PoolMixin(ContractMixin, contract=Contract(Pooled, set_later=("pool",))):
        pass

    class HandlerFirst(AttachedMixin, PoolMixin):
        handler: Handler | None
        pool: dict[str, int] | None
        size: int = 1

    class PoolFirst(PoolMixin, AttachedMixin):
        handler: Handler | None
        pool: dict[str, int] | None
        size: int = 1

    for host_class in (HandlerFirst, PoolFirst):
        host = host_class()
        with pytest.raises(ContractError, match=r"attribute 'handler' is int"):
            host.handler = 1  # type: ignore[assignment]  # the mistake under test
        with pytest.raises(ContractError, match=r"attribute 'pool' is list"):
            host.pool = [1]  # type: ignore[assignment]  # the mistake under test
        host.pool = {"pages": 1}
        host.handler = GoodHandler()
        assert host.pool == {"pages": 1}
