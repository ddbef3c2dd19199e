"""The domain-free contract machinery, exercised with Protocols unrelated to staging."""

from __future__ import annotations

from typing import Protocol

import pytest

from staging_contracts import (
    Contract,
    ContractError,
    ContractMixin,
    MemberStatus,
    ProblemKind,
)


class CacheHostCore(Protocol):
    """The required part of a contract that has nothing to do with KV transfer."""

    cache_dir: str
    entries: list[int]


class CacheHost(CacheHostCore, Protocol):
    """The whole contract: the core plus an optional label."""

    label: str | None


CACHE_CONTRACT = Contract(CacheHost, optional=("label",))


class CacheMixin(ContractMixin, contract=CACHE_CONTRACT):
    """A second mixin enforcing its own Protocol with the same machinery."""

    def first_entry(self: CacheHostCore) -> int:
        """Uses only the contract's members."""
        return self.entries[0]


def test_second_protocol_is_enforced_at_class_creation() -> None:
    """Another mixin's contract rejects a host missing its members, naming that mixin."""
    with pytest.raises(ContractError) as info:

        class NoEntries(CacheMixin):  # type: ignore[staging-missing-member]  # the mistake under test
            cache_dir: str = "/tmp"

    assert str(info.value) == (
        "NoEntries does not satisfy the CacheHost contract of CacheMixin:\n"
        "  - has no declaration of 'entries' (expected list[int])\n"
        "Fix: Declare each missing member on the class or one of its bases (annotate it, e.g. "
        "'entries: list[int]', or assign it in __init__), or pass abstract=True for an "
        "intermediate base."
    )
    assert info.value.contract_name == "CacheHost"
    assert info.value.mixin_name == "CacheMixin"


def test_second_protocol_accepts_a_conforming_host() -> None:
    """A host declaring every member is created and works."""

    class Cache(CacheMixin):
        cache_dir: str
        entries: list[int]

        def __init__(self) -> None:
            self.cache_dir = "/tmp"
            self.entries = [3, 4]

    assert Cache().first_entry() == 3


def test_list_member_with_one_bad_item_is_rejected() -> None:
    """Every item of a collection is checked: one bad item fails the instance."""

    class Cache(CacheMixin):
        cache_dir: str
        entries: list[int]

        def __init__(self, entries: list[object]) -> None:
            self.cache_dir = "/tmp"
            self.entries = entries  # type: ignore[assignment]  # tests pass bad values

    assert Cache([1, 2, 3]).entries == [1, 2, 3]
    with pytest.raises(ContractError, match=r"^Cache instance does not satisfy") as info:
        Cache([1, 2, "3", 4])
    assert info.value.mismatched == ("entries",)
    assert (
        "attribute 'entries' is list (expected list[int]): item 2 of list is not an instance of int"
        in (str(info.value))
    )


def test_optional_member_of_second_protocol() -> None:
    """An optional member is checked only when present."""

    class Labelled(CacheMixin):  # type: ignore[staging-member-type]  # the mistake under test
        cache_dir: str = "/tmp"
        entries: list[int]

        def __init__(self, label: object) -> None:
            self.entries = []
            if label is not None:
                self.label = label

    Labelled(None)
    Labelled("ok")
    with pytest.raises(ContractError, match=r"^Labelled instance") as info:
        Labelled(7)
    assert info.value.mismatched == ("label",)


def test_host_can_satisfy_two_contracts_at_once() -> None:
    """A class using two enforcing mixins is checked against both contracts."""

    class NameHost(Protocol):
        name: str

    class NameMixin(ContractMixin, contract=Contract(NameHost)):
        pass

    with pytest.raises(ContractError, match=r"^Both does not satisfy the CacheHost contract"):

        class Both(NameMixin, CacheMixin):  # type: ignore[staging-missing-member]  # the mistake under test
            name: str = "x"

    class Fine(NameMixin, CacheMixin):
        name: str = "x"
        cache_dir: str = "/tmp"
        entries: list[int]

        def __init__(self) -> None:
            self.entries = []

    Fine()


