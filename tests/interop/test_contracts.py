"""Our contract tools pointed at the (unpatched) reference's managers, verdicts asserted.

Its ``MooncakeKVManager`` and ``NixlKVManager`` mix in its own ``StagingManagerMixin``, its
``AscendKVManager`` inherits Mooncake's, and its ``MoriKVManager`` has no staging. Its
``CommonKVManager`` declares ``_staging_ctx = None`` and assigns ``_staging_handler`` in
``__init__``, so every one of them, Mori included, "declares" the staging data members: a rule
on data members alone cannot tell them apart. Capabilities do: our ``StagingHost`` requires
our staging backends' ``arrival`` (which none of its classes has: they are not backends of our
staging path, and ``check`` says so instead of "conforms"), and a contract requiring its own
staging set-up methods rejects its Mori alone. The adoption patch
(``test_sglang_adoption.py``) puts that second contract on its own mixin.
"""

from __future__ import annotations

import types
from typing import Protocol

import pytest

from staging_contracts import STAGING_CONTRACT, Contract, ContractError, StagingManagerMixin
from staging_contracts._contract.contract import MemberStatus
from staging_contracts.backends.mori import MoriKVManager as OurMori
from staging_contracts.cli import main
from tests.interop._reference import Reference

MANAGERS = {
    "MooncakeKVManager": "sglang.srt.disaggregation.mooncake.conn",
    "NixlKVManager": "sglang.srt.disaggregation.nixl.conn",
    "AscendKVManager": "sglang.srt.disaggregation.ascend.conn",
    "MoriKVManager": "sglang.srt.disaggregation.mori.conn",
}


def manager(reference: Reference, name: str) -> type:
    """One of its manager classes."""
    module = {
        "MooncakeKVManager": reference.mooncake_conn,
        "NixlKVManager": reference.nixl_conn,
        "AscendKVManager": reference.ascend_conn,
        "MoriKVManager": reference.mori_conn,
    }[name]
    cls: type = getattr(module, name)
    return cls


@pytest.mark.parametrize("name", sorted(MANAGERS))
def test_explain_against_our_contract_finds_only_our_capability_missing(
    reference: Reference, name: str
) -> None:
    """Against our StagingHost, each of its managers declares every data member (its base
    does) and lacks only our staging backends' capability, arrival; the members declared
    without a type are said to be unchecked, never 'conforms'."""
    cls = manager(reference, name)
    text = STAGING_CONTRACT.explain(cls)
    lines = text.splitlines()
    assert lines[0].startswith(f"{MANAGERS[name]}.{name} against the StagingHost contract")
    assert lines[-1] == "verdict: does not conform: 1 problem(s)"
    report = STAGING_CONTRACT.inspect_class(cls)
    assert [p.member for p in report.problems] == ["arrival"]
    statuses = {row.spec.name: row.status for row in report.members}
    for member in ("_staging_handler", "_staging_ctx", "kv_args", "attn_tp_size"):
        assert statuses[member] is not MemberStatus.MISSING, member
    assert "declared without a type: type not checked" in text
    assert "conforms" not in text


def test_staging_contracts_check_says_they_do_not_conform_to_our_contract(
    reference: Reference, capsys: pytest.CaptureFixture[str]
) -> None:
    """`staging-contracts check` on the four exits 1 and says that none uses our enforcing
    mixin; it never says 'conforms' after a check of presence only."""
    del reference  # imported: `check` finds the modules in sys.modules
    targets = [f"{module}:{name}" for name, module in MANAGERS.items()]
    assert main(["check", *targets]) == 1
    out = capsys.readouterr().out
    assert out.count("verdict: does not conform: 1 problem(s)") == 4
    assert "verdict: conforms" not in out
    for target in targets:
        header = f"{target} does not use an enforcing mixin; against the StagingHost contract of "
        assert header in out


def test_check_of_an_unknown_class_of_it_exits_2(
    reference: Reference, capsys: pytest.CaptureFixture[str]
) -> None:
    """A target that is not one of its classes is 'not importable' (exit 2), not a verdict."""
    del reference
    assert main(["check", "sglang.srt.disaggregation.mori.conn:NoSuchManager"]) == 2
    assert "has no attribute 'NoSuchManager'" in capsys.readouterr().err


def test_its_common_base_declares_both_staging_members_so_only_a_capability_stops_mori(
    reference: Reference,
) -> None:
    """Mori's two staging members are declared by its CommonKVManager (a class attribute
    `_staging_ctx = None`, an assignment of `_staging_handler` in __init__): given our mixin,
    its Mori is rejected only for lacking our staging capability, arrival."""
    mori = manager(reference, "MoriKVManager")
    common = reference.common_conn.CommonKVManager
    report = STAGING_CONTRACT.inspect_class(mori)
    owners = {
        row.spec.name: row.declaration.owner
        for row in report.members
        if row.declaration is not None
    }
    assert owners["_staging_ctx"] is common
    assert owners["_staging_handler"] is common
    assert "_staging_ctx" in common.__dict__
    assert common.__dict__["_staging_ctx"] is None

    with pytest.raises(ContractError, match=r"^MoriWithOurMixin does not satisfy") as its:
        types.new_class("MoriWithOurMixin", (StagingManagerMixin, mori))
    assert its.value.missing == ("arrival",)
    with pytest.raises(ContractError, match=r"^OurMoriWithTheMixin does not satisfy") as info:
        types.new_class("OurMoriWithTheMixin", (StagingManagerMixin, OurMori))
    assert info.value.missing == ("_staging_handler", "_staging_ctx", "arrival")


class StagingSetUp(Protocol):
    """What a manager that really stages has besides the members: its staging set-up (the
    methods its Mooncake and NIXL managers define and its Mori does not)."""

    def set_kv_buffer_tensors(
        self, k_buffers: list[object], v_buffers: list[object], page_size: int
    ) -> None: ...
    def register_staging_room_bootstrap(
        self, room: int, bootstrap_infos: object, receiver: object
    ) -> None: ...
    def _init_staging_allocator(self) -> None: ...
    def _init_staging_buffers(self, count: int) -> None: ...


SET_UP = Contract(StagingSetUp)


@pytest.mark.parametrize(
    ("name", "conforms"),
    [
        ("MooncakeKVManager", True),
        ("NixlKVManager", True),
        ("AscendKVManager", True),
        ("MoriKVManager", False),
    ],
)
def test_a_contract_on_the_set_up_methods_tells_mori_apart(
    reference: Reference, name: str, conforms: bool
) -> None:
    """A contract that requires the staging set-up methods catches Mori (all four missing)
    and passes the three managers that stage."""
    cls = manager(reference, name)
    report = SET_UP.inspect_class(cls)
    assert report.conforms is conforms
    if not conforms:
        assert SET_UP.explain(cls).splitlines()[-1] == "verdict: does not conform: 4 problem(s)"
        assert sorted(problem.member for problem in report.problems) == sorted(
            (
                "set_kv_buffer_tensors",
                "register_staging_room_bootstrap",
                "_init_staging_allocator",
                "_init_staging_buffers",
            )
        )
