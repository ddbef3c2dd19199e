"""The contract kit's pytest plugin and base class, run in pytester sessions."""

from __future__ import annotations

import threading
from importlib.metadata import entry_points

import pytest

from staging_contracts.control.transport import open_socket_count
from staging_contracts.testing import NO_FACTORY_MESSAGE

PLUGIN_MODULE = "staging_contracts.testing.plugin"
LOCAL = "staging_contracts.backends.local:LocalKVManager"
KIT_TESTS = 11
CLASS_TESTS = 3


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
from staging_contracts.backends.common import Role
from staging_contracts.backends.local import LocalKVManager


def local(setup):
    manager = LocalKVManager(setup.kv_args, role=Role.DECODE, attn_tp_size=setup.attn_tp_size)
    return setup.start(manager)
"""

BACKENDS = '''
from staging_contracts import (
    DecodeStagingContext,
    KVArgs,
    PrefillStagingContext,
    StagingHandler,
    StagingManagerMixin,
)
from staging_contracts.backends.common import CommonKVManager, Role
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.engines.local import LocalEngine


class MoriLike(CommonKVManager):
    pass


class Deaf(StagingManagerMixin, CommonKVManager):
    """Declares the contract but never hands listener messages to the mixin."""

    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None

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


def deaf(setup):
    manager = Deaf(setup.kv_args, role=Role.DECODE, attn_tp_size=setup.attn_tp_size)
    return setup.start(manager)


def bad_values(setup):
    return BadValues()


def local_subclass(setup):
    return LocalKVManager(setup.kv_args, role=Role.DECODE, attn_tp_size=1)
'''

BROKEN = """
from staging_contracts import StagingHandler, StagingManagerMixin
from staging_contracts.backends.common import CommonKVManager


class BrokenKVManager(StagingManagerMixin, CommonKVManager):
    _staging_handler: StagingHandler | None = None
"""


@pytest.fixture
def kit_dir(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester directory with backend and factory modules importable."""
    pytester.makepyfile(factories=FACTORIES, backends=BACKENDS, broken_backend=BROKEN)
    pytester.syspathinsert()
    return pytester


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
            "  --staging-backend=MODULE:CLASS[[]=MODULE:FACTORY[]]",
            "*staging_backend (linelist):*",
        ]
    )


def test_command_line_backend_passes_the_whole_kit(kit_dir: pytest.Pytester) -> None:
    """--staging-backend with a factory runs every kit test on the backend, and they pass."""
    result = run(kit_dir, "-v", "--staging-backend", f"{LOCAL}=factories:local")
    result.assert_outcomes(passed=KIT_TESTS)
    result.stdout.fnmatch_lines(
        ["*staging-backend::TestLocalKVManager::test_chunk_writers_share_one_region PASSED*"]
    )


def test_ini_key_names_the_backends(kit_dir: pytest.Pytester) -> None:
    """The staging_backend ini key runs the kit like the flag, under --strict-config."""
    kit_dir.makeini(f"[pytest]\nstaging_backend =\n    {LOCAL}=factories:local\n")
    result = run(kit_dir, "--strict-config")
    result.assert_outcomes(passed=KIT_TESTS)


def test_flag_overrides_the_ini_key(kit_dir: pytest.Pytester) -> None:
    """Backends given on the command line replace those of the ini key."""
    kit_dir.makeini("[pytest]\nstaging_backend = no_such_module:Nothing\n")
    result = run(kit_dir, "--staging-backend", LOCAL)
    result.assert_outcomes(passed=CLASS_TESTS, skipped=KIT_TESTS - CLASS_TESTS)


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


def test_malformed_backend_name_is_a_usage_error(pytester: pytest.Pytester) -> None:
    """A value that is not MODULE:CLASS[=MODULE:FACTORY] stops pytest with a usage error."""
    result = run(pytester, "--staging-backend", "LocalKVManager")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--staging-backend expects MODULE:CLASS or MODULE:CLASS=MODULE:FACTORY*"]
    )


def test_without_the_flag_the_plugin_adds_nothing(pytester: pytest.Pytester) -> None:
    """With no backend named, the plugin collects no test."""
    result = run(pytester)
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED


# --------------------------------------------------------------------------- outcomes


