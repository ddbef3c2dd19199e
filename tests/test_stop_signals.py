"""SIGTERM (or SIGINT) to ``demo``, ``soak`` and ``bench`` mid-run: every rank stops within
5 s, and what was measured so far is printed, marked partial."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from staging_contracts._run import Interrupted, Supervisor, stop_on_signals
from staging_contracts._run._signals import STOP_SIGNALS

REPO = Path(__file__).resolve().parents[1]
STOP_BOUND_S = 5.0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(word) for word in task.read_text().split()]
        except OSError:  # the task ended meanwhile
            continue
    return out


def _rank_pids(pid: int) -> list[int]:
    """The spawned rank processes under ``pid`` (not multiprocessing's resource tracker)."""
    pids = []
    for child in _children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            pids.append(child)
    return pids


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has stopped; init reaps it


def _interrupt_mid_run(
    args: list[str], ranks: int, signum: int, settle_s: float = 4.0, after: str | None = None
) -> tuple[str, int, list[int]]:
    """Start the command, wait for its ``ranks`` rank processes and then ``settle_s`` more
    (or, with ``after``, for a line of output that holds it), signal it; its output, exit
    status and the rank pids still alive."""
    process = subprocess.Popen(
        [sys.executable, "-m", "staging_contracts.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        pids: list[int] = []
        while len(pids) < ranks and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
            pids = _rank_pids(process.pid)
        assert len(pids) == ranks, f"ranks not up: {pids}, exit status {process.poll()}"
        if after is None:
            time.sleep(settle_s)  # the ranks started their work
        while after is not None and not any(after in line for line in list(lines)):
            alive = process.poll() is None and time.monotonic() < deadline
            assert alive, f"no {after!r} in\n{''.join(lines)}"
            time.sleep(0.02)
        assert process.poll() is None, "the run ended before the signal"
        process.send_signal(signum)
        sent = time.monotonic()
        process.wait(timeout=30)
        took = time.monotonic() - sent
        reader.join(timeout=5)
        out = "".join(lines)
        assert took < STOP_BOUND_S, f"exited {took:.1f} s after the signal\n{out}"
        until = time.monotonic() + 1.0  # reparented ranks are reaped by init, not by us
        while any(_alive(pid) for pid in pids) and time.monotonic() < until:
            time.sleep(0.05)
        return out, process.returncode, [pid for pid in pids if _alive(pid)]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.join(timeout=5)
        if process.stdout is not None:
            process.stdout.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_demo_stops_every_rank_and_prints_a_partial_summary(
    signum: int, tmp_path: Path
) -> None:
    summary = tmp_path / "demo.json"
    args = ["demo", "--layers", "2", "--head-dim", "32", "--tokens", "512", "--json", str(summary)]
    args += [
        "--prefill-tp",
        "2",
        "--decode-tp",
        "2",
        "--requests",
        "64",
        "--chunk-tokens",
        "256",
        "--timeout",
        "600",
    ]
    # Once a few rooms are done on the decode ranks, with most of the 64 still to go.
    out, status, left = _interrupt_mid_run(args, ranks=4, signum=signum, after="] 8/128 rooms done")
    assert status == 128 + signum, out
    assert not left, f"rank processes left running: {left}"
    assert f"PARTIAL: interrupted by {signal.Signals(signum).name}" in out
    assert "verification" in out  # the summary table, with what was measured
    assert "Traceback" not in out
    doc = json.loads(summary.read_text())  # and its JSON, marked partial too
    assert (doc["partial"], doc["interrupted"]) == (True, signal.Signals(signum).name)
    assert doc["verdict"] == "FAIL"
    assert doc["rooms"]["succeeded"] >= 1, doc["rooms"]
    assert doc["bytes"] > 0  # what the prefill ranks wrote until they were stopped
    assert "no report" not in out  # every rank reported within the grace


def test_sigterm_to_soak_stops_every_rank_and_prints_a_partial_summary(tmp_path: Path) -> None:
    summary = tmp_path / "soak.json"
    args = ["soak", "--duration", "300", "--faults", "stall", "--json", str(summary)]
    out, status, left = _interrupt_mid_run(args, ranks=3, signum=signal.SIGTERM)
    assert status == 143, out
    assert not left, f"rank processes left running: {left}"
    assert "PARTIAL" in out
    assert "interrupted by SIGTERM" in out
    assert "rooms" in out  # the summary, with the rooms counted so far
    doc = json.loads(summary.read_text())
    assert (doc["partial"], doc["interrupted"], doc["verdict"]) == (True, "SIGTERM", "FAIL")
    assert doc["rooms"]["started"] >= doc["rooms"]["succeeded"]


def test_sigterm_to_bench_stops_every_rank_and_prints_the_rows_measured(tmp_path: Path) -> None:
    """The contract group ended before the signal: its rows are printed (and written); the
    transfer group's ranks are killed, none of its rows is made up."""
    rows = tmp_path / "rows.json"
    args = ["bench", "contract", "transfer", "--quick", "--backend", "nixl", "--json", str(rows)]
    out, status, left = _interrupt_mid_run(args, ranks=6, signum=signal.SIGTERM, settle_s=1.0)
    assert status == 143, out
    assert not left, f"rank processes left running: {left}"
    assert "PARTIAL: interrupted by SIGTERM" in out
    names = [row["name"] for row in json.loads(rows.read_text())]
    assert names, out
    assert all(name.startswith("contract.") for name in names), names
    assert all(name in out for name in names)
    assert "transfer.nixl" not in out


def test_sigint_to_bench_scaling_writes_a_partial_sweep(tmp_path: Path) -> None:
    args = ["bench", "scaling", "--quick", "--backend", "nixl", "--out", str(tmp_path)]
    out, status, left = _interrupt_mid_run(args, ranks=3, signum=signal.SIGINT, settle_s=0.5)
    assert status == 130, out
    assert not left, f"rank processes left running: {left}"
    assert "PARTIAL: interrupted by SIGINT" in out
    doc = json.loads((tmp_path / "scaling.json").read_text())
    assert (doc["partial"], doc["interrupted"]) == (True, "SIGINT")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_before_the_run_ends_the_command_with_one_partial_line(
    signum: int, tmp_path: Path
) -> None:
    """A signal while the command still loads what it runs (here a class whose module takes
    its time to import) ends it with one ``PARTIAL`` line and ``128 + N``: no traceback, no
    silent death by the signal."""
    loading = tmp_path / "loading"
    (tmp_path / "slow_target.py").write_text(
        "import pathlib, time\n"
        f"pathlib.Path({str(loading)!r}).touch()\n"
        "time.sleep(30)\n"
        "class Host: ...\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "staging_contracts.cli", "check", "slow_target:Host"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO / 'src'}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not loading.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert loading.exists(), process.communicate()[0]
        process.send_signal(signum)
        out, _ = process.communicate(timeout=STOP_BOUND_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    name = signal.Signals(signum).name
    assert process.returncode == 128 + signum, out
    assert out == f"PARTIAL: interrupted by {name} before check had anything to report\n"


def test_once_a_run_took_a_signal_later_ones_are_ignored_until_the_command_ends() -> None:
    """Blocks nest as the command line nests them (one around the command, one around the
    run): the run's block takes the first signal; a second one, after the run while the
    summary is written, neither raises nor kills; nor does a first one that comes after a
    run that ended by itself; the handlers come back at the end."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    with stop_on_signals(raise_on_signal=True) as command:
        with stop_on_signals(raise_on_signal=False) as run:
            os.kill(os.getpid(), signal.SIGTERM)
            _until(lambda: run.signum is not None)
        os.kill(os.getpid(), signal.SIGINT)  # the summary is being written: ignored
        time.sleep(0.1)
        assert (run.name, command.name) == ("SIGTERM", None)
    assert {signum: signal.getsignal(signum) for signum in STOP_SIGNALS} == before
    with stop_on_signals(raise_on_signal=True) as command:
        with stop_on_signals(raise_on_signal=True):
            pass  # the run ended by itself
        os.kill(os.getpid(), signal.SIGTERM)  # its output is being written: ignored too
        time.sleep(0.1)
        assert command.name is None
    with stop_on_signals(raise_on_signal=True), pytest.raises(Interrupted):
        _signal_myself()  # a new command: its first signal counts again


def _signal_myself() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    _until(lambda: False)  # the handler raises first


def _until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _sigint_disposition(path: str) -> None:
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    Path(path).write_text(f"{signal.getsignal(signal.SIGINT)!r} blocked={blocked}")


def test_rank_processes_ignore_sigint_from_their_start(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches every process of its group: ranks ignore it from their
    first instruction (their driver stops them), and the driver keeps its own handler."""
    mine, mask = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    seen = tmp_path / "sigint.txt"
    supervisor: Supervisor[str] = Supervisor()
    try:
        process = supervisor.start("rank", _sigint_disposition, (str(seen),), name="rank")
        process.join(timeout=60)
    finally:
        supervisor.close(grace_s=1.0)
    assert seen.read_text() == f"{signal.SIG_IGN!r} blocked=False"
    assert signal.getsignal(signal.SIGINT) == mine
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
