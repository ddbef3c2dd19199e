"""The contract kit's pytest plugin and base class, run in pytester sessions."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from staging_contracts._control.transport import open_socket_count
from staging_contracts.testing import NO_FACTORY_MESSAGE

PLUGIN_MODULE = "staging_contracts.testing.plugin"
LOCAL = "staging_contracts.backends.local:LocalKVManager"
KIT_TESTS = 13
CLASS_TESTS = 3
TRANSFER_TESTS = 2


def _plugin_args() -> tuple[str, ...]:
    """``-p`` arguments that load the plugin once, whether or not its entry point is installed.

    With the ``pytest11`` entry point installed, ``-p`` names the entry point (loading it by
    its module name too would register the module twice); from a bare source tree, the module.
    """
    for entry in entry_points(group="pytest11"):
        if entry.value == PLUGIN_MODULE:
            return ("-p", entry.name)
    return ("-p", PLUGIN_MODULE)


PLUGIN_ARGS = _plugin_args()
"""Arguments that load the kit's plugin in a child pytest."""

FACTORIES = """
from staging_contracts.backends._common import Role
from staging_contracts.backends.local import LocalKVManager


def local(kv_args, *, role, attn_tp_size):
    return LocalKVManager(kv_args, role=role, attn_tp_size=attn_tp_size)


def decode_only(setup):
    manager = LocalKVManager(setup.kv_args, role=Role.DECODE, attn_tp_size=setup.attn_tp_size)
    return setup.start(manager)
"""

BACKENDS = '''
from staging_contracts import (
    ArrivalMode,
    DecodeStagingContext,
    KVArgs,
    PrefillStagingContext,
    StagingHandler,
    StagingManagerMixin,
)
from staging_contracts.backends._common import CommonKVManager, Role
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.engines.local import LocalEngine


class MoriLike(CommonKVManager):
    pass


class Deaf(StagingManagerMixin, CommonKVManager):
    """Declares the contract but never hands listener messages to the mixin."""

    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"

    def __init__(self, kv_args, *, role, attn_tp_size):
        super().__init__(kv_args, role=role, attn_tp_size=attn_tp_size, engine=LocalEngine())


class Plain:
    kv_args: KVArgs
    attn_tp_size: int

    def __init__(self):
        self.kv_args = "not kv args"
        self.attn_tp_size = 1


class BadValues(StagingManagerMixin, Plain):
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"


class NeedsMore(LocalKVManager):
    """A constructor the kit cannot call: it needs a router nobody passes."""

    def __init__(self, kv_args, *, role, attn_tp_size, router):
        super().__init__(kv_args, role=role, attn_tp_size=attn_tp_size)


def needs_more(kv_args, *, role, attn_tp_size):
    return NeedsMore(kv_args, role=role, attn_tp_size=attn_tp_size, router="r0")


class NoSuper(LocalKVManager):
    """Forgets super().__init__(): the per-instance check fails every manager built."""

    def __init__(self, kv_args, *, role, attn_tp_size):
        self.built_with = kv_args


class IdleHookless(LocalKVManager):
    """The issue's bad_g: the idle hook does not call staging_idle."""

    def _on_idle(self):
        pass


def deaf(kv_args, *, role, attn_tp_size):
    return Deaf(kv_args, role=role, attn_tp_size=attn_tp_size)


def bad_values(kv_args, *, role, attn_tp_size):
    return BadValues()


def local_subclass(kv_args, *, role, attn_tp_size):
    return LocalKVManager(kv_args, role=role, attn_tp_size=attn_tp_size)
'''

BROKEN = """
from staging_contracts import StagingHandler, StagingManagerMixin
from staging_contracts.backends._common import CommonKVManager


class BrokenKVManager(StagingManagerMixin, CommonKVManager):
    _staging_handler: StagingHandler | None = None
"""


