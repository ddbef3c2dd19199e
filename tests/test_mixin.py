"""The StagingHost contract as StagingManagerMixin enforces it on backends."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Final

import pytest

from staging_contracts import (
    STAGING_CONTRACT,
    ArrivalMode,
    ContractError,
    DecodeStagingContext,
    KVArgs,
    KVBufferTensors,
    PrefillStagingContext,
    StagingHandler,
    StagingManagerMixin,
)
from tests.hosts import CommonBase, RecordingHandler, make_kv_args

HANDLER_T = "StagingHandler | None"
CTX_T = "DecodeStagingContext | PrefillStagingContext | None"
ARRIVAL_T = "Literal['notification', 'zmq']"


class MooncakeLike(StagingManagerMixin, CommonBase):
    """A conforming backend: the mixin first, the staging members declared."""

    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"


# --------------------------------------------------------------------------- class creation


def test_mori_style_host_is_rejected_at_class_creation() -> None:
    """A host declaring only kv_args and attn_tp_size is rejected, naming both staging members."""
    with pytest.raises(ContractError) as info:

        class MoriKVManager(StagingManagerMixin, CommonBase):  # type: ignore[staging-missing-member]  # the mistake under test
            pass

    assert str(info.value) == (
        "MoriKVManager does not satisfy the StagingHost contract of StagingManagerMixin:\n"
        f"  - has no declaration of '_staging_handler' (expected {HANDLER_T})\n"
        f"  - has no declaration of '_staging_ctx' (expected {CTX_T})\n"
        f"  - has no declaration of 'arrival' (expected {ARRIVAL_T})\n"
        "Fix: Declare each missing member on the class or one of its bases (annotate it, e.g. "
        f"'_staging_handler: {HANDLER_T}', or assign it in __init__), or pass abstract=True "
        "for an intermediate base."
    )
    assert info.value.cls.__name__ == "MoriKVManager"
    assert info.value.missing == ("_staging_handler", "_staging_ctx", "arrival")
    assert info.value.mismatched == ()
    assert info.value.shadowed == ()
    assert isinstance(info.value, TypeError)


def test_contract_error_lists_every_problem_at_once() -> None:
    """Missing, mismatched and shadowed members are all reported by one error."""

    class Shadow:
        def attach_staging_handler(self, handler: object) -> None:
            """Shadows the mixin's method."""

    with pytest.raises(ContractError, match=r"^Bad does not satisfy") as info:

        class Bad(Shadow, StagingManagerMixin, CommonBase):  # type: ignore[staging-missing-member, staging-member-type, staging-shadowed-method]  # the mistake under test
            _staging_handler: StagingHandler | None = None
            attn_tp_size: str  # type: ignore[assignment]  # the mistake under test
            arrival: ArrivalMode = "zmq"

    assert info.value.missing == ("_staging_ctx",)
    assert info.value.mismatched == ("attn_tp_size",)
    assert info.value.shadowed == ("attach_staging_handler",)
    assert len(info.value.problems) == 3


def test_mixin_on_common_base_rejects_mori_style_subclass() -> None:
    """With the mixin on a shared base, a Mori-style subclass of it cannot be defined."""

    class CommonWithStaging(StagingManagerMixin, CommonBase, abstract=True):
        pass

    with pytest.raises(ContractError, match=r"^MoriKVManager does not satisfy") as info:

        class MoriKVManager(CommonWithStaging):  # type: ignore[staging-missing-member]  # the mistake under test
            pass

    assert info.value.missing == ("_staging_handler", "_staging_ctx", "arrival")


def test_mixin_on_common_base_itself_is_rejected() -> None:
    """Putting the mixin on the common base without abstract=True fails on the base."""
    with pytest.raises(ContractError, match=r"^CommonKVManager does not satisfy"):

        class CommonKVManager(StagingManagerMixin, CommonBase):  # type: ignore[staging-missing-member]  # the mistake under test
            pass


