"""Our contract tools pointed at the reference's managers, with the verdicts asserted.

Its ``MooncakeKVManager`` and ``NixlKVManager`` mix in its own ``StagingManagerMixin``, its
``AscendKVManager`` inherits Mooncake's, and its ``MoriKVManager`` has no staging. Against our
``StagingHost`` contract all four conform: its ``CommonKVManager`` declares
``_staging_ctx = None`` and assigns ``_staging_handler`` in ``__init__``, so even Mori
"declares" both. That is why our class-creation rule, which rejects our own Mori given the
mixin, would accept its Mori given the mixin; a contract that requires the staging set-up
methods is what tells the two apart (shown here with :class:`Contract` itself).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Protocol

import pytest

from staging_contracts import STAGING_CONTRACT, Contract, ContractError, StagingManagerMixin
from staging_contracts.backends.mori import MoriKVManager as OurMori
from staging_contracts.cli import main
from staging_contracts.contract.contract import MemberStatus
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
def test_explain_says_each_of_its_managers_conforms(reference: Reference, name: str) -> None:
    """Contract.explain names the class, lists every member and ends with 'conforms': the
    required members are all declared somewhere in its class tree."""
    cls = manager(reference, name)
    text = STAGING_CONTRACT.explain(cls)
    lines = text.splitlines()
    assert lines[0].startswith(f"{MANAGERS[name]}.{name} against the StagingHost contract")
    assert lines[-1] == "verdict: conforms"
    for member in ("_staging_handler", "_staging_ctx", "kv_args", "attn_tp_size"):
        assert any(line.startswith(member) for line in lines), member
    report = STAGING_CONTRACT.inspect_class(cls)
    assert report.conforms
    assert report.problems == ()
    statuses = {row.spec.name: row.status for row in report.members}
    assert MemberStatus.MISSING not in statuses.values()
    assert MemberStatus.MISMATCHED not in statuses.values()


def test_staging_contracts_check_gives_the_same_verdicts(
    reference: Reference, capsys: pytest.CaptureFixture[str]
) -> None:
    """`staging-contracts check` on the four exits 0 (conforms) and says that none of them
    uses our enforcing mixin."""
    del reference  # imported: `check` finds the modules in sys.modules
    targets = [f"{module}:{name}" for name, module in MANAGERS.items()]
    assert main(["check", *targets]) == 0
    out = capsys.readouterr().out
    assert out.count("verdict: conforms") == 4
    for target in targets:
        assert f"{target} does not use an enforcing mixin; against the StagingHost contract:" in out


def test_check_of_an_unknown_class_of_it_exits_2(
    reference: Reference, capsys: pytest.CaptureFixture[str]
) -> None:
    """A target that is not one of its classes is 'not importable' (exit 2), not a verdict."""
    del reference
    assert main(["check", "sglang.srt.disaggregation.mori.conn:NoSuchManager"]) == 2
    assert "has no attribute 'NoSuchManager'" in capsys.readouterr().err


def test_its_common_base_declares_both_staging_members_so_mori_passes(reference: Reference) -> None:
    """Mori's two staging members are declared by its CommonKVManager (a class attribute
    `_staging_ctx = None`, an assignment of `_staging_handler` in __init__): our class-creation
    rule accepts its Mori given our mixin, while it rejects ours."""
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

    taken = types.new_class("MoriWithOurMixin", (StagingManagerMixin, mori))
    assert STAGING_CONTRACT.inspect_class(taken).conforms  # nothing stops it at class creation
    with pytest.raises(ContractError, match=r"^OurMoriWithTheMixin does not satisfy") as info:
        types.new_class("OurMoriWithTheMixin", (StagingManagerMixin, OurMori))
    assert info.value.missing == ("_staging_handler", "_staging_ctx")


class StagingSetUp(Protocol):
    """What a manager that really stages has besides the members: its staging set-up (the
    methods its Mooncake and NIXL managers define and its Mori does not)."""

    set_kv_buffer_tensors: Callable[..., object]
    register_staging_room_bootstrap: Callable[..., object]
    _init_staging_allocator: Callable[..., object]
    _init_staging_buffers: Callable[..., object]


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