@pytest.fixture
def kit_dir(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester directory with backend and factory modules importable."""
    pytester.makepyfile(factories=FACTORIES, backends=BACKENDS, broken_backend=BROKEN)
    pytester.syspathinsert()
    return pytester


SHORT_WAITS = """
import pytest
from staging_contracts.testing import StagingBackendContract

@pytest.fixture(autouse=True)
def short_waits(monkeypatch):
    monkeypatch.setattr(StagingBackendContract, "wait_s", 0.2)
    monkeypatch.setattr(StagingBackendContract, "transfer_timeout_s", 1.5)
"""
"""A conftest that keeps the checks of broken backends short."""


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """Run pytest in-process with the plugin loaded and skip reasons reported."""
    return pytester.runpytest(*PLUGIN_ARGS, "-rs", *args)


# --------------------------------------------------------------------------- option and ini


def test_help_lists_the_option_group_and_its_ini_key(pytester: pytest.Pytester) -> None:
    """--help shows the staging-contracts group's flag and the ini key mirroring it."""
    result = run(pytester, "--help")
    result.stdout.fnmatch_lines(
        [
            "staging backend contract kit:",
            "  --staging-backend=NAME|MODULE:CLASS[[]=MODULE:FACTORY[]]",
            "*staging_backend (linelist):*",
        ]
    )


def test_command_line_backend_passes_the_whole_kit(kit_dir: pytest.Pytester) -> None:
    """--staging-backend with a factory runs every kit test on the backend, and they pass."""
    result = run(kit_dir, "-v", "--staging-backend", f"{LOCAL}=factories:local")
    result.assert_outcomes(passed=KIT_TESTS)
    result.stdout.fnmatch_lines(
        [
            "*staging-backend::TestLocalKVManager::test_chunk_writers_share_one_region PASSED*",
            "*staging-backend::TestLocalKVManager::test_staged_transfer_delivers_every_page"
            "[[]P2-D1[]] PASSED*",
            "*staging-backend::TestLocalKVManager::test_staged_transfer_delivers_every_page"
            "[[]P1-D2[]] PASSED*",
        ]
    )


def test_ini_key_names_the_backends(kit_dir: pytest.Pytester) -> None:
    """The staging_backend ini key runs the kit like the flag, under --strict-config."""
    kit_dir.makeini(f"[pytest]\nstaging_backend =\n    {LOCAL}=factories:local\n")
    result = run(kit_dir, "--strict-config")
    result.assert_outcomes(passed=KIT_TESTS)


def test_flag_overrides_the_ini_key(kit_dir: pytest.Pytester) -> None:
    """Backends given on the command line replace those of the ini key."""
    kit_dir.makeini("[pytest]\nstaging_backend = no_such_module:Nothing\n")
    result = run(kit_dir, "--staging-backend", LOCAL, "-k", "class_satisfies")
    result.assert_outcomes(passed=1, deselected=KIT_TESTS - 1)


def test_class_only_runs_every_check_with_the_standard_constructor(
    kit_dir: pytest.Pytester,
) -> None:
    """With no factory, the kit builds the backend as Class(kv_args, role=, attn_tp_size=)."""
    result = run(kit_dir, "--staging-backend", LOCAL)
    result.assert_outcomes(passed=KIT_TESTS)


def test_registry_name_runs_the_in_tree_backend(kit_dir: pytest.Pytester) -> None:
    """--staging-backend local: the in-tree backend by its registry name, factories included."""
    result = run(kit_dir, "-v", "--staging-backend", "local")
    result.assert_outcomes(passed=KIT_TESTS)
    result.stdout.fnmatch_lines(
        ["*staging-backend::TestLocalKVManager::test_instance_satisfies_the_contract PASSED*"]
    )


def test_unknown_backend_name_is_a_usage_error_listing_the_known_ones(
    pytester: pytest.Pytester,
) -> None:
    """A bare name that is neither in-tree nor registered stops pytest, listing the names."""
    result = run(pytester, "--staging-backend", "acme_nowhere")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*--staging-backend expects NAME, MODULE:CLASS or MODULE:CLASS=MODULE:FACTORY "
            "(e.g. nixl or mypkg.backend:MyKVManager): unknown backend 'acme_nowhere'; "
            "known: ascend, local, mooncake, mori (no staging), nixl*"
        ]
    )


