"""The reference, installed (once, into the cache) and imported for the whole session.

A test of this folder that takes the ``reference`` fixture fails, never skips, when the
reference cannot be installed or imported: the message says why (e.g. no package index).
While the cache is still empty, those tests may run past the suite's per-test timeout by the
time the first install takes (bounded by :data:`_reference.PIP_TIMEOUT_S`).
"""

from __future__ import annotations

import pytest

from tests.interop import _reference
from tests.interop._reference import Reference, ReferenceUnavailable

FIRST_INSTALL_TIMEOUT_S = _reference.PIP_TIMEOUT_S + 300
"""Per-test timeout of the tests that may have to wait for the first install and import."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give the reference's tests room for the first install while the cache is empty."""
    if _reference.is_installed():
        return
    for item in items:
        if "reference" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(FIRST_INSTALL_TIMEOUT_S))


@pytest.fixture(scope="session")
def reference() -> Reference:
    """The reference's modules (installed into the cache on first use)."""
    try:
        return _reference.load_reference(_reference.ensure_installed())
    except ReferenceUnavailable as exc:
        reason = str(exc)
    pytest.fail(reason, pytrace=False)  # outside the handler: the reason alone, no chain
