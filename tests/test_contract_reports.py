"""What a Contract reports: its members, class reports, problems' fields and explain() tables."""

from __future__ import annotations

from typing import ClassVar, Protocol

import pytest

from staging_contracts import (
    Contract,
    ContractError,
    ContractMixin,
    ContractProblem,
    MemberSpec,
    MemberStatus,
    ProblemKind,
)
from staging_contracts._contract.contract import is_abstract
from staging_contracts._contract.declarations import Declaration, DeclarationKind


class Store(Protocol):
    """Two required members, a class variable that is no member, and an optional one."""

    path: str
    sizes: list[int]
    limit: ClassVar[int]
    note: str | None


STORE = Contract(Store, optional=("note",))
"""Never bound to a mixin: a standalone contract."""


class Empty:
    """Declares nothing."""


class Conforming:
    """Declares every member with a type the contract accepts."""

    path: str
    sizes: list[int]
    note: str | None

    def __init__(self) -> None:
        self.path = "/data"
        self.sizes = [1]
        self.note = None


class Mixed:
    """One member of each status."""

    path: Later  # type: ignore[name-defined]  # noqa: F821 - not defined yet: unresolved
    note: int

    def __init__(self) -> None:
        self.sizes = [1]


# --------------------------------------------------------------------------- the contract


def test_contract_keeps_its_protocol_name_and_members() -> None:
    """The Protocol, its name and one MemberSpec per annotation; a ClassVar is no member."""
    assert STORE.protocol is Store
    assert STORE.name == "Store"
    assert STORE.members == (
        MemberSpec("path", str, False),
        MemberSpec("sizes", list[int], False),
        MemberSpec("note", str | None, True),
    )
    assert STORE.required == ("path", "sizes")
    assert STORE.optional == ("note",)
    assert [m.expected_name for m in STORE.members] == ["str", "list[int]", "str | None"]
    assert repr(STORE) == "Contract(Store, members=['path', 'sizes', 'note'])"
    assert STORE.mixin is None


def test_contract_built_in_a_test_keeps_its_protocol_and_skips_class_variables() -> None:
    """A contract built now (not at import) keeps the Protocol and leaves the ClassVar out."""
    contract = Contract(Store, optional=("note",))
    assert contract.protocol is Store
    assert [m.name for m in contract.members] == ["path", "sizes", "note"]
    assert contract.required == ("path", "sizes")


def test_class_variables_are_never_required() -> None:
    """A class without the ClassVar conforms, and an instance without it passes."""
    contract = Contract(Store, optional=("note",))
    assert contract.inspect_class(Conforming).problems == ()
    assert contract.instance_problems(Conforming()) == []
    assert STORE.inspect_class(Conforming).problems == ()
    assert STORE.instance_problems(Conforming()) == []


def test_contract_can_be_renamed() -> None:
    """name= is how messages name the contract."""
    renamed = Contract(Store, name="Storage")
    assert renamed.name == "Storage"
    with pytest.raises(ContractError, match=r"^Empty does not satisfy the Storage contract:") as e:
        renamed.check_class(Empty)
    assert e.value.contract_name == "Storage"


def test_contract_binds_once_to_its_mixin() -> None:
    """bind records the mixin; binding it again is fine, another mixin is a TypeError."""
    contract = Contract(Store)

    class First:
        pass

    class Second:
        pass

    assert contract.mixin is None
    contract.bind(First)
    assert contract.mixin is First
    contract.bind(First)
    assert contract.mixin is First
    with pytest.raises(TypeError, match=r"^contract Store is already enforced by First$"):
        contract.bind(Second)
    assert contract.mixin is First


# --------------------------------------------------------------------------- class reports


def test_class_report_names_the_class_and_each_member() -> None:
    """inspect_class reports the class, one row per member and the abstract flag."""
    report = STORE.inspect_class(Conforming)
    assert report.cls is Conforming
    assert report.abstract is False
    assert report.conforms
    assert [row.spec for row in report.members] == list(STORE.members)
    assert [row.status for row in report.members] == [MemberStatus.OK] * 3
    assert [row.declaration for row in report.members] == [
        Declaration(Conforming, DeclarationKind.ANNOTATION, str, True),
        Declaration(Conforming, DeclarationKind.ANNOTATION, list[int], True),
        Declaration(Conforming, DeclarationKind.ANNOTATION, str | None, True),
    ]
    abstract = STORE.inspect_class(Empty, abstract=True)
    assert abstract.cls is Empty
    assert abstract.abstract is True
    assert abstract.conforms
    assert len(abstract.problems) == 2