def test_repeated_flag_tests_each_backend(kit_dir: pytest.Pytester) -> None:
    """Each --staging-backend gets its own generated test class."""
    result = run(
        kit_dir,
        "--collect-only",
        "-q",
        "--staging-backend",
        LOCAL,
        "--staging-backend",
        "staging_contracts.backends.mooncake:MooncakeKVManager",
    )
    result.stdout.fnmatch_lines(
        [
            "staging-backend::TestLocalKVManager::test_class_satisfies_the_contract",
            "*",
            "staging-backend::TestMooncakeKVManager::test_class_satisfies_the_contract",
        ]
    )
    assert result.ret == pytest.ExitCode.OK


def test_keyword_selects_generated_tests(kit_dir: pytest.Pytester) -> None:
    """-k selects among the generated tests like any others."""
    result = run(kit_dir, "--staging-backend", LOCAL, "-k", "class_satisfies")
    result.assert_outcomes(passed=1, deselected=KIT_TESTS - 1)


def test_a_backend_without_a_witness_is_recommended_one_after_the_run(
    kit_dir: pytest.Pytester,
) -> None:
    """The class check passes, and the run ends with the witness line the backend could add;
    a backend that states its witness (local) gets no note."""
    result = run(kit_dir, "--staging-backend", "backends:Deaf", "-k", "class_satisfies")
    result.assert_outcomes(passed=1, deselected=KIT_TESTS - 1)
    result.stdout.fnmatch_lines(
        [
            "*- staging-contracts -*",
            "note: Deaf states no witness of its contract: add "
            "'__contract: ClassVar[StagingHostCheck[Deaf]]' as the first statement of its body "
            "(after the docstring), so that every type checker (mypy, pyright, ty, pyrefly) "
            "reports a broken contract at the class, with no plugin "
            "(docs/writing-a-backend.md, section 7)",
        ]
    )
    result = run(kit_dir, "--staging-backend", LOCAL, "-k", "class_satisfies")
    result.assert_outcomes(passed=1, deselected=KIT_TESTS - 1)
    assert "states no witness" not in result.stdout.str()


def test_malformed_backend_name_is_a_usage_error(pytester: pytest.Pytester) -> None:
    """A value that is not NAME or MODULE:CLASS[=MODULE:FACTORY] stops pytest."""
    result = run(pytester, "--staging-backend", "mod:Class=factory")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*--staging-backend expects NAME, MODULE:CLASS or MODULE:CLASS=MODULE:FACTORY * got "
            "'mod:Class=factory'"
        ]
    )


def test_without_the_flag_the_plugin_adds_nothing(pytester: pytest.Pytester) -> None:
    """With no backend named, the plugin collects no test."""
    result = run(pytester)
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED


# --------------------------------------------------------------------------- outcomes


LIVE_TESTS = KIT_TESTS - CLASS_TESTS - TRANSFER_TESTS
"""Checks on one live decode manager."""