def test_ascend_style_subclass_is_checked() -> None:
    """A subclass of a conforming backend is checked at its own class statement."""

    class AscendLike(MooncakeLike):
        pass

    assert isinstance(AscendLike(), MooncakeLike)
    with pytest.raises(ContractError, match=r"^AscendBroken does not satisfy") as info:

        class AscendBroken(MooncakeLike):  # type: ignore[staging-member-type]  # the mistake under test
            attn_tp_size: str  # type: ignore[assignment]  # the mistake under test

    assert info.value.mismatched == ("attn_tp_size",)
    assert "declares 'attn_tp_size' as str in AscendBroken (expected int)" in str(info.value)


def test_ascend_style_subclass_instances_are_checked() -> None:
    """The per-instance check also runs for a two-level subclass."""

    class AscendLike(MooncakeLike):
        def __init__(self) -> None:
            super().__init__()
            self.kv_args = "not kv args"  # type: ignore[assignment]  # the mistake under test

    with pytest.raises(ContractError, match=r"^AscendLike instance does not satisfy") as info:
        AscendLike()
    assert info.value.mismatched == ("kv_args",)


def test_abstract_intermediate_opts_out_for_itself_only() -> None:
    """abstract=True skips the check for that class; its subclasses are checked."""

    class StagingBase(StagingManagerMixin, CommonBase, abstract=True):
        _staging_handler: StagingHandler | None = None
        arrival: ArrivalMode = "zmq"

    class Complete(StagingBase):
        _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None

    assert Complete()._staging_ctx is None
    with pytest.raises(ContractError, match=r"^Incomplete does not satisfy") as info:

        class Incomplete(StagingBase):  # type: ignore[staging-missing-member]  # the mistake under test
            pass

    assert info.value.missing == ("_staging_ctx",)


def test_member_declared_by_property_is_accepted() -> None:
    """A property counts as a declaration, with its return annotation as the declared type."""

    class ByProperty(StagingManagerMixin, CommonBase):
        _staging_handler: StagingHandler | None = None

        @property
        def _staging_ctx(self) -> DecodeStagingContext | None:
            return None

        @property
        def arrival(self) -> ArrivalMode:
            return "zmq"

    assert ByProperty()._staging_ctx is None
    assert ByProperty().arrival == "zmq"


def test_member_declared_by_class_attribute_is_accepted() -> None:
    """A plain class attribute counts as a declaration."""

    class ByAttribute(StagingManagerMixin, CommonBase):
        _staging_handler = None
        _staging_ctx = None
        arrival: Final = "zmq"  # Final: a class attribute whose type is its literal value

    assert ByAttribute()._staging_handler is None


def test_member_declared_by_slots_is_accepted() -> None:
    """A __slots__ entry counts as a declaration."""

    class BySlots(StagingManagerMixin, CommonBase):
        __slots__ = ("_staging_ctx", "_staging_handler")

        def __init__(self) -> None:
            super().__init__()
            self._staging_handler = None
            self._staging_ctx = None
            self.arrival: ArrivalMode = "zmq"

    assert BySlots()._staging_ctx is None


def test_property_with_incompatible_type_is_rejected() -> None:
    """A property whose return annotation is clearly incompatible is a mismatch."""
    with pytest.raises(ContractError, match=r"^ByProperty does not satisfy") as info:

        class ByProperty(StagingManagerMixin, CommonBase):  # type: ignore[staging-member-type]  # the mistake under test
            _staging_handler: StagingHandler | None = None
            _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
            arrival: ArrivalMode = "zmq"

            @property
            def attn_tp_size(self) -> str:  # type: ignore[override]  # the mistake under test
                return "2"

    assert info.value.mismatched == ("attn_tp_size",)


def test_class_attribute_of_wrong_literal_type_is_rejected() -> None:
    """A class attribute whose value's type is incompatible is a mismatch."""
    with pytest.raises(ContractError, match=r"^WrongDefault does not satisfy") as info:

        class WrongDefault(StagingManagerMixin, CommonBase):  # type: ignore[staging-member-type]  # the mistake under test
            _staging_handler = None
            _staging_ctx = None
            arrival: Final = "zmq"
            attn_tp_size = "2"  # type: ignore[assignment]  # the mistake under test

    assert info.value.mismatched == ("attn_tp_size",)