def test_class_report_statuses_and_problems() -> None:
    """A member undecidable statically is unresolved; a mismatch and a gap become problems."""
    report = STORE.inspect_class(Mixed)
    assert report.cls is Mixed
    assert {row.spec.name: row.status for row in report.members} == {
        "path": MemberStatus.UNRESOLVED,
        "sizes": MemberStatus.UNTYPED,
        "note": MemberStatus.MISMATCHED,
    }
    assert report.problems == (
        ContractProblem(ProblemKind.MISMATCHED, "note", "str | None", actual="int", where="Mixed"),
    )
    assert not report.conforms
    missing = STORE.inspect_class(Empty)
    assert missing.problems == (
        ContractProblem(ProblemKind.MISSING, "path", "str"),
        ContractProblem(ProblemKind.MISSING, "sizes", "list[int]"),
    )
    assert [row.status for row in missing.members] == [
        MemberStatus.MISSING,
        MemberStatus.MISSING,
        MemberStatus.ABSENT,
    ]


def test_check_class_raises_with_every_problem_and_no_mixin() -> None:
    """The standalone check's error carries the class, contract, problems and no mixin."""
    with pytest.raises(ContractError, match=r"^Empty does not satisfy the Store contract:\n") as e:
        STORE.check_class(Empty)
    assert e.value.cls is Empty
    assert e.value.contract_name == "Store"
    assert e.value.mixin_name is None
    assert e.value.instance is False
    assert e.value.problems == STORE.inspect_class(Empty).problems
    STORE.check_class(Conforming)


# --------------------------------------------------------------------------- instances


class BadValues:
    """No path, a list with a bad item, and an optional member of the wrong type."""

    def __init__(self) -> None:
        self.sizes: list[object] = [1, "2"]
        self.note = 3


def test_instance_problems_lists_every_bad_member_in_order() -> None:
    """A missing first member does not stop the check of the members after it."""
    assert STORE.instance_problems(BadValues()) == [
        ContractProblem(ProblemKind.MISSING, "path", "str"),
        ContractProblem(
            ProblemKind.MISMATCHED,
            "sizes",
            "list[int]",
            actual="list",
            detail="item 1 of list is not an instance of int",
        ),
        ContractProblem(ProblemKind.MISMATCHED, "note", "str | None", actual="int"),
    ]


def test_optional_member_may_be_unset_on_an_instance() -> None:
    """An instance without the optional member conforms."""

    class NoNote:
        def __init__(self) -> None:
            self.path = "/data"
            self.sizes = [1]

    assert STORE.instance_problems(NoNote()) == []
    STORE.check_instance(NoNote())


def test_check_instance_raises_with_the_instance_fields() -> None:
    """The per-instance error names the object's class and carries every problem."""
    obj = BadValues()
    with pytest.raises(ContractError, match=r"^BadValues instance does not satisfy the Store") as e:
        STORE.check_instance(obj)
    assert e.value.cls is BadValues
    assert e.value.instance is True
    assert e.value.contract_name == "Store"
    assert e.value.mixin_name is None
    assert e.value.problems == tuple(STORE.instance_problems(obj))
    assert e.value.missing == ("path",)
    assert e.value.mismatched == ("sizes", "note")


def test_check_member_accepts_a_good_value_for_any_member() -> None:
    """check_member finds the member wherever it is in the contract, and returns on a match."""
    obj = Conforming()
    STORE.check_member(obj, "path", "/x")
    STORE.check_member(obj, "sizes", [1, 2])
    STORE.check_member(obj, "note", None)


def test_check_member_reports_the_mismatch_with_its_fields() -> None:
    """A bad value raises an instance error with expected, actual type and typeguard's detail."""
    with pytest.raises(ContractError, match=r"^Conforming instance does not satisfy") as e:
        STORE.check_member(Conforming(), "sizes", [1, "x"])
    assert e.value.cls is Conforming
    assert e.value.instance is True
    assert e.value.contract_name == "Store"
    assert e.value.mixin_name is None
    assert e.value.problems == (
        ContractProblem(
            ProblemKind.MISMATCHED,
            "sizes",
            "list[int]",
            actual="list",
            detail="item 1 of list is not an instance of int",
        ),
    )
    with pytest.raises(ContractError) as plain:
        STORE.check_member(Conforming(), "note", 3)
    assert plain.value.problems == (
        ContractProblem(ProblemKind.MISMATCHED, "note", "str | None", actual="int"),
    )


def test_check_member_of_an_unknown_name_is_a_key_error() -> None:
    """A name that is not a member raises KeyError carrying that name."""
    with pytest.raises(KeyError) as e:
        STORE.check_member(Conforming(), "limit", 3)
    assert e.value.args == ("limit",)