def test_from_the_flag_a_constructor_that_does_not_fit_fails_once(
    kit_dir: pytest.Pytester,
) -> None:
    """--staging-backend names a class the kit cannot build: the run fails (the transfer is
    what the kit checks), once, saying why and naming the factory to pass; the other checks
    that need a manager skip, pointing at that report."""
    result = run(kit_dir, "--staging-backend", "backends:NeedsMore")
    result.assert_outcomes(passed=CLASS_TESTS, errors=1, skipped=KIT_TESTS - CLASS_TESTS - 1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    output = result.stdout.str()
    why = (
        "its standard constructor NeedsMore(kv_args, role=..., attn_tp_size=...) does not fit "
        "NeedsMore(kv_args, *, role, attn_tp_size, router): missing a required argument: "
        "'router'"
    )
    assert output.count(why) == 1, output
    assert "--staging-backend backends:NeedsMore=MODULE:FACTORY" in output
    first = "staging-backend::TestNeedsMore::test_instance_satisfies_the_contract"
    skips = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    assert skips, output
    assert all(line.endswith(f"reported once, in {first}") for line in skips), skips


def test_from_the_flag_a_manager_factory_builds_every_check(kit_dir: pytest.Pytester) -> None:
    """The flag's factory is the manager factory of demo and run_transfer: it builds the
    kit's decode manager and every transfer rank, so a class whose constructor is not the
    standard one passes the whole kit, transfer checks included."""
    result = run(kit_dir, "--staging-backend", "backends:NeedsMore=backends:needs_more")
    result.assert_outcomes(passed=KIT_TESTS)


def test_a_decode_factory_on_the_flag_is_one_collection_error_naming_both_kinds(
    kit_dir: pytest.Pytester,
) -> None:
    """FACTORY(setup) where a manager factory is expected: one collection error that says
    which kind the flag takes and which was given."""
    result = run(kit_dir, "--staging-backend", f"{LOCAL}=factories:decode_only")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*the factory factories:decode_only(setup) takes the arguments of neither kind of "
            "factory: --staging-backend MODULE:CLASS=MODULE:FACTORY (like demo --backend and "
            "run_transfer) calls a manager factory FACTORY(kv_args, *, role=..., "
            "attn_tp_size=...)*"
        ]
    )
    assert "make_decode_manager(self, setup)" in result.stdout.str()


def test_subclass_without_a_factory_skips_saying_how_to_add_one(
    pytester: pytest.Pytester,
) -> None:
    """A subclass without factories, of a backend the kit cannot build, skips the live tests."""
    pytester.makepyfile(
        test_mine="""
        from staging_contracts.backends.local import LocalKVManager
        from staging_contracts.testing import StagingBackendContract


        class NeedsMore(LocalKVManager):
            def __init__(self, kv_args, *, role, attn_tp_size, router):
                super().__init__(kv_args, role=role, attn_tp_size=attn_tp_size)


        class TestMine(StagingBackendContract):
            backend_class = NeedsMore
        """
    )
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=CLASS_TESTS, skipped=KIT_TESTS - CLASS_TESTS)
    result.stdout.fnmatch_lines([f"SKIPPED * {NO_FACTORY_MESSAGE}"])


def test_subclass_without_a_factory_runs_the_standard_constructor(
    pytester: pytest.Pytester,
) -> None:
    """A subclass that names a backend with the standard constructor runs every check."""
    pytester.makepyfile(
        test_mine="""
        from staging_contracts.backends.local import LocalKVManager
        from staging_contracts.testing import StagingBackendContract


        class TestMine(StagingBackendContract):
            backend_class = LocalKVManager
        """
    )
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=KIT_TESTS)


def test_subclass_with_a_factory_passes_and_leaks_nothing(pytester: pytest.Pytester) -> None:
    """The kit closes every manager, socket and thread it opened."""
    pytester.makepyfile(
        test_mine="""
        from staging_contracts.backends._common import Role
        from staging_contracts.backends.local import LocalKVManager
        from staging_contracts.testing import StagingBackendContract


        class TestMine(StagingBackendContract):
            backend_class = LocalKVManager

            def make_decode_manager(self, setup):
                manager = LocalKVManager(setup.kv_args, role=Role.DECODE, attn_tp_size=1)
                return setup.start(manager)
        """
    )
    threads = {thread.ident for thread in threading.enumerate()}
    sockets = open_socket_count()
    result = pytester.runpytest()
    result.assert_outcomes(passed=KIT_TESTS)
    assert open_socket_count() == sockets
    assert {thread.ident for thread in threading.enumerate()} <= threads


def test_subclass_without_backend_class_fails_saying_what_to_add(
    pytester: pytest.Pytester,
) -> None:
    """A subclass that names no backend fails its class tests with what to write."""
    pytester.makepyfile(
        test_mine="""
        from staging_contracts.testing import StagingBackendContract


        class TestMine(StagingBackendContract):
            pass
        """
    )
    result = pytester.runpytest("-k", "class_satisfies")
    result.assert_outcomes(failed=1, deselected=KIT_TESTS - 1)
    result.stdout.fnmatch_lines(["*TestMine sets no backend_class: add 'backend_class = *"])


