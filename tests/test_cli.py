"""The command line: check exit codes and output."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from staging_contracts.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_check_conforming_class_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    """A conforming backend is explained and the exit status is 0."""
    assert main(["check", "examples.hosts:ExampleKVManager"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "examples.hosts.ExampleKVManager against the StagingHost contract of StagingManagerMixin"
    )
    assert "verdict: conforms" in out


def test_check_recommends_the_witness_to_a_backend_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A conforming backend that states no witness conforms (exit 0) and gets the line to add;
    one that states it gets no such note."""
    (tmp_path / "unwitnessed_backend.py").write_text(UNWITNESSED)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "unwitnessed_backend:Acme"]) == 0
    last = capsys.readouterr().out.splitlines()[-2]
    assert last == (
        "note: Acme states no witness of its contract: add '__contract: "
        "ClassVar[StagingHostCheck[Acme]]' as the first statement of its body (after the "
        "docstring), so that every type checker (mypy, pyright, ty, pyrefly) reports a broken "
        "contract at the class, with no plugin (docs/writing-a-backend.md, section 7)"
    )
    assert main(["check", "staging_contracts.backends.nixl:NixlKVManager"]) == 0
    assert "states no witness" not in capsys.readouterr().out


UNWITNESSED = """
from staging_contracts import (
    ArrivalMode, DecodeStagingContext, KVArgs, PrefillStagingContext, StagingHandler,
    StagingManagerMixin,
)


class Acme(StagingManagerMixin):
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    kv_args: KVArgs
    attn_tp_size: int = 1
    arrival: ArrivalMode = "zmq"
"""


