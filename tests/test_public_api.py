"""The public surface: one place to import from, and it names itself."""

from __future__ import annotations

import staging_contracts


def test_all_is_sorted_and_complete() -> None:
    """__all__ is sorted and every name in it is importable from the package."""
    names = staging_contracts.__all__
    assert list(names) == sorted(names, key=lambda n: (not n.isupper(), n))
    for name in names:
        assert hasattr(staging_contracts, name), name


def test_public_objects_name_the_package_as_their_module() -> None:
    """Each public class or function reports staging_contracts as its __module__."""
    for name in staging_contracts.__all__:
        obj = getattr(staging_contracts, name)
        if isinstance(obj, type) or callable(obj):
            assert obj.__module__ == "staging_contracts", name


def test_core_names_are_public() -> None:
    """The names the README promises are importable from the package."""
    from staging_contracts import (  # noqa: F401 - the import is the test
        Contract,
        ContractError,
        StagingHost,
        StagingManagerMixin,
    )

    assert StagingManagerMixin.contract.protocol is StagingHost