def test_attn_tp_size_declared_as_str_is_rejected() -> None:
    """attn_tp_size: str is rejected, naming the member, the declaring class and both types."""
    with pytest.raises(ContractError, match=r"^StrTp does not satisfy") as info:

        class StrTp(MooncakeLike):  # type: ignore[staging-member-type]  # the mistake under test
            attn_tp_size: str  # type: ignore[assignment]  # the mistake under test

    assert info.value.problems[0].actual == "str"
    assert info.value.problems[0].expected == "int"
    assert info.value.problems[0].where == "StrTp"


def test_optional_kv_args_declaration_is_rejected() -> None:
    """Declaring kv_args as KVArgs | None admits a value the contract forbids."""
    with pytest.raises(ContractError, match=r"^MaybeArgs does not satisfy") as info:

        class MaybeArgs(MooncakeLike):  # type: ignore[staging-member-type]  # the mistake under test
            kv_args: KVArgs | None  # type: ignore[assignment]  # the mistake under test

    assert "declares 'kv_args' as KVArgs | None in MaybeArgs (expected KVArgs)" in str(info.value)


def test_narrower_declared_types_are_accepted() -> None:
    """A declared subtype of the expected type is fine (a concrete handler, bool for int)."""

    class Narrow(StagingManagerMixin, CommonBase):
        _staging_handler: RecordingHandler | None = None
        _staging_ctx: DecodeStagingContext | None = None
        arrival: ArrivalMode = "notification"

    assert Narrow()._staging_handler is None


def test_wrong_base_order_is_rejected() -> None:
    """A base listed before the mixin that shadows a mixin method is named in the error."""

    class LegacyManager(CommonBase):
        def attach_staging_handler(self, handler: object) -> None:
            """An older method of the same name."""

    with pytest.raises(ContractError, match=r"^Reordered does not satisfy") as info:

        class Reordered(LegacyManager, StagingManagerMixin):  # type: ignore[staging-shadowed-method]  # the mistake under test
            _staging_handler: StagingHandler | None = None
            _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
            arrival: ArrivalMode = "zmq"

    assert info.value.shadowed == ("attach_staging_handler",)
    message = str(info.value)
    assert "method 'attach_staging_handler' of the mixin is shadowed by base 'LegacyManager'" in (
        message
    )
    assert message.endswith(
        "List StagingManagerMixin before 'LegacyManager' in the bases of the class."
    )


def test_deliberate_override_in_mixin_subclass_is_allowed() -> None:
    """A class that derives from the mixin may override a mixin method."""

    class Overriding(MooncakeLike):
        attached = 0

        def attach_staging_handler(self, handler: StagingHandler) -> None:
            type(self).attached += 1
            super().attach_staging_handler(handler)

    host = Overriding()
    host.attach_staging_handler(RecordingHandler())
    assert Overriding.attached == 1


# --------------------------------------------------------------------------- per instance


def test_wrong_value_type_after_init_is_rejected() -> None:
    """A member holding a value of the wrong type fails construction, naming the attribute."""
    with pytest.raises(ContractError) as info:
        MooncakeLike(attn_tp_size="2")
    assert str(info.value) == (
        "MooncakeLike instance does not satisfy the StagingHost contract of "
        "StagingManagerMixin after __init__:\n"
        "  - attribute 'attn_tp_size' is str (expected int)\n"
        "Fix: Assign each member a value of its expected type before __init__ returns."
    )
    assert info.value.instance
    assert info.value.mismatched == ("attn_tp_size",)


def test_unset_required_member_is_reported_missing() -> None:
    """A declared member that __init__ never sets is reported as not set."""

    class NeverSet(StagingManagerMixin, CommonBase):
        _staging_handler: StagingHandler | None
        _staging_ctx: DecodeStagingContext | PrefillStagingContext | None
        arrival: ArrivalMode = "zmq"

    with pytest.raises(ContractError, match=r"^NeverSet instance does not satisfy") as info:
        NeverSet()
    assert info.value.missing == ("_staging_ctx",)
    assert f"attribute '_staging_ctx' is not set (expected {CTX_T})" in str(info.value)


