"""SIGTERM (or SIGINT) to ``demo``, ``soak`` and ``bench`` mid-run: every rank stops within
5 s, and what was measured so far is printed, marked partial."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
    args: list[str], ranks: int, signum: int, settle_s: float = 4.0
) -> tuple[str, int, list[int]]:
    """Start the command, wait for its ``ranks`` rank processes and ``settle_s`` more, signal
    it; its output, exit status and the rank pids still alive."""
    process = subprocess.Popen(
        [sys.executable, "-m", "staging_contracts.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        pids: list[int] = []
        while len(pids) < ranks and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
            pids = _rank_pids(process.pid)
        assert len(pids) == ranks, f"ranks not up: {pids}, exit status {process.poll()}"
        time.sleep(settle_s)  # the ranks started their work
        assert process.poll() is None, "the run ended before the signal"
        process.send_signal(signum)
        sent = time.monotonic()
        out, _ = process.communicate(timeout=30)
        took = time.monotonic() - sent
        assert took < STOP_BOUND_S, f"exited {took:.1f} s after the signal\n{out}"
        until = time.monotonic() + 1.0  # reparented ranks are reaped by init, not by us
        while any(_alive(pid) for pid in pids) and time.monotonic() < until:
            time.sleep(0.05)
        return out, process.returncode, [pid for pid in pids if _alive(pid)]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


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
        "2000",
        "--chunk-tokens",
        "256",
        "--timeout",
        "600",
    ]
    out, status, left = _interrupt_mid_run(args, ranks=4, signum=signum)
    assert status == 128 + signum, out
    assert not left, f"rank processes left running: {left}"
    assert f"PARTIAL: interrupted by {signal.Signals(signum).name}" in out
    assert "verification" in out  # the summary table, with what was measured
    doc = json.loads(summary.read_text())  # and its JSON, marked partial too
    assert (doc["partial"], doc["interrupted"]) == (True, signal.Signals(signum).name)
    assert doc["verdict"] == "FAIL"


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
