"""The backend registry: in-tree names, entry-point names, refs without imports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from staging_contracts.backends import (
    BACKENDS,
    ENTRY_POINT_GROUP,
    backend_names,
    backend_ref,
    load_backend,
)
from staging_contracts.backends.local import LocalKVManager


@pytest.fixture
def registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A distribution on sys.path whose entry points register 'zeta' and 'notaclass'."""
    info = tmp_path / "zeta_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zeta-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n"
        "zeta = zeta_backend:ZetaKVManager\n"
        "notaclass = zeta_backend:make\n"
        "local = zeta_backend:ZetaKVManager\n"
    )
    (tmp_path / "zeta_backend.py").write_text(
        "from staging_contracts.backends.local import LocalKVManager\n\n\n"
        "class ZetaKVManager(LocalKVManager):\n    pass\n\n\n"
        "def make():\n    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_in_tree_names_come_first_and_resolve_without_imports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """backend_ref turns an in-tree name into MODULE:CLASS without importing the module."""
    assert backend_names()[: len(BACKENDS)] == tuple(BACKENDS)
    # Restored afterwards: later tests compare the module's classes by identity.
    monkeypatch.delitem(sys.modules, "staging_contracts.backends.mori", raising=False)
    assert backend_ref("mori") == "staging_contracts.backends.mori:MoriKVManager"
    assert "staging_contracts.backends.mori" not in sys.modules
    assert load_backend("local") is LocalKVManager


def test_entry_points_are_listed_and_loaded(registered: Path) -> None:
    """Registered names follow the in-tree ones; an in-tree name wins over an entry point."""
    names = backend_names()
    assert names == (*BACKENDS, "notaclass", "zeta")
    assert backend_ref("zeta") == "zeta_backend:ZetaKVManager"
    loaded = load_backend("zeta")
    assert loaded.__name__ == "ZetaKVManager"
    assert load_backend("local") is LocalKVManager


def test_entry_point_that_is_not_a_class_is_refused(registered: Path) -> None:
    """An entry point must name a class."""
    with pytest.raises(ValueError, match=r"names zeta_backend:make, a function, not a class"):
        load_backend("notaclass")


def test_unknown_name_lists_the_known_ones() -> None:
    """An unknown name raises ValueError naming every known backend."""
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; known: ascend, local, mooncake"):
        backend_ref("nope")
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; known: ascend, local, mooncake"):
        load_backend("nope")
