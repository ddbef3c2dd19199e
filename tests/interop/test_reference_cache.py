"""The suite's own plumbing: where the reference is cached, and what a failed install leaves."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interop import _reference
from tests.interop._reference import ReferenceUnavailable


def test_the_cache_folder_is_overridable_else_under_the_users_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """$STAGING_CONTRACTS_INTEROP_CACHE wins; else $XDG_CACHE_HOME; else ~/.cache."""
    monkeypatch.setenv(_reference.CACHE_ENV, str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _reference.cache_root() == tmp_path / "mine"
    monkeypatch.delenv(_reference.CACHE_ENV)
    assert _reference.cache_root() == tmp_path / "xdg" / "staging-contracts" / "interop"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _reference.cache_root() == tmp_path / "home" / ".cache" / "staging-contracts" / "interop"


def test_the_install_folder_names_the_pins(tmp_path: Path) -> None:
    """One folder per set of pins (and Python version), named after the reference."""
    folder = _reference.install_dir(tmp_path)
    assert folder.parent == tmp_path
    assert folder.name.startswith("sglang-0.5.23-")
    assert len(folder.name) == len("sglang-0.5.23-") + 12
    assert not _reference.is_installed(tmp_path)


def test_a_failed_install_leaves_nothing_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """pip's failure is raised with its reason; no partial folder is left to be taken for an
    install, and the next attempt starts afresh."""
    calls: list[Path] = []

    def failing_pip(folder: Path) -> None:
        calls.append(folder)
        folder.mkdir(parents=True)
        (folder / "half.py").write_text("")
        raise ReferenceUnavailable("pip could not install sglang==0.5.23: no index")

    monkeypatch.setattr(_reference, "_pip_install", failing_pip)
    with pytest.raises(ReferenceUnavailable, match=r"no index$"):
        _reference.ensure_installed(tmp_path)
    assert not calls[0].exists()
    assert not _reference.install_dir(tmp_path).exists()
    assert not _reference.is_installed(tmp_path)


def test_a_complete_install_is_reused_without_pip(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Once installed, ensure_installed returns the folder and never runs pip again."""
    runs: list[Path] = []

    def fake_pip(folder: Path) -> None:
        runs.append(folder)
        (folder / "sglang").mkdir(parents=True)

    monkeypatch.setattr(_reference, "_pip_install", fake_pip)
    first = _reference.ensure_installed(tmp_path)
    assert (first / "sglang").is_dir()
    assert _reference.is_installed(tmp_path)
    assert _reference.ensure_installed(tmp_path) == first
    assert len(runs) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, f"{first.name}.lock"]
