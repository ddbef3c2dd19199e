"""The command line refuses what cannot run at once, in one line, without a traceback: each
case runs the installed console script in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import pytest

from staging_contracts._cluster._messages import Ready
from staging_contracts._cluster.demo import format_summary
from staging_contracts._cluster.preflight import PROCESS_OVERHEAD_BYTES, memory_need, preflight
from staging_contracts._cluster.runner import run_cluster
from staging_contracts._run._codec import RankEvent
from staging_contracts._run.workload import TransferConfig
from staging_contracts.engines import engine_available
from tests.test_cluster_faults import tiny_config

SCRIPT = Path(sys.executable).with_name("staging-contracts")
NIXL_OK, NIXL_WHY = engine_available("nixl")


class Ran(NamedTuple):
    status: int
    out: str
    err: str
    seconds: float


def run(*args: str, env: dict[str, str] | None = None) -> Ran:
    """The console script with ``args``; its exit status, output and wall time."""
    start = time.monotonic()
    done = subprocess.run(
        [str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "STAGING_CONTRACTS_DEBUG": "0", **(env or {})},
        check=False,
    )
    return Ran(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


def assert_refused(ran: Ran, *names: str) -> str:
    """Exit 2, one line on stderr naming every one of ``names``, no traceback, nothing on
    stdout (a run that started prints its banner there, and ``soak`` its start line on
    stderr: refused before any process starts, whatever the machine's load)."""
    assert ran.status == 2, ran
    lines = ran.err.strip().splitlines()
    assert len(lines) == 1, ran.err
    assert "Traceback" not in ran.err + ran.out
    assert ran.out == "", ran.out
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def test_a_missing_engine_extra_is_one_line_with_the_install_command(tmp_path: Path) -> None:
    """demo --backend mooncake without the mooncake extra: one line, the pip command once."""
    shadow = tmp_path / "mooncake"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'mooncake'\")\n")
    line = assert_refused(
        run("demo", "--backend", "mooncake", env={"PYTHONPATH": str(tmp_path)}),
        "--backend mooncake",
    )
    assert line.count("pip install 'staging-contracts[mooncake]'") == 1


def test_tp_sizes_that_do_not_divide_are_refused() -> None:
    """demo --prefill-tp 3 --decode-tp 2: refused before any process starts."""
    assert_refused(
        run("demo", "--prefill-tp", "3", "--decode-tp", "2"),
        "--prefill-tp 3",
        "--decode-tp 2",
        "must divide one another",
    )


def test_heads_that_do_not_divide_the_tp_size_are_refused() -> None:
    """demo --kv-heads 6 --prefill-tp 4: refused, naming both."""
    assert_refused(
        run("demo", "--kv-heads", "6", "--prefill-tp", "4"),
        "--kv-heads 6",
        "--prefill-tp 4",
        "total_kv_heads=6 and prefill_tp=4",
    )


def test_more_requests_than_decode_registers_at_once_are_refused() -> None:
    """demo --requests 2000: every room is registered before the first is sent, and a decode
    rank holds 1024 per prefill instance; the variable raises the bound, and a prefill-only
    side leaves it to the decode side (both are then refused for memory instead)."""
    assert_refused(
        run("demo", "--requests", "2000"),
        "--requests 2000",
        "at most 1024",
        "STAGING_CONTRACTS_MAX_ROOMS_PER_PEER",
    )
    raised = run(
        "demo",
        "--requests",
        "2000",
        "--tokens",
        "100000000",
        env={"STAGING_CONTRACTS_MAX_ROOMS_PER_PEER": "4096"},
    )
    assert "GiB" in assert_refused(raised, "--requests 2000")  # refused by memory, not rooms
    prefill_side = run("demo", "--requests", "2000", "--ranks", "prefill", "--tokens", "100000000")
    assert "GiB" in assert_refused(prefill_side, "--requests 2000")  # decode's bound is not ours


def test_a_run_larger_than_memory_is_refused_with_the_figures() -> None:
    """demo --tokens 100000000 --requests 1: how much is needed and how much there is."""
    line = assert_refused(
        run("demo", "--tokens", "100000000", "--requests", "1"),
        "--tokens 100000000",
        "--requests 1",
        "GiB",
        "--ignore-memory",
    )
    assert "is available" in line


def test_an_unknown_bench_group_lists_the_groups_without_a_stray_list() -> None:
    """bench nope: one line naming the groups; no '[]' among them."""
    line = assert_refused(run("bench", "nope"), "'nope'", "contract", "transfer")
    assert "[]" not in line