def test_backend_rejected_at_import_is_one_collection_error_with_the_contract_message(
    kit_dir: pytest.Pytester,
) -> None:
    """A class statement the contract rejects: one collection error, message and explanation."""
    result = run(kit_dir, "--staging-backend", "broken_backend:BrokenKVManager")
    result.assert_outcomes(errors=1)
    output = result.stdout.str()
    assert output.count("does not satisfy the StagingHost contract") == 1
    assert "Traceback" not in output
    assert "contract.py" not in output
    result.stdout.fnmatch_lines(
        [
            "*ERROR collecting staging-backend *",
            "broken_backend:BrokenKVManager: importing 'broken_backend' failed: the contract "
            "rejected a class statement:",
            "BrokenKVManager does not satisfy the StagingHost contract of StagingManagerMixin:",
            "  - has no declaration of '_staging_ctx' "
            "(expected DecodeStagingContext | PrefillStagingContext | None)",
            "Fix: Declare each missing member *",
            "",
            "broken_backend.BrokenKVManager against the StagingHost contract *",
        ]
    )


def test_class_without_the_mixin_fails_the_class_check(kit_dir: pytest.Pytester) -> None:
    """A backend that uses no enforcing mixin fails, told where to list one."""
    result = run(kit_dir, "--staging-backend", "backends:MoriLike", "-k", "class_satisfies")
    result.assert_outcomes(failed=1, deselected=KIT_TESTS - 1)
    result.stdout.fnmatch_lines(
        [
            "MoriLike uses no enforcing mixin: list StagingManagerMixin (or your stack's own "
            "ContractMixin subclass) first in the bases, e.g. 'class "
            "MoriLike(StagingManagerMixin, CommonKVManager)'.",
            "",
            "backends.MoriLike against the StagingHost contract of StagingManagerMixin",
        ]
    )


def test_unimportable_backend_is_one_collection_error_with_a_path_hint(
    kit_dir: pytest.Pytester,
) -> None:
    """A backend module that cannot be found: one collection error naming it, with the hint."""
    result = run(kit_dir, "--staging-backend", "acme_backend:AcmeKVManager")
    result.assert_outcomes(errors=1)
    assert "Traceback" not in result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*ERROR collecting staging-backend *",
            "acme_backend:AcmeKVManager: cannot import the backend module 'acme_backend': "
            "No module named 'acme_backend' (pytest does not put the current directory on "
            'sys.path: run \'python -m pytest\', or set pythonpath = [[]"."[]] (or [[]"src"[]]) '
            "under [[]tool.pytest.ini_options[]], or install the package)",
        ]
    )


def test_a_misspelt_submodule_is_named_without_the_path_hint(kit_dir: pytest.Pytester) -> None:
    """The package imports but its submodule does not: the error names the submodule, and
    does not send the author after sys.path."""
    kit_dir.mkpydir("zeta_kv")
    result = run(kit_dir, "--staging-backend", "zeta_kv.backnd:ZetaKVManager")
    result.assert_outcomes(errors=1)
    output = result.stdout.str()
    assert "'zeta_kv' imports, but has no submodule 'backnd': check the name" in output, output
    assert "pytest does not put the current directory on sys.path" not in output


