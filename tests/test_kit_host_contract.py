"""The kit on a serving stack's own contract, with managers built by the stack's constructor."""

from __future__ import annotations

import pytest

from tests.test_testing_plugin import KIT_TESTS, run

STACK = '''
from typing import Optional, Protocol

from staging_contracts import Contract, ContractMixin


class Handler:
    def handle(self, room):
        return room


class KVArgs:
    """A plain attribute bag, as serving stacks keep their KV arguments."""


class StagingHost(Protocol):
    kv_args: KVArgs
    attn_tp_size: int
    _staging_handler: Optional[Handler]

    def set_kv_buffer_tensors(self, k_buffers: list, v_buffers: list, page_size: int) -> None: ...


CONTRACT = Contract(StagingHost, set_later=("_staging_handler",))


class StagingMixin(ContractMixin, contract=CONTRACT):
    pass


class CommonManager:
    _staging_handler = None

    def __init__(self, args, mode, server_args, is_mla_backend=False):
        self.kv_args = args
        self.attn_tp_size = server_args["tp"]
        self.mode = mode


class Manager(StagingMixin, CommonManager):
    def set_kv_buffer_tensors(self, k_buffers, v_buffers, page_size):
        self.kv_buffer_tensors = (k_buffers, v_buffers, page_size)


def build():
    """The stack's own way: its constructor, its arguments, both modes."""
    return [Manager(KVArgs(), mode, {"tp": 2}) for mode in ("prefill", "decode")]


def build_some(*variants, **options):
    """A host factory with optional arguments: still one (callable with none)."""
    return build()


def build_wrong():
    return Manager(KVArgs(), "decode", {"tp": "2"})
'''


@pytest.fixture
def stack_dir(pytester: pytest.Pytester) -> pytest.Pytester:
    """A project with its own mixin, Protocol and manager constructor."""
    pytester.makepyfile(stack=STACK)
    pytester.syspathinsert()
    return pytester


def test_the_class_and_instance_checks_run_on_the_stack_s_own_contract(
    stack_dir: pytest.Pytester,
) -> None:
    """With a host factory, the class, explanation and instance checks pass; every check that
    needs our staging path skips, saying why."""
    result = run(stack_dir, "--staging-backend", "stack:Manager=stack:build")
    result.assert_outcomes(passed=3, skipped=KIT_TESTS - 3)
    out = result.stdout.str()
    assert "needs the staging path of staging_contracts (StagingManagerMixin); Manager is " in out
    assert "held to the StagingHost contract of stack.StagingMixin" in out


def test_a_factory_callable_with_no_argument_is_a_host_factory_whatever_else_it_takes(
    stack_dir: pytest.Pytester,
) -> None:
    """FACTORY(*variants, **options) would also bind a manager factory's call; it is a
    host factory all the same (a manager factory needs its kv_args)."""
    result = run(stack_dir, "--staging-backend", "stack:Manager=stack:build_some")
    result.assert_outcomes(passed=3, skipped=KIT_TESTS - 3)


def test_a_wrong_value_from_the_stack_s_constructor_is_reported_by_the_instance_check(
    stack_dir: pytest.Pytester,
) -> None:
    """The stack's constructor builds a manager whose member breaks the stack's Protocol:
    construction raises the contract's error, reported once, naming the factory."""
    result = run(
        stack_dir,
        "--staging-backend",
        "stack:Manager=stack:build_wrong",
        "-k",
        "instance_satisfies",
    )
    result.assert_outcomes(errors=1, deselected=KIT_TESTS - 1)
    result.stdout.fnmatch_lines(
        [
            "*the factory stack:build_wrong raised the contract's error:*",
            "*Manager instance does not satisfy the StagingHost contract of StagingMixin "
            "after __init__:*",
            "*attribute 'attn_tp_size' is str (expected int)*",
        ]
    )


def test_without_a_host_factory_the_instance_check_says_how_to_add_one(
    stack_dir: pytest.Pytester,
) -> None:
    """A stack backend named alone: the instance check skips, naming the host factory."""
    result = run(stack_dir, "--staging-backend", "stack:Manager", "-k", "instance_satisfies")
    result.assert_outcomes(skipped=1, deselected=KIT_TESTS - 1)
    assert "FACTORY() building managers the host's way" in result.stdout.str()


def test_a_factory_of_neither_kind_is_one_collection_error(stack_dir: pytest.Pytester) -> None:
    """A factory taking other arguments names both kinds the kit accepts."""
    stack_dir.makepyfile(odd="def build(a, b):\n    return None\n")
    result = run(stack_dir, "--staging-backend", "stack:Manager=odd:build")
    result.assert_outcomes(errors=1)
    assert "takes the arguments of neither kind of factory" in result.stdout.str()
    assert "a host factory FACTORY()" in result.stdout.str()
