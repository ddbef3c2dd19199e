"""Every code block of README.md and docs/ is a test: a reader can follow the pages literally.

**Python blocks** run as scripts, each in a fresh process in a scratch folder, with the
example backend package (``examples/third_party_backend/src``, ``acme_kv``) importable, and
must exit 0. A fence's title marks the few that differ (``python title="..."``; GitHub ignores
it, the site shows it above the block):

* ``title="fragment: WHAT"``: a piece of a larger block shown earlier; not run.
* ``title="raises NAME"``: run; it must fail with the exception ``NAME``, its traceback ending
  with the text of the block that follows it (the error the page shows).
* ``title="PATH"`` (no marking prefix): run, and also written to ``PATH`` in the scratch folder
  where the page's shell commands run (the state of a file the page shows at that step).

**Shell commands** (each line of a ``sh`` block, each ``$`` line of a ``console`` block):

* a synopsis (``staging-contracts demo [--backend SPEC] ...``): the options a page's synopses
  of a subcommand list are exactly those of that subcommand's ``--help``;
* a command in :data:`COMMANDS`: either run here (:class:`Run`, in the scratch folder with
  the fixture package ``mypkg`` of :data:`MYPKG`; a console block's output after the command
  is compared with the command's), dry-run (:class:`Make`), or run by another test, named
  (:class:`Covered`, checked to exist);
* a block titled ``needs WHAT`` shows commands that need what is absent here (a GPU, two
  hosts); not run.

Anything else fails, naming the command: a new command on a page needs a test. Markings must
stay rare (:data:`MAX_MARKED`), and an info string of another shape or language is refused, so
a typo cannot silence a block.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

from staging_contracts.engines import engine_available
from tests.markdown_blocks import SHELLS, Block, Command, blocks, commands, following

REPO: Final = Path(__file__).resolve().parent.parent
PAGES: Final = (REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")))
EXAMPLE_SRC: Final = REPO / "examples" / "third_party_backend" / "src"
BIN: Final = Path(sys.executable).parent
NIXL_OK, NIXL_WHY = engine_available("nixl")
TIMEOUT_S: Final = 120.0
OURS: Final = frozenset({"staging-contracts", "pytest", "make", "export"})
"""Programs the pages' commands run that the set-up always provides (a missing one fails)."""
MAX_MARKED: Final = 6
"""At most this many blocks may be marked ``fragment`` or ``needs`` over all pages."""


def _read_pages() -> tuple[list[Block], list[str]]:
    every: list[Block] = []
    problems: list[str] = []
    for page in PAGES:
        found, wrong = blocks(page, REPO)
        every += found
        problems += wrong
    return every, problems


BLOCKS, PROBLEMS = _read_pages()
PYTHON_BLOCKS: Final = [b for b in BLOCKS if b.lang == "python"]
SHOWN: Final = [c for b in BLOCKS if b.lang in SHELLS and b.mark != "needs " for c in commands(b)]


# ------------------------------------------------------------------------------ the registry


@dataclass(frozen=True)
class Run:
    """Run the command here, in the scratch folder (with the commands shown before it in its
    block first, when ``after_earlier``), expecting ``status``; then ``then`` (a shell command
    that must succeed), and ``contains`` in its output."""

    status: int = 0
    after_earlier: bool = False
    then: str | None = None
    contains: str | None = None


@dataclass(frozen=True)
class Make:
    """A ``make`` command: dry-run (``make -n``) in the repository, its recipe naming
    ``runs``; ``by`` is what runs that recipe's command for real."""

    runs: str
    by: str


@dataclass(frozen=True)
class Covered:
    """Run by another test, ``test`` (``tests/test_x.py::test_name``), as ``how`` says."""

    test: str
    how: str


_SECRET_CHECK: Final = (
    "python -c 'from staging_contracts._control.security import load_cluster_secret as load;"
    " secret = load(); assert secret is not None and len(secret) >= 16, secret'"
)
_KIT_CLI: Final = (
    "tests/test_third_party_example.py::test_installed_example_passes_the_kit_from_the_command_line"
)
_EXAMPLE_DEMO: Final = "tests/test_third_party_example.py::test_installed_example_runs_through_the_demo_across_processes"  # noqa: E501

