"""Value checkers compiled once per member type."""

from __future__ import annotations

from typing import Protocol

import pytest
from typeguard import TypeCheckError

from staging_contracts import KVArgs, StagingHandler
from staging_contracts._contract.valuecheck import compile_checker
from tests.hosts import RecordingHandler, make_kv_args


def test_plain_class_union_is_checked_by_isinstance() -> None:
    """int | None accepts ints and None and rejects anything else."""
    check = compile_checker(int | None)
    check(3)
    check(None)
    with pytest.raises(TypeCheckError, match=r"^is not an instance of int \| None$"):
        check("3")


def test_protocol_checker_accepts_conforming_classes() -> None:
    """A class with the Protocol's methods passes, repeatedly."""
    check = compile_checker(StagingHandler | None)
    handler = RecordingHandler()
    for _ in range(3):
        check(handler)
    check(None)


def test_protocol_checker_rejects_missing_methods() -> None:
    """An object without the Protocol's methods fails."""
    check = compile_checker(StagingHandler)

    class Partial:
        def handle_staging_req(self) -> None:
            """Wrong signature and the other method is missing."""

    with pytest.raises(TypeCheckError):
        check(Partial())


def test_protocol_checker_checks_property_values_per_instance() -> None:
    """Property members are checked against their return types on every value."""
    check = compile_checker(KVArgs)
    check(make_kv_args())

    class Loose:
        page_size = 16

    loose = Loose()
    for name in ("kv_item_lens", "kv_layer_ids"):
        setattr(loose, name, (1,))
    for name in ("engine_rank", "total_kv_head_num", "kv_head_num", "pp_rank"):
        setattr(loose, name, 1)
    loose.device = "cpu"  # type: ignore[attr-defined]  # built up dynamically
    check(loose)
    loose.page_size = "16"  # type: ignore[assignment]  # the mistake under test
    with pytest.raises(TypeCheckError, match=r"^has attribute 'page_size' that is not an instance"):
        check(loose)


def test_generic_types_use_typeguard_with_every_item() -> None:
    """Collections are checked item by item."""
    check = compile_checker(dict[str, list[int]])
    check({"a": [1, 2]})
    with pytest.raises(TypeCheckError):
        check({"a": [1, "2"]})


def test_protocol_with_plain_attributes_is_checked_per_value() -> None:
    """A Protocol with annotated attributes is checked by typeguard on each value."""

    class Named(Protocol):
        name: str

    class Thing:
        def __init__(self, name: object) -> None:
            self.name = name

    check = compile_checker(Named)
    check(Thing("x"))
    with pytest.raises(TypeCheckError):
        check(Thing(3))
