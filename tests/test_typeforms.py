"""Static reasoning about declared annotations: naming, resolving and compatibility."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, TypeVar

import pytest

from staging_contracts import KVArgs, KVArgsRecord, StagingHandler
from staging_contracts._contract.typeforms import (
    Compat,
    class_label,
    declared_compatibility,
    resolve_annotation,
    type_name,
)
from tests.hosts import RecordingHandler

T = TypeVar("T")


class Sized(Protocol):
    """A Protocol with one method."""

    def size(self) -> int:
        """Size."""
        ...


class HasSize:
    """Satisfies Sized structurally."""

    def size(self) -> int:
        """Size."""
        return 1


@pytest.mark.parametrize(
    ("tp", "text"),
    [
        (None, "None"),
        (int, "int"),
        (int | None, "int | None"),
        (list[int], "list[int]"),
        (dict[str, list[int]], "dict[str, list[int]]"),
        (tuple[int, ...], "tuple[int, ...]"),
        (Literal["a", 1], "Literal['a', 1]"),
        (Any, "Any"),
        ("Later", "Later"),
        (StagingHandler | None, "StagingHandler | None"),
    ],
)
def test_type_name_renders_expressions(tp: object, text: str) -> None:
    """type_name renders type expressions as a reader writes them."""
    assert type_name(tp) == text


def test_class_label_drops_locals() -> None:
    """class_label keeps the qualified name but drops the function-locals prefix."""

    class Inner:
        pass

    assert class_label(Inner) == "Inner"
    assert class_label(HasSize) == "HasSize"


@pytest.mark.parametrize(
    ("declared", "expected", "verdict"),
    [
        (int, int, Compat.YES),
        (bool, int, Compat.YES),
        (int, float, Compat.YES),
        (str, int, Compat.NO),
        (None, int | None, Compat.YES),
        (int | None, int, Compat.NO),
        (KVArgs | None, KVArgs, Compat.NO),
        (KVArgsRecord, KVArgs, Compat.YES),
        (RecordingHandler | None, StagingHandler | None, Compat.YES),
        (HasSize, Sized, Compat.YES),
        (int, Sized, Compat.NO),
        (Sized, int, Compat.NO),
        (list[int], list[int], Compat.YES),
        (list[str], list[int], Compat.NO),
        (list, list[int], Compat.YES),
        (Sequence[int], list[int], Compat.NO),
        (list[int], Sequence[int], Compat.YES),
        ("Later", int, Compat.UNKNOWN),
        (T, int, Compat.UNKNOWN),
        (Literal[1], int, Compat.YES),
        (Literal["1"], int, Compat.NO),
        (Literal["zmq"], Literal["notification", "zmq"], Compat.YES),
        (Literal["zmq", "tcp"], Literal["notification", "zmq"], Compat.NO),
        (Literal[True], Literal[1], Compat.NO),
        (str, Literal["zmq"], Compat.UNKNOWN),
        (Literal["zmq"], Sized, Compat.UNKNOWN),
        (Any, int, Compat.YES),
        (str, object, Compat.YES),
    ],
)
def test_declared_compatibility(declared: object, expected: object, verdict: Compat) -> None:
    """A declared type is compatible when every value it admits is expected; NO only if certain."""
    assert declared_compatibility(declared, expected) is verdict


def test_resolve_annotation_evaluates_in_the_owner_module() -> None:
    """String annotations resolve against the declaring class's module and namespace."""

    class Owner:
        pass

    assert resolve_annotation("int | None", Owner) == (int | None, True)
    assert resolve_annotation("HasSize", Owner) == (HasSize, True)
    assert resolve_annotation("'int'", Owner) == (int, True)
    assert resolve_annotation(int, Owner) == (int, True)


def test_resolve_annotation_reports_unresolvable_names() -> None:
    """A name that does not exist yet leaves the annotation unresolved, with no exception."""

    class Owner:
        pass

    assert resolve_annotation("NotYetDefined | None", Owner) == ("NotYetDefined | None", False)
    assert resolve_annotation("not valid python (", Owner) == ("not valid python (", False)
