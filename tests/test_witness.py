"""The witness a host states at its class: validated at class creation, recommended otherwise."""

from __future__ import annotations

from typing import ClassVar, Protocol, TypeVar

import pytest

from staging_contracts import (
    STAGING_CONTRACT,
    ArrivalMode,
    Contract,
    ContractError,
    ContractMixin,
    DecodeStagingContext,
    HostCheck,
    PrefillStagingContext,
    StagingHandler,
    StagingHost,
    StagingHostCheck,
    StagingManagerMixin,
)
from staging_contracts._contract.witness import (
    mangled_witness_name,
    own_witnesses,
    witness_class_for,
    witness_definition,
    witness_line,
    witness_note,
)
from staging_contracts.backends.ascend import AscendKVManager
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.backends.mooncake import MooncakeKVManager
from staging_contracts.backends.nixl import NixlKVManager
from tests.hosts import CommonBase


class CacheHost(Protocol):
    """A second, unrelated contract."""

    @property
    def cache_dir(self) -> str: ...


_Cache = TypeVar("_Cache", bound=CacheHost)


class CacheHostCheck(HostCheck[_Cache]):
    """The witness of CacheHost."""


class CacheMixin(ContractMixin, contract=Contract(CacheHost)):
    """Enforces CacheHost."""


class LogHost(Protocol):
    """A third contract, for a host of two."""

    @property
    def log_name(self) -> str: ...


_Log = TypeVar("_Log", bound=LogHost)


class LogHostCheck(HostCheck[_Log]):
    """The witness of LogHost."""


class LogMixin(ContractMixin, contract=Contract(LogHost)):
    """Enforces LogHost."""


class Unwitnessed(Protocol):
    """A Protocol no witness class is bound by."""

    @property
    def depth(self) -> int: ...


class DepthMixin(ContractMixin, contract=Contract(Unwitnessed)):
    """Enforces Unwitnessed."""


class Staged(StagingManagerMixin, CommonBase):
    """A conforming staging host that states its witness after its docstring."""

    __contract: ClassVar[StagingHostCheck[Staged]]
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"


# --------------------------------------------------------------------------- accepted


def test_a_host_naming_itself_is_created_and_its_witness_read() -> None:
    """A witness naming the class itself is accepted, read under its mangled name."""
    (witness,) = own_witnesses(Staged) or ()
    assert (witness.witness, witness.bound, witness.named) == (
        StagingHostCheck,
        StagingHost.__mro__[1],
        Staged,
    )
    assert mangled_witness_name(Staged) == "_Staged__contract"
    assert not hasattr(Staged(), "_Staged__contract")


def test_a_subclass_states_its_own_witness_without_overriding_its_bases() -> None:
    """The private name is per class: a subclass names itself, its base keeps its own."""

    class Sub(Staged):
        __contract: ClassVar[StagingHostCheck[Sub]]

    assert [w.named for w in own_witnesses(Sub) or ()] == [Sub]
    assert [w.named for w in own_witnesses(Staged) or ()] == [Staged]


def test_a_subclass_without_a_witness_of_its_own_is_no_problem() -> None:
    """The witness is not inherited: a subclass that states none has none, and is accepted."""

    class Plain(Staged):
        pass

    assert own_witnesses(Plain) is None
    assert STAGING_CONTRACT.inspect_class(Plain).problems == ()


def test_quoted_witnesses_without_postponed_annotations_are_accepted() -> None:
    """Quoted whole, or only the class name: both resolve to the class itself."""
    from tests.contract_fixtures import witness_forms

    for cls in (witness_forms.WholeQuoted, witness_forms.NameQuoted):
        assert [w.named for w in own_witnesses(cls) or ()] == [cls]


def test_a_host_of_two_contracts_states_both_in_a_tuple() -> None:
    """``ClassVar[tuple[A[X], B[X]]]``: each contract finds and accepts its own witness."""

    class Both(CacheMixin, LogMixin):
        __contract: ClassVar[tuple[CacheHostCheck[Both], LogHostCheck[Both]]]
        cache_dir: str = "/tmp"
        log_name: str = "both"

    assert [w.witness for w in own_witnesses(Both) or ()] == [CacheHostCheck, LogHostCheck]