COMMANDS: Final[dict[str, Run | Make | Covered]] = {
    # README.md
    "make demo": Make(
        ".venv/bin/staging-contracts demo",
        by="tests/test_demo.py::test_demo_command_verifies_and_exits_zero (smaller sizes)",
    ),
    "make test": Make(" -m pytest", by=".ci/run: CI runs exactly `make test`"),
    "staging-contracts check mypkg.backends:MyKVManager": Run(0),
    "staging-contracts check --mixin mypkg.cache:CacheMixin mypkg.store:Store": Run(0),
    "pytest --staging-backend mypkg.backends:MyKVManager": Run(0, contains="13 passed"),
    "openssl rand -hex 32 > ~/.staging-secret && chmod 600 ~/.staging-secret": Run(
        then="test \"$(stat -c %a ~/.staging-secret)\" = 600 && grep -Eqx '[0-9a-f]{64}' ~/.staging-secret"  # noqa: E501
    ),
    "export STAGING_CONTRACTS_SECRET_FILE=~/.staging-secret": Run(
        after_earlier=True, then=_SECRET_CHECK
    ),
    # docs/testing.md
    "make mutation": Make("scripts/mutation.py", by="nothing in make test: minutes per module"),
    'make mutation MODULES="wire layout"': Make(
        "scripts/mutation.py wire layout", by="nothing in make test: minutes per module"
    ),
    "scripts/gpu-check --dry-run": Covered(
        "tests/test_bench_scaling.py::test_gpu_check_dry_run_lists_its_steps", "as shown"
    ),
    # docs/writing-a-backend.md
    "staging-contracts check acme_kv.backend:AcmeKVManager": Run(0),
    "pytest --staging-backend acme_kv.backend:AcmeKVManager": Covered(
        _KIT_CLI, "the finished example, installed, by class and by name"
    ),
    "pytest --staging-backend acme": Covered(_KIT_CLI, "the same run by its registered name"),
    "pytest --staging-backend nixl": Covered(
        "tests/test_contract_kit.py::test_nixl_live_checks_pass", "as shown, in a child pytest"
    ),
    "pytest --staging-backend mypkg.backend:MyKVManager=mypkg.backend:make": Covered(
        "tests/test_testing_plugin.py::test_command_line_backend_passes_the_whole_kit",
        "a MODULE:CLASS=MODULE:FACTORY spec of an in-tree backend",
    ),
    "staging-contracts demo --backend nixl": Covered(
        "tests/test_demo.py::test_demo_command_verifies_and_exits_zero",
        "nixl is the default backend; smaller sizes",
    ),
    "staging-contracts demo --backend acme-nixl": Covered(_EXAMPLE_DEMO, "by registered name"),
    "staging-contracts demo --backend mypkg.backend:MyKVManager": Covered(
        _EXAMPLE_DEMO, "a class spec: acme_kv.backend:AcmeNixlKVManager"
    ),
    "staging-contracts demo --backend acme_kv.backend:AcmeKVManager=acme_kv.backend:over_nixl": (
        Covered(_EXAMPLE_DEMO, "as shown")
    ),
    "staging-contracts bench transfer --backend mypkg.backend:MyKVManager": Covered(
        "tests/test_transfer_bench_live.py::test_quick_transfer_group_measures_ours_and_both_anchors_on_every_engine",
        "the group with --quick over the in-tree backends; a spec resolves as for the demo",
    ),
    "staging-contracts soak --backend acme-nixl --duration 60": Covered(
        "tests/test_third_party_example.py::test_installed_example_runs_through_the_soak_by_name",
        "by the same name, for 2 s",
    ),
    # docs/observability.md
    "staging-contracts soak --duration 60 --metrics-port 9400": Covered(
        "tests/test_metrics_soak.py::test_the_soak_command_serves_its_metrics_on_the_port_it_is_given",
        "for 2 s, on a free port, scraped while it runs",
    ),
    "staging-contracts demo --metrics-port 9400": Covered(
        "tests/test_metrics_demo.py::test_the_demo_command_serves_its_metrics_on_the_port_it_is_given",
        "smaller sizes, on a free port, scraped while it runs",
    ),
    "staging-contracts demo --backend acme_kv.backend:AcmeKVManager=acme_kv.backend:NOPE": Run(2),
    "staging-contracts demo --backend mypkg.backend:LocalBacked": Run(2),
    "staging-contracts check mypkg.broken:MyKVManager": Run(2),
    "staging-contracts --debug check mypkg.broken:MyKVManager": Run(
        2, contains="Traceback (most recent call last):"
    ),
    # docs/operating.md, watching a run
    "staging-contracts --version": Run(0, contains="staging-contracts "),
    "staging-contracts check mypkg.backends:MyKVManager --json verdict.json": Run(
        0,
        then='python -c \'import json; doc = json.load(open("verdict.json"));'
        ' assert (doc["schema"], doc["verdict"]) == (1, "PASS"), doc\'',
    ),
    "staging-contracts demo --json demo.json --log-format json": Covered(
        "tests/test_operator_outputs.py::test_demo_json_and_json_log_lines", "smaller sizes"
    ),
    "staging-contracts soak --duration 300 --json soak.json": Covered(
        "tests/test_operator_outputs.py::test_soak_json_has_the_rooms_by_outcome",
        "for 13 s, without faults",
    ),
}
"""Every shell command the pages show (synopses aside), and how a test runs it."""