def test_without_a_factory_behaviour_tests_skip_saying_how_to_add_one(
    kit_dir: pytest.Pytester,
) -> None:
    """Without a factory the class tests pass and each live test skips with the how-to."""
    result = run(kit_dir, "--staging-backend", LOCAL)
    result.assert_outcomes(passed=CLASS_TESTS, skipped=KIT_TESTS - CLASS_TESTS)
    assert result.stdout.str().count(NO_FACTORY_MESSAGE) == KIT_TESTS - CLASS_TESTS


def test_subclass_without_a_factory_skips_saying_how_to_add_one(
    pytester: pytest.Pytester,
) -> None:
    """A StagingBackendContract subclass without make_decode_manager skips the live tests."""
    pytester.makepyfile(
        test_mine="""
        from staging_contracts.backends.local import LocalKVManager
        from staging_contracts.testing import StagingBackendContract


        class TestMine(StagingBackendContract):
            backend_class = LocalKVManager
        """
    )
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=CLASS_TESTS, skipped=KIT_TESTS - CLASS_TESTS)
    result.stdout.fnmatch_lines([f"SKIPPED * {NO_FACTORY_MESSAGE}"])


def test_subclass_with_a_factory_passes_and_leaks_nothing(pytester: pytest.Pytester) -> None:
    """The kit closes every manager, socket and thread it opened."""
    pytester.makepyfile(
        test_mine="""
        from staging_contracts.backends.common import Role
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


def test_backend_rejected_at_import_fails_with_the_contract_message(
    kit_dir: pytest.Pytester,
) -> None:
    """A class statement the contract rejects fails the kit with its message and explanation."""
    result = run(kit_dir, "--staging-backend", "broken_backend:BrokenKVManager")
    result.assert_outcomes(failed=CLASS_TESTS, errors=KIT_TESTS - CLASS_TESTS)
    result.stdout.fnmatch_lines(
        [
            "importing 'broken_backend' failed: the contract rejected a class statement:",
            "BrokenKVManager does not satisfy the StagingHost contract of StagingManagerMixin:",
            "  - has no declaration of '_staging_ctx' "
            "(expected DecodeStagingContext | PrefillStagingContext | None)",
            "Fix: Declare each missing member *",
            "",
            "broken_backend.BrokenKVManager against the StagingHost contract *",
        ]
    )


def test_class_without_the_mixin_fails_the_class_check(kit_dir: pytest.Pytester) -> None:
    """A backend that does not mix in StagingManagerMixin fails, told where to list it."""
    result = run(kit_dir, "--staging-backend", "backends:MoriLike", "-k", "class_satisfies")
    result.assert_outcomes(failed=1, deselected=KIT_TESTS - 1)
    result.stdout.fnmatch_lines(
        [
            "MoriLike does not mix in StagingManagerMixin: list it first in the bases, "
            "e.g. 'class MoriLike(StagingManagerMixin, CommonKVManager)'.",
            "",
            "backends.MoriLike against the StagingHost contract of StagingManagerMixin",
        ]
    )


def test_unimportable_backend_fails_naming_the_module(kit_dir: pytest.Pytester) -> None:
    """A backend module that cannot be imported fails the class tests, naming it."""
    result = run(kit_dir, "--staging-backend", "no_such_module:Nothing", "-k", "explanation")
    result.assert_outcomes(failed=1, deselected=KIT_TESTS - 1)
    result.stdout.fnmatch_lines(
        ["*cannot import the backend module 'no_such_module': No module named 'no_such_module'"]
    )


def test_backend_that_does_not_route_staging_messages_fails_the_listener_checks(
    kit_dir: pytest.Pytester,
) -> None:
    """Checks that send through the listener fail when _on_message ignores staging messages."""
    kit_dir.makeconftest(
        """
        import pytest
        from staging_contracts.testing import StagingBackendContract

        @pytest.fixture(autouse=True)
        def short_waits(monkeypatch):
            monkeypatch.setattr(StagingBackendContract, "wait_s", 0.2)
        """
    )
    result = run(kit_dir, "--staging-backend", "backends:Deaf=backends:deaf")
    result.assert_outcomes(passed=KIT_TESTS - 3, failed=3)
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
        ]
    )


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
            "make_decode_manager raised the contract's error:",
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
    result.stdout.fnmatch_lines(
        ["*make_decode_manager returned a LocalKVManager, not an instance of Deaf"]
    )