def test_an_argument_error_is_one_line_too() -> None:
    """argparse's own errors (an invalid choice) are one line with a pointer to --help."""
    assert_refused(run("demo", "--dtype", "nope"), "--dtype", "--help")


BAD_BACKENDS = {
    "bad_spec_contract.py": (
        "from staging_contracts import StagingManagerMixin\n"
        "from staging_contracts.backends._common import CommonKVManager\n\n\n"
        "class NoCtxKVManager(StagingManagerMixin, CommonKVManager):\n"
        "    _staging_handler: object = None\n"
    ),
    "good_spec.py": (
        "from staging_contracts.backends.local import LocalKVManager\n\n\n"
        "class GoodKVManager(LocalKVManager):\n"
        "    pass\n\n\n"
        "NOT_A_FACTORY = 3\n"
    ),
}
"""Modules the refusals below name: one whose class fails the contract at its class
statement, one with a good class and an attribute that is not callable."""


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("nope", "unknown backend 'nope'; known: ascend, local, mooncake"),
        ("no_such_module_x:Cls", "cannot import 'no_such_module_x'"),
        ("good_spec:Missing", "module 'good_spec' has no attribute 'Missing'"),
        ("bad_spec_contract:NoCtxKVManager", "NoCtxKVManager does not satisfy the StagingHost"),
        ("good_spec:GoodKVManager=good_spec:NOT_A_FACTORY", "is an int, not callable"),
        ("local", "moves bytes within one process only"),
        ("mori", "MoriKVManager is not a staging backend"),
    ],
)
def test_a_backend_spec_that_cannot_run_is_refused_in_one_line(
    tmp_path: Path, spec: str, why: str
) -> None:
    """demo --backend SPEC: an unknown name, an unimportable module, a missing class, a class
    that fails its contract, a factory that is not callable, an in-process engine and a
    backend without staging are each one line, exit 2, before any process starts."""
    for name, text in BAD_BACKENDS.items():
        (tmp_path / name).write_text(text)
    line = assert_refused(
        run("demo", "--backend", spec, env={"PYTHONPATH": str(tmp_path)}), f"--backend {spec}:"
    )
    assert why in line, line


@pytest.mark.parametrize("command", ["soak", "bench"])
def test_soak_and_bench_refuse_a_bad_backend_spec_in_one_line(command: str) -> None:
    """soak --backend and bench transfer --backend go through the same check."""
    extra = ["transfer"] if command == "bench" else []
    line = assert_refused(
        run(command, *extra, "--backend", "no_such_module_x:Cls"), "--backend no_such_module_x:Cls"
    )
    assert line.startswith(f"staging-contracts {command}: "), line
    assert "cannot import 'no_such_module_x'" in line


@pytest.mark.parametrize("command", ["check", "demo", "soak", "bench"])
def test_every_subcommand_help_ends_with_examples(command: str) -> None:
    """--help ends with two or three example invocations."""
    ran = run(command, "--help")
    assert ran.status == 0
    tail = ran.out.rstrip().splitlines()[-4:]
    examples = [line for line in tail if line.strip().startswith("staging-contracts ")]
    assert len(examples) >= 2, ran.out


def test_memory_need_counts_every_rank() -> None:
    """The estimate grows with the ranks' pools and is refused against a small machine."""
    small = tiny_config()
    need = memory_need(small)
    assert need.processes == 2
    assert need.total > 2 * need.prefill_rank
    preflight(small, available=need.total)
    with pytest.raises(ValueError, match=r"the 2 rank processes need"):
        preflight(small, available=need.total - 1)
    preflight(small, available=1, ignore_memory=True)


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_a_rank_failing_mid_run_is_named_first_and_the_others_stop() -> None:
    """A rank dies mid-run: the others stop within seconds and the summary's first line
    names that rank and why, before the table."""
    killed: list[float] = []

    def kill_decode(got: RankEvent) -> None:
        if isinstance(got.message, Ready) and got.role == "decode" and not killed:
            os.kill(got.pid, 9)
            killed.append(time.monotonic())

    result = run_cluster(tiny_config(), progress=kill_decode, timeout_s=60)
    assert time.monotonic() - killed[0] < 10.0
    first = format_summary(result).splitlines()[0]
    assert first == "first failure: decode rank 0 killed by SIGKILL without a report"