class Sized(Protocol):
    """The contract of the mixin below."""

    size: int


SIZED = Contract(Sized)


class SizedMixin(ContractMixin, contract=SIZED):
    """Enforces Sized; provides one method and one property."""

    def grow(self: Sized) -> None:
        """Uses the member."""
        self.size += 1

    @property
    def half(self: Sized) -> int:
        """Uses the member."""
        return self.size // 2


def test_check_member_names_the_mixin() -> None:
    """With a bound contract, check_member's error names the mixin."""

    class Host(SizedMixin):
        size: int = 1

    with pytest.raises(
        ContractError, match=r"^Host instance does not satisfy the Sized contract of SizedMixin "
    ) as e:
        SIZED.check_member(Host(), "size", "1")
    assert e.value.mixin_name == "SizedMixin"
    assert e.value.contract_name == "Sized"
    assert e.value.problems == (ContractProblem(ProblemKind.MISMATCHED, "size", "int", "str"),)


# --------------------------------------------------------------------------- explain


def test_explain_without_a_mixin_renders_the_whole_table() -> None:
    """A standalone contract's table: no mixin in the title, aligned columns, the verdict."""
    assert STORE.explain(Mixed).splitlines() == [
        f"{__name__}.Mixed against the Store contract",
        "member           expected    declared in                   declared type  status",
        "---------------  ----------  ----------------------------  -------------  "
        "-----------------------------------------",
        "path             str         Mixed (annotation)            Later          "
        "unresolved: type not checked",
        "sizes            list[int]   Mixed (assigned in __init__)  -              "
        "declared without a type: type not checked",
        "note (optional)  str | None  Mixed (annotation)            int            mismatched",
        "verdict: does not conform: 1 problem(s)",
    ]


def test_explain_of_a_conforming_class() -> None:
    """A class without problems gets the 'conforms' verdict and no trailing spaces."""
    text = STORE.explain(Conforming)
    assert text == "\n".join(
        [
            f"{__name__}.Conforming against the Store contract",
            "member           expected    declared in              declared type  status",
            "---------------  ----------  -----------------------  -------------  ------",
            "path             str         Conforming (annotation)  str            ok",
            "sizes            list[int]   Conforming (annotation)  list[int]      ok",
            "note (optional)  str | None  Conforming (annotation)  str | None     ok",
            "verdict: conforms",
        ]
    )


def test_explain_counts_every_problem_in_its_verdict() -> None:
    """A class missing two members is judged with both counted."""
    lines = STORE.explain(Empty).splitlines()
    assert lines[3] == "path             str         -            -              missing"
    assert lines[-1] == "verdict: does not conform: 2 problem(s)"


def test_explain_lists_shadowed_methods_after_the_table() -> None:
    """A base listed before the mixin shadowing its methods is shown below the table."""

    class Legacy:
        def grow(self) -> None:
            """Shadows the mixin's method."""

        @property
        def half(self) -> int:
            """Shadows the mixin's property."""
            return 0

    class Host(Legacy, SizedMixin, abstract=True):
        size: int = 2

    report = SIZED.inspect_class(Host)
    assert report.problems == (
        ContractProblem(ProblemKind.SHADOWED, "grow", "", actual="Legacy"),
        ContractProblem(ProblemKind.SHADOWED, "half", "", actual="Legacy"),
    )
    lines = SIZED.explain(Host).splitlines()
    assert lines[0] == f"{__name__}.Host against the Sized contract of SizedMixin"
    assert lines[1:] == [
        "member  expected  declared in        declared type  status",
        "------  --------  -----------------  -------------  ------",
        "size    int       Host (annotation)  int            ok",
        "! method 'grow' of the mixin is shadowed by base 'Legacy', "
        "which is listed before the mixin",
        "! method 'half' of the mixin is shadowed by base 'Legacy', "
        "which is listed before the mixin",
        "verdict: abstract (abstract=True): not judged; its subclasses are",
    ]
    with pytest.raises(ContractError, match=r"^Child does not satisfy") as e:

        class Child(Host):  # type: ignore[staging-shadowed-method]  # the mistake under test
            pass

    assert e.value.shadowed == ("grow", "half")


def test_explain_judges_a_host_only_by_its_own_flag() -> None:
    """A subclass of an abstract host is judged; a plain class is never abstract."""

    class Base(SizedMixin, abstract=True):
        pass

    class Host(Base):
        size: int = 1

    assert is_abstract(Base)
    assert not is_abstract(Host)
    assert not is_abstract(Empty)
    assert SIZED.explain(Host).splitlines()[-1] == "verdict: conforms"
    assert STORE.explain(Conforming).splitlines()[-1] == "verdict: conforms"