def test_a_member_set_later_may_be_unset_after_init() -> None:
    """_staging_handler is set later: unset after __init__ is fine, assigned it is checked."""

    class AttachedLater(StagingManagerMixin, CommonBase):
        _staging_handler: StagingHandler | None
        _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
        arrival: ArrivalMode = "zmq"

    host = AttachedLater()
    assert "_staging_handler" not in vars(host)
    handler = RecordingHandler()
    host._staging_handler = handler
    assert host._staging_handler is handler


def test_value_not_satisfying_handler_protocol_is_rejected() -> None:
    """An object lacking the handler methods is not a StagingHandler."""

    class BadHandlerHost(MooncakeLike):
        def __init__(self) -> None:
            super().__init__()
            self._staging_handler = object()  # type: ignore[assignment]  # the mistake under test

    with pytest.raises(ContractError, match=r"^BadHandlerHost instance") as info:
        BadHandlerHost()
    assert info.value.mismatched == ("_staging_handler",)


def test_optional_member_absent_is_accepted() -> None:
    """A host without kv_buffer_tensors conforms."""
    host = MooncakeLike()
    assert not hasattr(host, "kv_buffer_tensors")


def test_optional_member_present_with_wrong_type_is_rejected() -> None:
    """A present kv_buffer_tensors of the wrong type fails the instance check."""

    class WithBuffers(MooncakeLike):
        kv_buffer_tensors: KVBufferTensors | None

        def __init__(self, buffers: object) -> None:
            super().__init__()
            self.kv_buffer_tensors = buffers  # type: ignore[assignment]  # tests pass bad values

    assert WithBuffers(None).kv_buffer_tensors is None
    with pytest.raises(ContractError, match=r"^WithBuffers instance") as info:
        WithBuffers({"k_buffers": []})
    assert info.value.mismatched == ("kv_buffer_tensors",)
    assert "attribute 'kv_buffer_tensors' is dict (expected KVBufferTensors | None)" in str(
        info.value
    )


def test_kv_args_with_wrong_field_type_is_rejected() -> None:
    """kv_args is checked member by member, not only for presence."""

    class LooseArgs:
        def __init__(self) -> None:
            good = make_kv_args()
            for field in dataclasses.fields(good):
                setattr(self, field.name, getattr(good, field.name))
            self.page_size = "16"

    class LooseHost(MooncakeLike):
        def __init__(self) -> None:
            super().__init__()
            self.kv_args = LooseArgs()  # type: ignore[assignment]  # the mistake under test

    with pytest.raises(ContractError, match=r"^LooseHost instance") as info:
        LooseHost()
    assert "has attribute 'page_size' that is not an instance of int" in str(info.value)


def test_instance_check_runs_once_for_three_level_init_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three __init__ levels chained by super() trigger exactly one instance check."""
    calls: list[object] = []
    original = STAGING_CONTRACT.check_instance

    def counting(obj: object) -> None:
        calls.append(obj)
        original(obj)

    monkeypatch.setattr(STAGING_CONTRACT, "check_instance", counting)

    class Level1(StagingManagerMixin, CommonBase):
        _staging_handler: StagingHandler | None
        _staging_ctx: DecodeStagingContext | PrefillStagingContext | None
        arrival: ArrivalMode = "zmq"

        def __init__(self) -> None:
            super().__init__()
            self._staging_handler = None
            self._staging_ctx = None
            self.arrival: ArrivalMode = "zmq"

    class Level2(Level1):
        def __init__(self) -> None:
            super().__init__()
            self.level2 = True

    class Level3(Level2):
        def __init__(self) -> None:
            super().__init__()
            self.level3 = True

    host = Level3()
    assert calls == [host]


def test_instance_check_runs_after_the_outermost_init_only() -> None:
    """A subclass may fix up a member after super().__init__ without a false alarm."""

    class Parent(StagingManagerMixin, CommonBase):
        _staging_handler: StagingHandler | None = None
        _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
        arrival: ArrivalMode = "zmq"

        def __init__(self) -> None:
            super().__init__(attn_tp_size="pending")

    class Child(Parent):
        def __init__(self) -> None:
            super().__init__()
            self.attn_tp_size = 4

    assert Child().attn_tp_size == 4
    with pytest.raises(ContractError, match=r"^Parent instance"):
        Parent()


def test_instance_check_runs_with_init_inherited_from_plain_base() -> None:
    """A host without __init__ of its own, inheriting the base's, is still checked."""
    assert MooncakeLike().attn_tp_size == 2
    with pytest.raises(ContractError, match=r"^MooncakeLike instance"):
        MooncakeLike(attn_tp_size=None)


