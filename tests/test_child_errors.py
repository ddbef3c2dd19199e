"""A rank process that dies with an exception: its traceback reaches the parent's error.

Real spawned processes throughout: the harness's rank group (what ``run_transfer(...,
processes=True)`` runs its ranks in), a script that calls ``run_transfer`` without a main
guard, and the demo's runner with a backend whose rank dies past its own report.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Final

import pytest

from staging_contracts._cluster.runner import run_cluster
from staging_contracts._run import LIMIT_CHARS, Supervisor
from staging_contracts._run.workload import TransferConfig
from staging_contracts.backends.nixl import NixlKVManager
from staging_contracts.engines import engine_available
from staging_contracts.testing._processes import Failure, ParentLink, RankFailed, RankGroup
from staging_contracts.testing._rank_steps import Arm, Joined, Wire, Wired

REPO: Final = Path(__file__).resolve().parent.parent
NIXL_OK, NIXL_WHY = engine_available("nixl")


def _raises(job: object, conn: Connection) -> None:
    """A rank entry point that raises before it says anything."""
    del conn
    raise ValueError(f"rank job {job!r} cannot start: no pool")


def _exits(job: object, conn: Connection) -> None:
    """A rank entry point that ends its process with no exception (as a crash would)."""
    del job, conn
    os._exit(3)


def _answers_out_of_step(job: object, conn: Connection) -> None:
    """A rank entry point that does what ``job`` says: send a :class:`Wired` where the parent
    waits for :class:`Joined`, send bytes that do not decode, or wait for an ``Arm`` and be
    told to wire (its :class:`Failure` carries the error)."""
    link = ParentLink(conn, 30.0)
    if job == "wired":
        link.send(Wired())
    elif job == "garbage":
        conn.send_bytes(b"{not json")
    else:
        try:
            link.expect(Arm)
        except RuntimeError as exc:
            link.send(Failure(str(exc)))
    link.expect(Arm)  # until the parent closes the pipe


def _raises_long(length: int) -> None:
    raise RuntimeError("x" * length)


class _Unprintable(Exception):
    """An exception whose text cannot be made: the rank's own failure report raises too."""

    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


class BrokenNixl(NixlKVManager):
    """A NIXL backend whose managers cannot be built, with an error that breaks the report."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise _Unprintable


def test_a_rank_that_raises_gives_its_traceback_to_the_gather() -> None:
    """The rank group's error holds the rank's own exception and traceback, not "without a
    word"."""
    group = RankGroup(_raises, ["job-7"], ["decode rank 0"])
    try:
        with pytest.raises(RankFailed) as failed:
            group.gather([0], Joined, 60.0)
    finally:
        group.close()
    detail = failed.value.detail
    assert "exited with code 1, raising:" in detail
    assert "Traceback (most recent call last):" in detail
    assert "ValueError: rank job 'job-7' cannot start: no pool" in detail
    assert "without a word" not in detail


def test_a_rank_that_exits_without_an_exception_is_said_to() -> None:
    """No exception, no traceback: the error says so, with the exit code."""
    group = RankGroup(_exits, ["job"], ["prefill rank 1"])
    try:
        with pytest.raises(RankFailed, match="exited with code 3 without a word"):
            group.gather([0], Joined, 60.0)
    finally:
        group.close()


@pytest.mark.parametrize(
    ("job", "sent", "detail"),
    [
        ("wired", "Wired", "Wired()"),
        ("garbage", None, "sent not JSON"),
        ("expects", "Failure", "expected the command Arm, got Wire(ranks=())"),
    ],
)
def test_a_rank_out_of_step_ends_the_gather_with_what_it_sent(
    job: str, sent: str | None, detail: str
) -> None:
    """The pipe is typed both ways: another message than the one awaited, or bytes that do not
    decode, fail the step with what came instead, on either side."""
    group = RankGroup(_answers_out_of_step, [job], ["decode rank 0"])
    try:
        if job == "expects":
            group.send([0], Wire(()))
        with pytest.raises(RankFailed) as failed:
            group.gather([0], Joined, 60.0)
    finally:
        group.close()
    assert (failed.value.kind, failed.value.sent) == ("Joined", sent)
    assert failed.value.detail.startswith(detail), failed.value.detail


def test_the_traceback_kept_is_bounded_to_its_end() -> None:
    """A huge exception text keeps its last characters (where the exception is) only."""
    processes: Supervisor[str] = Supervisor()
    process = processes.start("long", _raises_long, (50 * LIMIT_CHARS,), name="long")
    process.join(60)
    text = processes.explain(process)
    processes.close()
    how, _, kept = text.partition("\n")
    assert how == "exited with code 1, raising:"
    assert kept.startswith("... (the traceback's start is cut)")
    assert len(kept) <= LIMIT_CHARS + 100
    assert kept.endswith("x" * 100)


@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_run_transfer_in_a_script_without_a_main_guard_says_why(tmp_path: Path) -> None:
    """A script calling ``run_transfer(..., processes=True)`` at its top level: each rank dies
    re-importing it, and the error names the missing ``if __name__ == "__main__":``."""
    script = tmp_path / "transfer.py"
    script.write_text(
        textwrap.dedent(
            """\
            from staging_contracts.testing import run_transfer

            run_transfer("nixl", prefill_tp=1, decode_tp=1, processes=True)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("staging_contracts.testing._processes.RankFailed: "), last
    assert "before its entry point ran" in last
    assert 'if __name__ == "__main__":' in last


@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_a_demo_rank_that_dies_past_its_report_gives_its_traceback() -> None:
    """The demo's runner: a rank whose failure cannot even be reported (its exception's text
    raises) dies with that exception; the run's first death carries the traceback."""
    config = TransferConfig(
        backend=f"{__name__}:BrokenNixl",
        prefill_tp=1,
        decode_tp=1,
        layers=1,
        head_dim=8,
        tokens=32,
        requests=1,
        chunk_tokens=16,
    )
    result = run_cluster(config, timeout_s=120.0)
    death = result.first_death
    assert death is not None
    assert death.error is None  # no report came
    reason = death.reason
    assert reason.startswith("ended without a report: it exited with code 1, raising:"), reason
    assert "RuntimeError: this exception cannot be printed" in reason
    assert "_Unprintable" in reason


def test_a_job_that_cannot_be_pickled_raises_its_own_error() -> None:
    """No process starts; the group ends the ones it had and the pickling error goes on."""
    with pytest.raises(TypeError, match="pickle"):
        RankGroup(_raises, ["job", threading.Lock()], ["decode rank 0", "decode rank 1"])
