"""The contract's messages where a backend author used to stumble.

Members set in helpers that ``__init__`` calls, the ``super().__init__()`` a constructor forgot,
two classes with one short name, and when a member left to the per-instance check is checked.
"""

from __future__ import annotations

import types

import pytest

from staging_contracts import (
    ArrivalMode,
    ContractError,
    DecodeStagingContext,
    KVArgs,
    PrefillStagingContext,
    StagingHandler,
    StagingManagerMixin,
)
from staging_contracts.backends._common import CommonKVManager, Role
from staging_contracts.engines.local import LocalEngine
from staging_contracts.mixin import STAGING_CONTRACT
from staging_contracts.testing import DecodeSetup


def _row(explanation: str, member: str) -> str:
    rows = [row for row in explanation.splitlines() if row.startswith(f"{member} ")]
    assert len(rows) == 1, explanation
    return rows[0]


# --------------------------------------------------------------------------- helpers of __init__


class ReferenceStyle(StagingManagerMixin, CommonKVManager):
    """Sets its staging members in a helper ``__init__`` calls, as the reference stack does."""

    def __init__(self, kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> None:
        super().__init__(kv_args, role=role, attn_tp_size=attn_tp_size, engine=LocalEngine())
        self._init_staging_decode_ctx()

    def _init_staging_decode_ctx(self) -> None:
        self._staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
        self.arrival: ArrivalMode = "zmq"
        self._staging_handler: StagingHandler | None = None


def test_members_set_in_a_helper_init_calls_are_declared() -> None:
    """The class statement passes, and explain says where the members are assigned."""
    explanation = STAGING_CONTRACT.explain(ReferenceStyle)
    assert explanation.splitlines()[-1] == "verdict: conforms"
    row = _row(explanation, "_staging_ctx")
    assert "ReferenceStyle (assigned in _init_staging_decode_ctx, which __init__ calls)" in row
    assert row.endswith("  ok")
    manager = ReferenceStyle(DecodeSetup().kv_args, role=Role.DECODE, attn_tp_size=1)
    try:
        STAGING_CONTRACT.check_instance(manager)
    finally:
        manager.close()


def test_a_helper_init_does_not_call_declares_nothing() -> None:
    """Assigning in a method __init__ never calls is still no declaration."""
    with pytest.raises(ContractError, match=r"has no declaration of '_staging_ctx'"):

        class Late(StagingManagerMixin, CommonKVManager):  # type: ignore[staging-missing-member]
            _staging_handler: StagingHandler | None = None

            def __init__(self) -> None:
                pass

            def setup(self) -> None:
                self._staging_ctx = None
                self.arrival: ArrivalMode = "zmq"


# --------------------------------------------------------------------------- super().__init__


class ForgotSuper(StagingManagerMixin, CommonKVManager):
    """Never calls CommonKVManager.__init__, so kv_args and attn_tp_size stay unset."""

    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"

    def __init__(self, kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> None:
        self.role = role


def test_members_a_base_sets_hint_at_super_init() -> None:
    """Unset members declared by a base: the fix asks whether __init__ called super()."""
    with pytest.raises(ContractError) as caught:
        ForgotSuper(DecodeSetup().kv_args, role=Role.DECODE, attn_tp_size=1)
    assert str(caught.value).splitlines() == [
        "ForgotSuper instance does not satisfy the StagingHost contract of StagingManagerMixin "
        "after __init__:",
        "  - attribute 'kv_args' is not set (expected KVArgs)",
        "  - attribute 'attn_tp_size' is not set (expected int)",
        "Fix: Assign each member a value of its expected type before __init__ returns. "
        "'kv_args', 'attn_tp_size' are declared by CommonKVManager: did "
        "ForgotSuper.__init__ call super().__init__()? If a member is assigned only on some "
        "paths, or by a later step, the contract should mark it optional or set_later.",
    ]
    assert [p.where for p in caught.value.problems] == ["CommonKVManager", "CommonKVManager"]


def test_members_the_class_itself_declares_get_no_super_hint() -> None:
    """An unset member the class itself declares: no super() hint."""

    class OwnMember(StagingManagerMixin, CommonKVManager):
        _staging_handler: StagingHandler | None = None
        _staging_ctx: DecodeStagingContext | PrefillStagingContext | None
        arrival: ArrivalMode = "zmq"
        kv_args: KVArgs
        attn_tp_size: int

        def __init__(self) -> None:
            self.kv_args = DecodeSetup().kv_args
            self.attn_tp_size = 1

    with pytest.raises(ContractError) as caught:
        OwnMember()
    assert "super().__init__()" not in str(caught.value)
    assert caught.value.missing == ("_staging_ctx",)


# --------------------------------------------------------------------------- short names


def _namesake_mixin() -> type:
    """A class named StagingManagerMixin in another module, as the reference code has."""
    module = types.ModuleType("reference.disaggregation")
    namespace = {"__module__": module.__name__, "attach_staging_handler": lambda self, h: None}
    return type("StagingManagerMixin", (), namespace)


def test_a_namesake_listed_before_the_mixin_is_named_with_its_module() -> None:
    """Two classes called StagingManagerMixin: the message qualifies both."""
    namesake = _namesake_mixin()
    with pytest.raises(ContractError) as caught:
        types.new_class(
            "Shadowed",
            (namesake, StagingManagerMixin, CommonKVManager),
            exec_body=lambda ns: ns.update(
                {
                    "__annotations__": {
                        "_staging_handler": StagingHandler | None,
                        "_staging_ctx": DecodeStagingContext | PrefillStagingContext | None,
                    },
                    "arrival": "zmq",
                }
            ),
        )
    assert str(caught.value).splitlines() == [
        "Shadowed does not satisfy the StagingHost contract of "
        "staging_contracts.StagingManagerMixin:",
        "  - method 'attach_staging_handler' of the mixin is shadowed by base "
        "'reference.disaggregation.StagingManagerMixin', which is listed before the mixin",
        "Fix: List staging_contracts.StagingManagerMixin before "
        "'reference.disaggregation.StagingManagerMixin' in the bases of the class.",
    ]


def test_distinct_short_names_stay_short() -> None:
    """Without namesakes, messages keep the short names."""
    shadow = type("Shadow", (), {"attach_staging_handler": lambda self, h: None})
    with pytest.raises(ContractError) as caught:
        types.new_class(
            "Shadowed",
            (shadow, StagingManagerMixin, CommonKVManager),
            exec_body=lambda ns: ns.update(
                {
                    "__annotations__": {
                        "_staging_handler": StagingHandler | None,
                        "_staging_ctx": DecodeStagingContext | PrefillStagingContext | None,
                    },
                    "arrival": "zmq",
                }
            ),
        )
    assert str(caught.value).splitlines()[-1] == (
        "Fix: List StagingManagerMixin before 'Shadow' in the bases of the class."
    )


# --------------------------------------------------------------------------- when it is checked


class NoMixin:
    """Declares every member, two by plain assignment only; mixes in nothing."""

    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"
    attn_tp_size: int

    def __init__(self) -> None:
        self.kv_args = None
        self._staging_handler = None


class AbstractBase(StagingManagerMixin, CommonKVManager, abstract=True):
    """Assigns one member without a type; its subclasses are checked."""

    def __init__(self, kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> None:
        super().__init__(kv_args, role=role, attn_tp_size=attn_tp_size, engine=LocalEngine())
        self._staging_handler = None


def test_a_class_nothing_checks_says_so_instead_of_checked_per_instance() -> None:
    """A class without the mixin: its untyped members are never checked, explain says so, and
    its verdict names them instead of saying 'conforms'."""
    explanation = STAGING_CONTRACT.explain(NoMixin)
    for member in ("_staging_handler", "kv_args"):
        assert _row(explanation, member).endswith("declared without a type: type not checked")
    assert "checked per instance" not in explanation.replace("checks them per instance", "")
    verdict = explanation.splitlines()[-1]
    assert verdict.startswith("verdict: every member declared; not verified: '_staging_handler'")
    assert "conforms" not in verdict


def test_an_abstract_class_says_its_subclasses_are_checked() -> None:
    """An abstract=True base: its untyped members are checked on its subclasses' instances."""
    explanation = STAGING_CONTRACT.explain(AbstractBase)
    assert _row(explanation, "_staging_handler").endswith(
        "declared without a type, checked per instance of its subclasses (abstract=True)"
    )


def test_a_concrete_host_is_checked_per_instance() -> None:
    """A concrete host keeps 'checked per instance': the mixin checks after __init__."""

    class Concrete(AbstractBase):
        _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
        arrival: ArrivalMode = "zmq"

    row = _row(STAGING_CONTRACT.explain(Concrete), "_staging_handler")
    assert "AbstractBase (assigned in __init__)" in row
    assert row.endswith("declared without a type, checked per instance")