def test_check_class_without_a_mixin() -> None:
    """A standalone contract checks any class and names no mixin."""
    contract = Contract(CacheHost, optional=("label",))

    class Plain:
        cache_dir = 3

    with pytest.raises(ContractError) as info:
        contract.check_class(Plain)
    assert str(info.value).splitlines()[0] == "Plain does not satisfy the CacheHost contract:"
    assert info.value.missing == ("entries",)
    assert info.value.mismatched == ("cache_dir",)
    assert info.value.mixin_name is None


def test_check_instance_directly() -> None:
    """check_instance reports unset and wrongly typed members of any object."""

    class Obj:
        def __init__(self) -> None:
            self.cache_dir = b"/tmp"

    with pytest.raises(ContractError) as info:
        CACHE_CONTRACT.check_instance(Obj())
    kinds = [(p.kind, p.member) for p in info.value.problems]
    assert kinds == [(ProblemKind.MISMATCHED, "cache_dir"), (ProblemKind.MISSING, "entries")]


def test_contract_needs_a_protocol() -> None:
    """Building a contract from a plain class is a TypeError."""

    class NotAProtocol:
        x: int

    with pytest.raises(TypeError, match=r"^Contract needs a typing.Protocol class"):
        Contract(NotAProtocol)


def test_optional_names_must_be_members() -> None:
    """An optional name that the Protocol lacks is a TypeError."""
    with pytest.raises(TypeError, match=r"^optional names \['nope'\] are not members"):
        Contract(CacheHost, optional=("nope",))


def test_unresolvable_protocol_annotations_are_a_type_error() -> None:
    """A Protocol whose hints cannot be resolved fails when the contract is built."""

    class Broken(Protocol):
        x: "NoSuchName"  # type: ignore[name-defined]  # noqa: F821, UP037 - the case under test

    with pytest.raises(TypeError, match=r"^cannot resolve the annotations of Broken"):
        Contract(Broken)


def test_contract_binds_to_one_mixin_only() -> None:
    """A contract already enforced by one mixin cannot be given to another."""
    with pytest.raises(TypeError, match=r"^contract CacheHost is already enforced by CacheMixin"):

        class Other(ContractMixin, contract=CACHE_CONTRACT):
            pass


def test_explain_shows_each_member_with_its_status() -> None:
    """explain() renders member, expected type, where declared, declared type and status."""

    class Partial(CacheMixin, abstract=True):
        cache_dir: int  # shown as mismatched

    text = CACHE_CONTRACT.explain(Partial)
    lines = text.splitlines()
    assert lines[0] == f"{__name__}.Partial against the CacheHost contract of CacheMixin"
    assert lines[1].split() == [
        "member",
        "expected",
        "declared",
        "in",
        "declared",
        "type",
        "status",
    ]
    assert lines[3].split() == ["cache_dir", "str", "Partial", "(annotation)", "int", "mismatched"]
    assert lines[4].split() == ["entries", "list[int]", "-", "-", "missing"]
    assert lines[5].split()[:3] == ["label", "(optional)", "str"]
    assert lines[-1] == "verdict: abstract (abstract=True): not judged; its subclasses are"


def test_inspect_class_reports_statuses() -> None:
    """inspect_class returns one row per member without raising."""

    class Mixed:
        cache_dir: "Undefined"  # type: ignore[name-defined]  # noqa: F821, UP037 - unresolved
        entries = None

    report = CACHE_CONTRACT.inspect_class(Mixed)
    statuses = {row.spec.name: row.status for row in report.members}
    assert statuses == {
        "cache_dir": MemberStatus.UNRESOLVED,
        "entries": MemberStatus.MISMATCHED,
        "label": MemberStatus.ABSENT,
    }
    assert not report.conforms