def test_a_registered_name_whose_module_is_missing_names_its_entry_point(
    kit_dir: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--staging-backend NAME of an entry point whose module is gone: one collection error
    that starts with the entry point, and no sys.path hint (the name is not a path)."""
    info = kit_dir.path / "gone_kv-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gone-kv\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[staging_contracts.backends]\ngonekv = no_such_gone_kv:GoneKVManager\n"
    )
    monkeypatch.syspath_prepend(str(kit_dir.path))
    result = run(kit_dir, "--staging-backend", "gonekv")
    result.assert_outcomes(errors=1)
    output = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "gonekv: entry point gonekv = no_such_gone_kv:GoneKVManager of group "
            "'staging_contracts.backends': cannot import the backend module 'no_such_gone_kv'*"
        ]
    )
    assert "pytest does not put the current directory on sys.path" not in output


def test_backend_whose_import_raises_is_one_collection_error_with_its_traceback(
    pytester: pytest.Pytester,
) -> None:
    """Any other error importing the backend: one collection error, with the module's trace."""
    pytester.makepyfile(exploding="raise RuntimeError('no GPU here')\n")
    pytester.syspathinsert()
    result = run(pytester, "--staging-backend", "exploding:Backend", "--staging-backend", LOCAL)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "exploding:Backend: importing the backend module 'exploding' raised RuntimeError: "
            "no GPU here",
            "*exploding.py*line 1*",
            "RuntimeError: no GPU here",
        ]
    )


def test_only_the_broken_backend_is_an_error(kit_dir: pytest.Pytester) -> None:
    """A broken backend next to a working one: the working one's tests still collect."""
    result = run(
        kit_dir,
        "--collect-only",
        "-q",
        "--staging-backend",
        "no_such_module:Nothing",
        "--staging-backend",
        LOCAL,
    )
    result.stdout.fnmatch_lines(
        ["staging-backend::TestLocalKVManager::test_class_satisfies_the_contract"]
    )
    assert result.stdout.str().count("staging-backend::TestLocalKVManager::") == KIT_TESTS


def test_backend_that_does_not_route_staging_messages_fails_the_listener_checks(
    kit_dir: pytest.Pytester,
) -> None:
    """Checks that send through the listener fail when _on_message ignores staging messages."""
    kit_dir.makeconftest(SHORT_WAITS)
    result = run(kit_dir, "--staging-backend", "backends:Deaf=backends:deaf")
    result.assert_outcomes(passed=KIT_TESTS - 3 - TRANSFER_TESTS, failed=3 + TRANSFER_TESTS)
    result.stdout.fnmatch_lines(
        [
            "*TestDeaf.test_unknown_room_staging_req_is_dropped_and_counted*",
            "after 0.2s, staging_stats() changed by {}, expected {'received': 1, 'dropped': 1} "
            "(is the listener started, and does Deaf._on_message hand staging messages to "
            "self._dispatch_staging?)",
            "*TestDeaf.test_oversized_chunk_is_answered_with_offset_minus_two*",
            "the prefill peer got no STAGING_RSP for an oversized chunk (is the listener *",
            "*TestDeaf.test_chunk_writers_share_one_region*",
            "2 writers asked for a region; their peers got 0 answers, expected 4: *",
            "*TestDeaf.test_staged_transfer_delivers_every_page*P2-D1*",
            "the staged transfer from prefill TP 2 to decode TP 1 through Deaf failed: "
            "decode's staging handler got no message at all: is the decode listener started, "
            "and does its _on_message hand staging messages to self._dispatch_staging?",
        ]
    )


def test_idle_hookless_backend_fails_the_transfer_checks_naming_the_idle_hook(
    kit_dir: pytest.Pytester,
) -> None:
    """The issue's bad_g passes every single-manager check but fails both transfer checks."""
    kit_dir.makeconftest(SHORT_WAITS)
    result = run(kit_dir, "--staging-backend", "backends:IdleHookless")
    result.assert_outcomes(passed=KIT_TESTS - TRANSFER_TESTS, failed=TRANSFER_TESTS)
    for shape, (prefill_tp, decode_tp) in (("P2-D1", (2, 1)), ("P1-D2", (1, 2))):
        result.stdout.fnmatch_lines(
            [
                f"*TestIdleHookless.test_staged_transfer_delivers_every_page*{shape}*",
                f"the staged transfer from prefill TP {prefill_tp} to decode TP {decode_tp} "
                "through IdleHookless failed: no arrivals were delivered at all (ring regions "
                "were allocated): is the listener's idle hook wired to staging_idle? (arrivals by "
                "engine notification are delivered there: '_on_idle(self): staging_idle(self)')",
                "room 1000: failed: timed out after 1.5s *(arrivals 0/*, chunks verified 0/3)",
            ]
        )
    # each failed room once per check: in its failure, not again in the captured log
    assert result.stdout.str().count("room 1000: failed") == TRANSFER_TESTS