def test_instance_check_runs_when_plain_base_init_comes_first() -> None:
    """With the plain base listed first, its inherited __init__ is still wrapped."""

    class BaseFirst(CommonBase, StagingManagerMixin):
        _staging_handler: StagingHandler | None = None
        _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
        arrival: ArrivalMode = "zmq"

    assert BaseFirst().attn_tp_size == 2
    with pytest.raises(ContractError, match=r"^BaseFirst instance"):
        BaseFirst(attn_tp_size=2.5)


def test_dataclass_host_is_checked_after_its_generated_init() -> None:
    """A dataclass host is checked once its generated __init__ has set every field."""

    @dataclasses.dataclass
    class DataHost(StagingManagerMixin):
        kv_args: KVArgs
        attn_tp_size: int
        _staging_handler: StagingHandler | None = None
        _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
        arrival: ArrivalMode = "zmq"

    assert DataHost(make_kv_args(), 2).attn_tp_size == 2
    with pytest.raises(ContractError, match=r"^DataHost instance") as info:
        DataHost(make_kv_args(), "2")  # type: ignore[arg-type]  # the mistake under test
    assert info.value.mismatched == ("attn_tp_size",)


def test_instances_of_an_abstract_class_are_not_checked() -> None:
    """abstract=True also skips the per-instance check for that class's own instances."""

    class Partial(StagingManagerMixin, CommonBase, abstract=True):
        pass

    value: object = Partial(attn_tp_size="anything").attn_tp_size
    assert value == "anything"


def test_init_failure_propagates_without_instance_check() -> None:
    """An exception from __init__ is raised as is; no contract error masks it."""

    class Failing(MooncakeLike):
        def __init__(self) -> None:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match=r"^boom$"):
        Failing()
    # The construction flag was cleared: a later instance is checked normally.
    assert MooncakeLike().attn_tp_size == 2


def test_method_calls_do_not_run_the_instance_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """After construction, calling methods never checks the contract again."""
    host = MooncakeLike()

    def fail(obj: object) -> None:
        raise AssertionError("checked on a method call")

    monkeypatch.setattr(STAGING_CONTRACT, "check_instance", fail)
    host.attach_staging_handler(RecordingHandler())
    host.detach_staging_handler()
    assert host._staging_handler is None


# --------------------------------------------------------------------------- postponed annotations


def test_unresolvable_forward_references_raise_no_false_alarm() -> None:
    """Names defined later in the module, or only under TYPE_CHECKING, are not errors."""
    from tests.contract_fixtures import postponed

    assert postponed.ForwardRefHost()._staging_handler is None
    assert postponed.TypeCheckingOnlyHost()._staging_handler is None
    report = STAGING_CONTRACT.inspect_class(postponed.ForwardRefHost)
    assert report.problems == ()


def test_resolvable_string_annotation_is_checked() -> None:
    """A string annotation that can be resolved is held to the expected type."""
    with pytest.raises(ContractError, match=r"^StringAnnotated does not satisfy") as info:

        class StringAnnotated(MooncakeLike):  # type: ignore[staging-member-type]  # the mistake under test
            attn_tp_size: "str"  # type: ignore[assignment]  # noqa: UP037 - the case under test

    assert info.value.mismatched == ("attn_tp_size",)