def test_check_mori_style_class_exits_one(capsys: pytest.CaptureFixture[str]) -> None:
    """A class without the staging members is explained with its problems; exit status 1."""
    assert main(["check", "examples.hosts:MoriStyleKVManager"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "examples.hosts:MoriStyleKVManager does not use an enforcing mixin; against the "
        "StagingHost contract of staging_contracts.StagingManagerMixin:"
    )
    assert "  - has no declaration of '_staging_ctx'" in out


def test_check_that_fails_itself_exits_three(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An error inside check (no verdict) is not "does not conform": exit 3, one line."""
    from staging_contracts import cli

    def broken(target: str, *_: object) -> int:
        raise RuntimeError("inspection blew up")

    monkeypatch.setattr(cli, "_check_one", broken)
    assert main(["check", "examples.hosts:ExampleKVManager"]) == 3
    err = capsys.readouterr().err
    assert "staging-contracts check: RuntimeError: inspection blew up" in err


def test_a_contract_without_a_witness_class_gets_no_witness_note(
    cache_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whether a contract has a witness class is its author's choice: a host of one that
    has none (a stack's own contract) is not told to define one."""
    assert main(["check", f"{cache_module}:GoodHost"]) == 0
    out = capsys.readouterr().out
    assert "verdict: conforms" in out
    assert "witness" not in out


def test_check_contract_error_at_import_exits_one(capsys: pytest.CaptureFixture[str]) -> None:
    """A module whose class statement fails the contract shows the error; exit status 1."""
    assert main(["check", "examples.mori_with_staging:MoriWithStaging"]) == 1
    out = capsys.readouterr().out
    assert "the contract rejected a class while importing 'examples.mori_with_staging'" in out
    assert "MoriWithStaging does not satisfy the StagingHost contract of StagingManagerMixin:" in (
        out
    )


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_such_module_xyz:Thing", "cannot import 'no_such_module_xyz'"),
        ("examples.hosts:NoSuchClass", "'examples.hosts' has no attribute 'NoSuchClass'"),
        ("examples.hosts:example_kv_args", "'example_kv_args' is not a class"),
        ("examples.hosts", "expected MODULE:CLASS"),
    ],
)
def test_check_unimportable_name_exits_two(
    target: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A name that cannot be imported as a class gives exit status 2."""
    assert main(["check", target]) == 2
    assert message in capsys.readouterr().err


def test_check_exception_while_importing_exits_two(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A module whose import raises (not ImportError): exit 2, the error in one line; the
    trace only with --debug."""
    (tmp_path / "exploding_backend.py").write_text(
        "def boom():\n    raise RuntimeError('no accelerator here')\n\n\nboom()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("STAGING_CONTRACTS_DEBUG", "0")  # restored (unset) after the test
    assert main(["check", "exploding_backend:Backend"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "\n"
    assert captured.err.splitlines() == [
        "exploding_backend:Backend: importing 'exploding_backend' raised RuntimeError: "
        "no accelerator here (run with --debug for the traceback)"
    ]
    sys.modules.pop("exploding_backend", None)
    assert main(["--debug", "check", "exploding_backend:Backend"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "exploding_backend:Backend: importing 'exploding_backend' raised RuntimeError: "
        "no accelerator here"
    )
    assert err[1] == "Traceback (most recent call last):"
    assert err[-1] == "RuntimeError: no accelerator here"


CACHE_MODULE = """
from typing import Protocol

from staging_contracts import Contract, ContractMixin


class CacheHost(Protocol):
    cache_dir: str


class CacheMixin(ContractMixin, contract=Contract(CacheHost)):
    def cache_path(self: CacheHost, key: str) -> str:
        return f"{self.cache_dir}/{key}"


class Good:
    cache_dir: str = "/tmp"


class Bad:
    cache_dir: int = 3


class NotAMixin:
    pass


class GoodHost(CacheMixin):
    cache_dir: str = "/tmp"
"""


@pytest.fixture
def cache_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module with a second ContractMixin and classes to check against it."""
    (tmp_path / "cli_cache_contract.py").write_text(CACHE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "cli_cache_contract"
    sys.modules.pop("cli_cache_contract", None)  # no later test may import this one by name


def test_check_against_another_mixin(cache_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--mixin checks classes against that mixin's contract, not StagingHost."""
    assert main(["check", "--mixin", f"{cache_module}:CacheMixin", f"{cache_module}:Good"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "cli_cache_contract.Good against the CacheHost contract of CacheMixin"
    )
    assert "verdict: conforms" in out
    assert "_staging_ctx" not in out
    assert main(["check", "--mixin", f"{cache_module}:CacheMixin", f"{cache_module}:Bad"]) == 1
    out = capsys.readouterr().out
    assert "Bad does not satisfy the CacheHost contract of CacheMixin:" in out
    assert "  - declares 'cache_dir' as int in Bad (expected str)" in out


@pytest.mark.parametrize(
    ("mixin", "message"),
    [
        ("cli_cache_contract:NotAMixin", "NotAMixin is not an enforcing mixin (a ContractMixin"),
        ("cli_cache_contract:Missing", "'cli_cache_contract' has no attribute 'Missing'"),
        ("nowhere_mod:Mixin", "cannot import 'nowhere_mod'"),
    ],
)
def test_check_with_a_mixin_that_is_none_exits_two(
    cache_module: str, mixin: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--mixin must name an enforcing mixin; otherwise exit 2, saying why."""
    assert main(["check", "--mixin", mixin, f"{cache_module}:Good"]) == 2
    assert message in capsys.readouterr().err


def test_check_worst_status_wins(capsys: pytest.CaptureFixture[str]) -> None:
    """With several targets the exit status is the worst of them."""
    targets = ["examples.hosts:ExampleKVManager", "examples.hosts:MoriStyleKVManager"]
    assert main(["check", *targets]) == 1
    assert main(["check", *targets, "nope_module:X"]) == 2
    capsys.readouterr()


def test_console_script_runs_check() -> None:
    """The installed console script runs from the repository root."""
    script = Path(sys.executable).with_name("staging-contracts")
    result = subprocess.run(
        [str(script), "check", "examples.hosts:ExampleKVManager"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "verdict: conforms" in result.stdout


HOOKLESS = """
from staging_contracts import (
    ArrivalMode,
    DecodeStagingContext,
    PrefillStagingContext,
    StagingHandler,
    StagingManagerMixin,
)
from staging_contracts.backends._common import CommonKVManager
from staging_contracts.backends._staging_setup import staging_idle


class Hookless(StagingManagerMixin, CommonKVManager):
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"


class Routed(Hookless):
    def _on_message(self, frames):
        if not self._dispatch_staging(frames):
            super()._on_message(frames)

    def _on_idle(self):
        staging_idle(self)
"""


def test_check_notes_a_backend_that_keeps_the_default_hooks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A conforming backend that keeps CommonKVManager's _on_message and _on_idle still
    exits 0, with a note naming both hooks and the kit's transfer check; one that overrides
    them gets no note."""
    (tmp_path / "hookless_kv.py").write_text(HOOKLESS)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "hookless_kv:Hookless"]) == 0
    out = capsys.readouterr().out
    assert "verdict: conforms" in out
    note = next(line for line in out.splitlines() if line.startswith("note: "))
    assert "_on_message (staging messages are not handed to self._dispatch_staging)" in note
    assert "_on_idle (staging_idle(self) is not called)" in note
    assert "pytest --staging-backend hookless_kv:Hookless" in note
    assert main(["check", "hookless_kv:Routed"]) == 0
    assert "keeps CommonKVManager" not in capsys.readouterr().out


def test_demo_help_gives_every_geometry_option_its_default() -> None:
    """A newcomer reads the geometry defaults in `demo --help` without opening the code."""
    import argparse

    from staging_contracts._cluster.demo import add_demo_arguments
    from staging_contracts._run.workload import TransferConfig

    parser = argparse.ArgumentParser(formatter_class=argparse.RawDescriptionHelpFormatter)
    add_demo_arguments(parser)
    default = TransferConfig()
    for action in parser._actions:
        if action.dest in {
            "prefill_tp",
            "decode_tp",
            "kv_heads",
            "layers",
            "head_dim",
            "tokens",
            "page_size",
            "requests",
            "dtype",
            "seed",
            "chunk_tokens",
        }:
            assert action.help is not None, action.dest
            assert "%(default)s" in action.help, action.dest
            assert action.default == getattr(default, action.dest), action.dest