STALLS = """
import pytest
from staging_contracts.testing import StagingBackendContract

@pytest.fixture(autouse=True)
def no_progress_ends_early(monkeypatch):
    monkeypatch.setattr(StagingBackendContract, "transfer_timeout_s", 120.0)
    monkeypatch.setattr(StagingBackendContract, "transfer_stall_s", 0.5)
"""
"""A conftest whose transfer bound the checks below must not reach."""


@pytest.mark.parametrize(
    ("backend", "why"),
    [
        ("IdleHookless", "every write was done 0.5s ago and no arrival reached decode"),
        ("Deaf", "decode got no staging message"),
    ],
)
def test_a_transfer_check_that_cannot_progress_ends_before_its_bound(
    kit_dir: pytest.Pytester, backend: str, why: str
) -> None:
    """No decode message, or no arrival after every write was done: the transfer check ends
    with that reason instead of waiting out transfer_timeout_s (its rooms do not say 'timed
    out after 120s')."""
    kit_dir.makeconftest(STALLS)
    result = run(kit_dir, "--staging-backend", f"backends:{backend}", "-k", "P2-D1")
    result.assert_outcomes(failed=1, deselected=KIT_TESTS - 1)
    result.stdout.fnmatch_lines([f"room 1000: failed: stopped after *s: {why} (*"])
    assert "timed out after" not in result.stdout.str()


def test_factory_whose_instance_breaks_the_contract_fails_with_its_message(
    kit_dir: pytest.Pytester,
) -> None:
    """A factory whose manager fails the per-instance check fails the live tests with it."""
    result = run(
        kit_dir,
        "--staging-backend",
        "backends:BadValues=backends:bad_values",
        "-k",
        "instance_satisfies",
    )
    result.assert_outcomes(errors=1, deselected=KIT_TESTS - 1)
    result.stdout.fnmatch_lines(
        [
            "the factory backends:bad_values raised the contract's error:",
            "BadValues instance does not satisfy the StagingHost contract of "
            "StagingManagerMixin after __init__:",
            "  - attribute 'kv_args' is str (expected KVArgs)*",
        ]
    )


def test_factory_of_another_class_fails(kit_dir: pytest.Pytester) -> None:
    """A factory must return an instance of the backend under test."""
    result = run(
        kit_dir,
        "--staging-backend",
        "backends:Deaf=backends:local_subclass",
        "-k",
        "instance_satisfies",
    )
    result.assert_outcomes(errors=1, deselected=KIT_TESTS - 1)
    result.stdout.fnmatch_lines(["*the factory returned a LocalKVManager, not a Deaf"])


def test_a_constructor_that_breaks_the_contract_is_reported_once(
    kit_dir: pytest.Pytester,
) -> None:
    """A forgotten super().__init__(): one report naming the author's constructor (not the
    kit's make_decode_manager), without chained tracebacks; every other check that needs a
    manager, transfer checks included, skips pointing at it."""
    result = run(kit_dir, "--staging-backend", "backends:NoSuper")
    result.assert_outcomes(passed=CLASS_TESTS, errors=1, skipped=KIT_TESTS - CLASS_TESTS - 1)
    output = result.stdout.str()
    assert output.count("did NoSuper.__init__ call super().__init__()?") == 1, output
    assert (
        "the constructor NoSuper(kv_args, role=..., attn_tp_size=...) raised the contract's"
        in output
    )
    assert "During handling of the above exception" not in output
    assert "make_decode_manager" not in output
    skips = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    assert all("reported once, in staging-backend::TestNoSuper::" in line for line in skips)