@pytest.mark.parametrize("command", ["demo", "soak", "bench"])
def test_an_outside_backend_over_an_in_process_engine_is_refused(
    tmp_path: Path, command: str
) -> None:
    """demo, soak and bench transfer refuse a class of an outside package whose engine is a
    LocalEngine, as the harness does with processes=True: one line, exit 2, no rank started."""
    (tmp_path / "local_backed.py").write_text(
        "from staging_contracts.backends.local import LocalKVManager\n\n\n"
        "class LocalBacked(LocalKVManager):\n"
        "    pass\n"
    )
    extra = ["transfer"] if command == "bench" else []
    spec = "local_backed:LocalBacked"
    line = assert_refused(
        run(command, *extra, "--backend", spec, env={"PYTHONPATH": str(tmp_path)}),
        f"--backend {spec}:",
    )
    assert "moves bytes within one process only" in line, line


@pytest.mark.mooncake
def test_mooncake_on_cuda_is_refused_where_its_build_has_no_cuda() -> None:
    """demo --backend mooncake --device cuda with the host-only Mooncake wheel: one line
    naming both options and the wheel, before any CUDA check or process start."""
    if not engine_available("mooncake")[0]:
        pytest.skip(engine_available("mooncake")[1])
    from staging_contracts.engines.mooncake import host_memory_only

    reason = host_memory_only()
    if reason is None:
        pytest.skip("this Mooncake build may move CUDA memory")
    line = assert_refused(
        run("demo", "--backend", "mooncake", "--device", "cuda"),
        "--backend mooncake --device cuda",
        reason,
    )
    assert line.endswith("use --device cpu, or --backend nixl"), line


def test_memory_need_counts_the_mode_and_the_device() -> None:
    """Raw mode counts each prefill rank's source and the concatenation that builds it, and
    each decode rank's raw buffer; per-token has no ring and no staging buffer; on CUDA the
    pools, rings and buffers are on the one GPU, and only the host temporaries stay."""
    config = TransferConfig(
        prefill_tp=2,
        decode_tp=1,
        kv_heads=2,
        layers=2,
        head_dim=16,
        tokens=64,
        page_size=16,
        requests=2,
        chunk_tokens=32,
        ring_chunks=2,
    )
    element = config.element_size
    pool_tokens = (2 * 4 + 1) * 16
    prefill_pool = pool_tokens * 1 * 16 * element * 2 * 2
    decode_pool = pool_tokens * 2 * 16 * element * 2 * 2
    staged = memory_need(config)
    assert staged.prefill_rank == prefill_pool + 32 * 16 * element * 2 * 2
    assert staged.decode_rank > decode_pool
    per_token = memory_need(replace(config, mode="per-token"))
    assert (per_token.prefill_rank, per_token.decode_rank) == (prefill_pool, decode_pool)
    share = 64 * 16 * element * 2 * 2  # one head of one request for the decode rank
    raw = memory_need(replace(config, mode="raw"))
    assert raw.prefill_rank == 2 * (2 * share)  # the source of 2 requests, and the cat
    assert raw.decode_rank == 2 * (2 * share) + share  # 2 requests from 2 writers; a check
    assert raw.device_total == 0
    overhead = raw.processes * PROCESS_OVERHEAD_BYTES
    assert raw.total == 2 * raw.prefill_rank + raw.decode_rank + overhead
    on_gpu = memory_need(replace(config, device="cuda"))
    assert (on_gpu.prefill_rank, on_gpu.decode_rank) == (0, 0)
    assert on_gpu.total == overhead
    assert on_gpu.device_total == 2 * staged.prefill_rank + staged.decode_rank
    raw_gpu = memory_need(replace(config, mode="raw", device="cuda"))
    assert (raw_gpu.prefill_rank, raw_gpu.decode_rank) == (4 * share, share)
    assert (raw_gpu.device_prefill_rank, raw_gpu.device_decode_rank) == (2 * share, 5 * share)


def test_a_run_larger_than_the_gpu_is_refused() -> None:
    """On CUDA the GPU's free memory is compared with what every rank puts on it; the host
    check then counts only what stays on the host."""
    config = replace(tiny_config(), device="cuda")
    need = memory_need(config)
    preflight(config, available=need.total, device_available=need.device_total)
    with pytest.raises(ValueError, match=r"--device cuda: the 2 rank processes need .* GPU"):
        preflight(config, available=need.total, device_available=need.device_total - 1)
    raw = replace(config, mode="raw")
    with pytest.raises(ValueError, match=r"rank processes \(raw mode\) need"):
        preflight(raw, available=memory_need(raw).total - 1, device_available=1 << 40)