# --------------------------------------------------------------------------- handler and logging


def test_attach_staging_handler_checks_the_handler() -> None:
    """attach_staging_handler accepts a StagingHandler and rejects anything else."""
    host = MooncakeLike()
    handler = RecordingHandler()
    host.attach_staging_handler(handler)
    assert host._staging_handler is handler
    bad: Any = object()
    with pytest.raises(ContractError, match=r"^MooncakeLike instance") as info:
        host.attach_staging_handler(bad)
    assert info.value.mismatched == ("_staging_handler",)
    assert host._staging_handler is handler


def test_logger_is_the_concrete_backend_module_logger(caplog: pytest.LogCaptureFixture) -> None:
    """The mixin logs through the logger of the backend's own module."""
    from tests.contract_fixtures.backend_logging import LoggingBackend

    assert LoggingBackend._staging_logger.name == "tests.contract_fixtures.backend_logging"
    assert MooncakeLike._staging_logger.name == __name__
    host = LoggingBackend()
    with caplog.at_level(logging.DEBUG, logger="tests.contract_fixtures.backend_logging"):
        host.attach_staging_handler(RecordingHandler())
    assert [r.name for r in caplog.records] == ["tests.contract_fixtures.backend_logging"]


def test_staging_manager_mixin_exposes_its_contract() -> None:
    """StagingManagerMixin.contract is the StagingHost contract it enforces."""
    assert StagingManagerMixin.contract is STAGING_CONTRACT
    assert STAGING_CONTRACT.mixin is StagingManagerMixin
    assert STAGING_CONTRACT.required == (
        "_staging_handler",
        "_staging_ctx",
        "kv_args",
        "attn_tp_size",
        "arrival",
    )
    assert STAGING_CONTRACT.optional == ("kv_buffer_tensors",)
    assert STAGING_CONTRACT.set_later == ("_staging_handler", "kv_buffer_tensors")
    assert STAGING_CONTRACT.methods == ()


def test_member_assigned_in_init_counts_as_declared() -> None:
    """self.<name> = ... in __init__ declares the member, as mypy sees it."""

    class AssignsInInit(StagingManagerMixin, CommonBase):
        def __init__(self) -> None:
            super().__init__()
            self._staging_handler: StagingHandler | None = None
            self._staging_ctx = None
            self.arrival: ArrivalMode = "zmq"

    report = STAGING_CONTRACT.inspect_class(AssignsInInit)
    kinds = {row.spec.name: row.declaration.kind.value for row in report.members if row.declaration}
    assert kinds["_staging_handler"] == "assigned in __init__"
    assert kinds["_staging_ctx"] == "assigned in __init__"
    assert AssignsInInit()._staging_ctx is None


def test_annotated_init_assignment_with_wrong_type_is_rejected() -> None:
    """An annotated assignment in __init__ is held to the expected type."""
    with pytest.raises(ContractError, match=r"^WrongInInit does not satisfy") as info:

        class WrongInInit(StagingManagerMixin, CommonBase):  # type: ignore[staging-member-type]  # the mistake under test
            def __init__(self) -> None:
                super().__init__()
                self._staging_handler: StagingHandler | None = None
                self._staging_ctx: int = 0  # the mistake under test
                self.arrival: ArrivalMode = "zmq"

    assert info.value.mismatched == ("_staging_ctx",)
    assert "declares '_staging_ctx' as int in WrongInInit" in str(info.value)


def test_assignments_in_nested_scopes_do_not_count() -> None:
    """A nested function's self.<name> is another object's attribute."""
    with pytest.raises(ContractError, match=r"^Nested does not satisfy") as info:

        class Nested(StagingManagerMixin, CommonBase):  # type: ignore[staging-missing-member]  # the mistake under test
            _staging_handler: StagingHandler | None = None
            arrival: ArrivalMode = "zmq"

            def __init__(self) -> None:
                super().__init__()

                def other(self: Any) -> None:
                    self._staging_ctx = None

                del other

    assert info.value.missing == ("_staging_ctx",)