def test_a_subclass_without_backend_class_is_reported_once(pytester: pytest.Pytester) -> None:
    """A test class that names no backend: one failure, the other checks skip pointing at it."""
    pytester.makepyfile(
        test_nobackend="""
from staging_contracts.testing import StagingBackendContract


class TestNothing(StagingBackendContract):
    pass
"""
    )
    result = run(pytester)
    result.assert_outcomes(failed=1, skipped=KIT_TESTS - 1)
    output = result.stdout.str()
    assert output.count("TestNothing sets no backend_class") == 1, output
    skips = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    first = "test_nobackend.py::TestNothing::test_class_satisfies_the_contract"
    assert skips, output
    assert all(line.endswith(f"reported once, in {first}") for line in skips), skips


# --------------------------------------------------------------------------- a test module's import


def test_test_module_rejected_by_the_contract_is_one_short_collection_error(
    kit_dir: pytest.Pytester,
) -> None:
    """A test module importing a backend the contract rejects: the message and explanation,
    without the library's frames."""
    kit_dir.makepyfile(
        test_mine="""
        from broken_backend import BrokenKVManager
        from staging_contracts.testing import StagingBackendContract


        class TestMine(StagingBackendContract):
            backend_class = BrokenKVManager
        """
    )
    result = kit_dir.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "importing test_mine.py failed: the contract rejected a class statement:",
            "BrokenKVManager does not satisfy the StagingHost contract of StagingManagerMixin:",
            "  - has no declaration of '_staging_ctx' *",
            "Fix: *",
            "",
            "broken_backend.BrokenKVManager against the StagingHost contract *",
        ]
    )
    output = result.stdout.str()
    assert "enforcement.py" not in output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    ("folder", "entry", "cwd_hint"),
    [("src", "src", ""), (".", ".", " run 'python -m pytest' (it adds the current directory), or")],
)
def test_project_module_not_found_gets_a_sys_path_hint(
    pytester: pytest.Pytester, folder: str, entry: str, cwd_hint: str
) -> None:
    """A test module importing a package of the project that pytest cannot find (run as
    ``pytest``): the hint says where it is and how to make it importable."""
    package = pytester.path / folder / "acme_backend"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    tests = pytester.path / "tests"
    tests.mkdir()
    (tests / "test_acme.py").write_text("import acme_backend\n")
    script = Path(sys.executable).with_name("pytest")  # not `python -m pytest`: no cwd on path
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    done = subprocess.run(
        [str(script), "-p", "no:cacheprovider"],
        cwd=pytester.path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == pytest.ExitCode.INTERRUPTED, done.stdout + done.stderr
    where = package.parent
    pytest.LineMatcher(done.stdout.splitlines()).fnmatch_lines(
        [
            "E   ModuleNotFoundError: No module named 'acme_backend'",
            f"Hint: 'acme_backend' is in {where}, which is not on sys.path:{cwd_hint} set "
            f'pythonpath = [[]"{entry}"[]] under [[]tool.pytest.ini_options[]], or install '
            "the package (pip install -e .)",
        ]
    )


def test_missing_dependency_gets_no_sys_path_hint(pytester: pytest.Pytester) -> None:
    """A module that is not in the project (a missing dependency) gets no hint."""
    pytester.makepyfile(test_dep="import no_such_dependency_xyz\n")
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    assert "is not on sys.path" not in result.stdout.str()


def test_a_decode_factory_returning_the_wrong_thing_is_named_with_its_article(
    pytester: pytest.Pytester,
) -> None:
    """make_decode_manager returning an int: one failure 'returned an int' (not 'a int', and no
    AttributeError from closing it)."""
    pytester.makepyfile(
        test_wrongtype="""
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.testing import StagingBackendContract


class TestWrong(StagingBackendContract):
    backend_class = LocalKVManager

    def make_decode_manager(self, setup):
        return 3
"""
    )
    result = run(pytester, "-k", "instance_satisfies")
    result.assert_outcomes(errors=1, deselected=KIT_TESTS - 1)
    output = result.stdout.str()
    assert (
        "TestWrong.make_decode_manager returned an int, not an instance of LocalKVManager" in output
    ), output
    assert "AttributeError" not in output