MYPKG: Final = {
    "mypkg/__init__.py": "",
    "mypkg/backends.py": """\
from staging_contracts import (
    ArrivalMode,
    DecodeStagingContext,
    KVArgs,
    PrefillStagingContext,
    StagingHandler,
    StagingManagerMixin,
)
from staging_contracts.backends._common import CommonKVManager, Role
from staging_contracts.backends._staging_setup import staging_idle
from staging_contracts.engines.local import LocalEngine


class MyKVManager(StagingManagerMixin, CommonKVManager):
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None

    def __init__(self, kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> None:
        super().__init__(kv_args, role=role, attn_tp_size=attn_tp_size, engine=LocalEngine())

    @property
    def arrival(self) -> ArrivalMode:
        return "notification"

    def _on_message(self, frames: list[bytes]) -> None:
        if not self._dispatch_staging(frames):
            super()._on_message(frames)

    def _on_idle(self) -> None:
        staging_idle(self)
""",
    "mypkg/backend.py": '''\
from mypkg.backends import MyKVManager


class LocalBacked(MyKVManager):
    """Over LocalEngine, as MyKVManager: fine in one process, refused by the demo."""
''',
    "mypkg/cache.py": """\
from typing import Protocol

from staging_contracts import Contract, ContractMixin


class CacheHost(Protocol):
    cache_dir: str


class CacheMixin(ContractMixin, contract=Contract(CacheHost)):
    def cache_path(self: CacheHost, key: str) -> str:
        return f"{self.cache_dir}/{key}"
""",
    "mypkg/store.py": """\
from mypkg.cache import CacheMixin


class Store(CacheMixin):
    cache_dir: str = "/var/cache/store"
""",
    "mypkg/broken.py": 'raise RuntimeError("no accelerator here")\n',
}
"""The package the pages' commands name as ``mypkg``: a reader's own project."""


# ------------------------------------------------------------------------------ running


def _env(scratch: Path, *paths: Path) -> dict[str, str]:
    """This environment, with ``paths`` first on PYTHONPATH, this venv's scripts first on
    PATH, HOME in the scratch folder and no cluster secret."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("STAGING_CONTRACTS_") and k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL"}
    }
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *inherited])
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env["HOME"] = str(scratch / "home")
    (scratch / "home").mkdir(exist_ok=True)
    env.pop("PYTEST_ADDOPTS", None)
    return env


def _shell(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def _page_files(block_doc: str, scratch: Path) -> None:
    """Write the fixture package and the page's titled Python blocks into ``scratch``."""
    files = dict(MYPKG)
    for block in PYTHON_BLOCKS:
        if block.doc == block_doc and block.title and block.mark is None:
            files[block.title] = block.text
            package = Path(block.title).parent
            if package != Path() and f"{package}/__init__.py" not in files:
                files[f"{package}/__init__.py"] = ""
    for name, text in files.items():
        (scratch / name).parent.mkdir(parents=True, exist_ok=True)
        (scratch / name).write_text(text)


# ------------------------------------------------------------------------------ the pages


def test_every_fence_is_closed_and_its_info_string_known() -> None:
    """The pages' fences close, and each info string is a known language and a title."""
    assert len(BLOCKS) > 40  # the reader finds the blocks
    assert PROBLEMS == []