def test_an_abstract_base_is_not_judged_for_its_witness() -> None:
    """``abstract=True`` skips the class check, the witness's included."""

    class Base(StagingManagerMixin, CommonBase, abstract=True):
        __contract: ClassVar[StagingHostCheck[Staged]]

    assert Base.__name__ == "Base"


# --------------------------------------------------------------------------- rejected


def test_a_witness_naming_another_class_is_rejected() -> None:
    """A witness copied from another backend names that one: the class statement raises."""
    with pytest.raises(
        ContractError,
        match=(
            r"^Copied does not satisfy the StagingHost contract of StagingManagerMixin:\n"
            r"  - its witness 'StagingHostCheck\[Staged\]' names Staged, not Copied\n"
            r"Fix: State the witness as '__contract: ClassVar\[StagingHostCheck\[Copied\]\]'\.$"
        ),
    ) as caught:

        class Copied(Staged):
            __contract: ClassVar[StagingHostCheck[Staged]]

    assert caught.value.witness == ("__contract",)
    assert caught.value.missing == caught.value.mismatched == ()


def test_a_witness_of_another_contract_is_rejected() -> None:
    """The staging witness on a host of another contract: it checks the wrong Protocol."""
    with pytest.raises(
        ContractError,
        match=(
            r"^Store does not satisfy the CacheHost contract of CacheMixin:\n"
            r"  - its witness 'StagingHostCheck\[Store\]' checks StagingHostCore, not a "
            r"contract Store is held to\n"
            r"Fix: State the witness as '__contract: ClassVar\[CacheHostCheck\[Store\]\]'\.$"
        ),
    ):

        class Store(CacheMixin):
            __contract: ClassVar[StagingHostCheck[Store]]  # type: ignore[type-var]
            cache_dir: str = "/tmp"


def test_an_unresolvable_witness_says_why_and_to_import_at_run_time() -> None:
    """A name the module does not bind at run time (imported under TYPE_CHECKING, say)."""
    with pytest.raises(
        ContractError,
        match=(
            r"^Store does not satisfy the CacheHost contract of CacheMixin:\n"
            r"  - its witness 'ClassVar\[NotImported\[Store\]\]' cannot be resolved: NameError: "
            r"name 'NotImported' is not defined\n"
            r"Fix: State the witness as '__contract: ClassVar\[CacheHostCheck\[Store\]\]', its "
            r"names imported at run time \(not under TYPE_CHECKING\)\.$"
        ),
    ):

        class Store(CacheMixin):
            __contract: ClassVar[NotImported[Store]]  # type: ignore[name-defined]  # noqa: F821
            cache_dir: str = "/tmp"


def test_a_witness_that_is_no_witness_class_is_rejected() -> None:
    """Any other type, or the HostCheck base itself, is no witness."""
    with pytest.raises(
        ContractError, match=r"  - its witness 'int' is not a witness \(a HostCheck"
    ):

        class Store(CacheMixin):
            __contract: ClassVar[int]
            cache_dir: str = "/tmp"

    with pytest.raises(
        ContractError,
        match=r"  - its witness 'HostCheck\[Base\]' uses HostCheck, which no Protocol bounds",
    ):

        class Base(CacheMixin):
            __contract: ClassVar[HostCheck[Base]]
            cache_dir: str = "/tmp"


def test_member_and_witness_problems_come_in_one_report() -> None:
    """A missing member and a wrong witness: one error, both listed, both fixes."""
    with pytest.raises(ContractError) as caught:

        class Half(StagingManagerMixin, CommonBase):  # type: ignore[staging-missing-member]
            __contract: ClassVar[StagingHostCheck[Staged]]
            _staging_handler: StagingHandler | None = None
            arrival: ArrivalMode = "zmq"

    assert (caught.value.missing, caught.value.witness) == (("_staging_ctx",), ("__contract",))
    assert str(caught.value).splitlines()[1:3] == [
        "  - has no declaration of '_staging_ctx' (expected DecodeStagingContext | "
        "PrefillStagingContext | None)",
        "  - its witness 'StagingHostCheck[Staged]' names Staged, not Half",
    ]