def test_markings_are_rare_and_say_why() -> None:
    """Few blocks are left unrun, each saying why; a raises block is followed by its error."""
    marked = [b for b in BLOCKS if b.mark in {"fragment: ", "needs "}]
    assert len(marked) <= MAX_MARKED, [b.where for b in marked]
    assert all(b.title and len(b.title.split()) >= 3 for b in marked), [b.title for b in marked]
    assert all(b.lang == "python" for b in BLOCKS if b.mark in {"fragment: ", "raises "})
    assert all(b.lang in SHELLS for b in BLOCKS if b.mark == "needs ")


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.where)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    """The block runs as a script, as a reader would paste it (see the module docstring)."""
    if block.mark == "fragment: ":
        pytest.skip(f"{block.title}: not a whole program by design")
    if "nixl" in block.text and not NIXL_OK:
        pytest.skip(NIXL_WHY)
    script = tmp_path / "block.py"
    script.write_text(block.text)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_env(tmp_path, EXAMPLE_SRC),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    if block.mark != "raises ":
        assert result.returncode == 0, result.stdout + result.stderr
        return
    assert block.title is not None
    name = block.title.removeprefix("raises ")
    shown = following(block, BLOCKS)
    assert shown is not None, f"{block.where}: no block after it shows the error"
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(rf"^[\w.]*\b{name}: ", shown.text), shown.text
    assert result.stderr.rstrip().endswith(shown.text.rstrip()), result.stderr


@pytest.mark.parametrize("command", [c for c in SHOWN if not c.synopsis], ids=lambda c: c.where)
def test_shown_command_is_run(command: Command, tmp_path: Path) -> None:
    """The command is run here, or dry-run, or by the test named for it (see COMMANDS)."""
    how = COMMANDS.get(command.text)
    assert how is not None, (
        f"{command.where}: no test runs this command; add it to COMMANDS in {__name__}, or"
        ' title its block "needs ..." if it needs what is absent here'
    )
    if isinstance(how, Covered):
        path, _, name = how.test.partition("::")
        tree = ast.parse((REPO / path).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in defined, f"{how.test} is gone: which test runs {command.text!r} now?"
        return
    if isinstance(how, Make):
        dry = _shell(command.text.replace("make ", "make -n ", 1), REPO, _env(tmp_path))
        assert dry.returncode == 0, dry.stdout + dry.stderr
        assert how.runs in dry.stdout, dry.stdout
        return
    program = command.text.split()[0]
    if program not in OURS and shutil.which(program) is None:
        pytest.skip(f"{program} is not installed here")
    _page_files(command.block.doc, tmp_path)
    earlier = list(command.before) if how.after_earlier else []
    script = "\n".join(["set -e", *earlier, command.text])
    result = _shell(script, tmp_path, _env(tmp_path, tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == how.status, output
    if command.output is not None:
        assert output.strip() == command.output, output
    if how.contains is not None:
        assert how.contains in output, output
    if how.then is not None:
        after = _shell("\n".join([*earlier, command.text, how.then]), tmp_path, _env(tmp_path))
        assert after.returncode == 0, after.stdout + after.stderr


def _options(text: str) -> set[str]:
    return set(re.findall(r"--[a-z][a-z-]*", text)) - {"--help"}


def _synopses() -> dict[tuple[str, str], set[str]]:
    """``(page, subcommand)`` -> the options that page's synopses of it list."""
    found: dict[tuple[str, str], set[str]] = {}
    for command in SHOWN:
        if command.synopsis:
            words = command.text.split()
            assert words[0] == "staging-contracts", command.where
            found.setdefault((command.block.doc, words[1]), set()).update(_options(command.text))
    return found


def test_the_pages_show_synopses() -> None:
    """The reader finds the synopses of demo, soak and bench."""
    assert {sub for _, sub in _synopses()} >= {"demo", "soak", "bench"}


@pytest.mark.parametrize(("page", "subcommand"), sorted(_synopses()))
def test_a_synopsis_lists_exactly_the_options_of_the_help(page: str, subcommand: str) -> None:
    """The options a page's synopses of a subcommand show are those its --help lists."""
    script = shutil.which("staging-contracts", path=str(BIN)) or "staging-contracts"
    result = subprocess.run(
        [script, subcommand, "--help"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    usage = result.stdout.split("\n\n")[0]
    assert _synopses()[(page, subcommand)] == _options(usage)


def test_every_registered_command_is_still_shown() -> None:
    """COMMANDS names no command that the pages no longer show."""
    assert set(COMMANDS) - {c.text for c in SHOWN} == set()