def test_a_wrong_witness_in_a_tuple_is_reported_once_by_its_contract() -> None:
    """Of two contracts, only the one whose witness is wrong reports it."""
    with pytest.raises(
        ContractError,
        match=(
            r"^Both does not satisfy the LogHost contract of LogMixin:\n"
            r"  - its witness 'LogHostCheck\[Staged\]' names Staged, not Both\n"
        ),
    ):

        class Both(CacheMixin, LogMixin):
            __contract: ClassVar[tuple[CacheHostCheck[Both], LogHostCheck[Staged]]]  # type: ignore[type-var]
            cache_dir: str = "/tmp"
            log_name: str = "both"


def test_a_stray_witness_of_a_host_of_two_contracts_is_reported_once() -> None:
    """A witness serving neither contract is reported by the first contract only."""
    with pytest.raises(ContractError) as caught:

        class Both(CacheMixin, LogMixin):
            __contract: ClassVar[StagingHostCheck[Both]]  # type: ignore[type-var]
            cache_dir: str = "/tmp"
            log_name: str = "both"

    assert caught.value.contract_name == "CacheHost"
    assert str(caught.value).count("its witness") == 1

    class Log(LogMixin):
        log_name: str = "log"

    Log.__annotations__["_Log__contract"] = "ClassVar[StagingHostCheck[Log]]"
    forced = CacheMixin.contract.inspect_class(Log).problems  # a contract Log is not held to
    assert [p.member for p in forced] == ["cache_dir"]  # judges the members, not the witness
    (stray,) = LogMixin.contract.inspect_class(Log).problems
    assert stray.detail == "checks StagingHostCore, not a contract Log is held to"


def test_explain_lists_a_wrong_witness_after_the_table() -> None:
    """``explain`` (and so ``staging-contracts check``) shows the witness problem."""

    class Base(StagingManagerMixin, CommonBase, abstract=True):
        __contract: ClassVar[StagingHostCheck[Staged]]
        _staging_handler: StagingHandler | None = None
        _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
        arrival: ArrivalMode = "zmq"

    text = STAGING_CONTRACT.explain(Base)
    assert "! its witness 'StagingHostCheck[Staged]' names Staged, not Base" in text


def test_a_witness_of_a_class_whose_module_is_gone_is_not_judged() -> None:
    """After a failed import (the module removed), a report on the class judges no witness."""

    class Orphan(StagingManagerMixin, CommonBase, abstract=True):
        _staging_handler: StagingHandler | None = None
        _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
        arrival: ArrivalMode = "zmq"

    Orphan.__module__ = "a_module_whose_import_failed"
    Orphan.__annotations__["_Orphan__contract"] = "ClassVar[StagingHostCheck[Orphan]]"
    assert STAGING_CONTRACT.inspect_class(Orphan).problems == ()
    assert witness_note(Orphan, [StagingHost]) is None


# --------------------------------------------------------------------------- the witness classes


def test_each_contract_finds_its_witness_class_through_its_protocol() -> None:
    """The staging contract's is StagingHostCheck (bound by its required part)."""
    assert witness_class_for(StagingHost) is StagingHostCheck
    assert witness_class_for(CacheHost) is CacheHostCheck
    assert witness_class_for(Unwitnessed) is None
    assert witness_line(StagingHost, Staged) == "__contract: ClassVar[StagingHostCheck[Staged]]"
    assert witness_line(Unwitnessed, Staged) is None
    assert witness_definition(Unwitnessed) == (
        '_Host = TypeVar("_Host", bound=Unwitnessed); class UnwitnessedCheck(HostCheck[_Host]): ...'
    )


def test_a_witness_of_a_contract_without_a_witness_class_says_to_define_one() -> None:
    """No witness class is bound by the contract's Protocol: the fix says what to define."""
    with pytest.raises(
        ContractError, match=r"Fix: Remove the witness, or define the witness class"
    ):

        class Deep(DepthMixin):
            __contract: ClassVar[CacheHostCheck[Deep]]  # type: ignore[type-var]
            depth: int = 1


@pytest.mark.parametrize(
    "backend", [LocalKVManager, MooncakeKVManager, NixlKVManager, AscendKVManager]
)
def test_every_in_tree_staging_backend_states_its_own_witness(backend: type) -> None:
    """Our own backends use the form the guide documents."""
    assert [(w.witness, w.named) for w in own_witnesses(backend) or ()] == [
        (StagingHostCheck, backend)
    ]
