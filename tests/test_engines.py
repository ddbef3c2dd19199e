"""The engine registry, and real bytes between two processes over Mooncake and NIXL."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import pytest

from staging_contracts.engines import ENGINES, engine_available, load_engine_class
from staging_contracts.engines.local import LocalEngine
from tests import engine_peers

MOONCAKE_OK, MOONCAKE_WHY = engine_available("mooncake")
NIXL_OK, NIXL_WHY = engine_available("nixl")
PAIR_TIMEOUT_S = 40.0

needs_mooncake = pytest.mark.skipif(not MOONCAKE_OK, reason=MOONCAKE_WHY)
needs_nixl = pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)

# NIXL's UCX loads its InfiniBand modules by default; with the system's ibverbs providers
# installed next to NIXL's bundled libibverbs, such a process crashes at exit (see nixl.py).
NIXL_OPTIONS: Mapping[str, Any] = {"load_ib_modules": False, "write_timeout_s": 20.0}
MOONCAKE_OPTIONS: Mapping[str, Any] = {"host": "127.0.0.1", "protocol": "tcp"}


# --------------------------------------------------------------------------- registry


def test_registry_names_every_engine() -> None:
    """The registry maps each engine name to its module and class."""
    assert sorted(ENGINES) == ["local", "mooncake", "nixl"]
    assert ENGINES["mooncake"].install_hint == "pip install 'staging-contracts[mooncake]'"
    assert ENGINES["local"].install_hint == ""


def test_load_engine_class_returns_the_local_engine() -> None:
    """Loading 'local' returns LocalEngine, which needs no extra."""
    assert load_engine_class("local") is LocalEngine
    assert engine_available("local") == (True, "")


def test_unknown_engine_lists_the_known_names() -> None:
    """An unknown name raises ValueError listing the known engines."""
    with pytest.raises(
        ValueError,
        match=r"^unknown transfer engine 'ucx'; known engines: 'local', 'mooncake', 'nixl'$",
    ):
        load_engine_class("ucx")
    with pytest.raises(ValueError, match=r"^unknown transfer engine"):
        engine_available("ucx")


@pytest.mark.parametrize(("name", "sdk"), [("mooncake", "mooncake.engine"), ("nixl", "nixl_cu12")])
def test_missing_sdk_names_the_engine_and_extra(
    monkeypatch: pytest.MonkeyPatch, name: str, sdk: str
) -> None:
    """A missing SDK raises ImportError naming the engine and the pip extra."""
    monkeypatch.setitem(sys.modules, sdk, None)
    monkeypatch.setitem(sys.modules, "nixl", None)
    monkeypatch.delitem(sys.modules, f"staging_contracts.engines.{name}", raising=False)
    pattern = (
        rf"^transfer engine '{name}' is not available \(.*\);"
        rf" install it with pip install 'staging-contracts\[{name}\]'$"
    )
    with pytest.raises(ImportError, match=pattern) as info:
        load_engine_class(name)
    assert info.value.name == f"staging_contracts.engines.{name}"
    assert isinstance(info.value.__cause__, ImportError)
    available, reason = engine_available(name)
    assert not available
    assert f"staging-contracts[{name}]" in reason


def test_importing_the_package_loads_no_sdk() -> None:
    """Importing staging_contracts.engines imports neither Mooncake nor NIXL."""
    code = (
        "import sys, staging_contracts.engines as e; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mooncake', 'nixl_cu12', 'nixl')]; "
        "sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=60, check=False)
    assert done.returncode == 0


# --------------------------------------------------------------------------- two processes


@dataclass(frozen=True, slots=True)
class PairResult:
    """What the two child processes reported."""

    receiver: Any
    writer: Any


class Children:
    """Spawned child processes of one test, each reporting ``(status, value)`` on a pipe."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.started: list[BaseProcess] = []

    def run(self, targets: list[tuple[str, Callable[..., None], tuple[Any, ...]]]) -> list[Any]:
        """Start every target with a report pipe appended to its args; collect the reports."""
        reports: list[Connection] = []
        for name, target, args in targets:
            report, sink = self.context.Pipe(duplex=False)
            process = self.context.Process(target=target, args=(*args, sink), name=name)
            process.start()
            self.started.append(process)
            reports.append(report)
        values: list[tuple[str, Any]] = []
        for (name, _, _), report in zip(targets, reports, strict=True):
            if not report.poll(PAIR_TIMEOUT_S + 20):
                pytest.fail(f"no report from child {name!r} in time")
            values.append(report.recv())
        for started in self.started:
            started.join(30)
        problems = [value for status, value in values if status != "ok"]
        assert not problems, "\n".join(problems)
        assert [started.exitcode for started in self.started] == [0] * len(self.started)
        return [value for _, value in values]

    def kill_leftovers(self) -> None:
        """Kill any child still alive (after a failure)."""
        for process in self.started:
            if process.is_alive():
                process.kill()
                process.join(10)


@pytest.fixture
def children() -> Iterator[Children]:
    """Child processes that are killed if the test leaves any behind."""
    spawned = Children()
    yield spawned
    spawned.kill_leftovers()


def run_pair(
    children: Children,
    engine: str,
    options: Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    bad_first: bool = False,
    stall_s: float = 0.0,
) -> PairResult:
    """Run a receiver and a writer process of ``engine``; both must exit 0."""
    job = engine_peers.PeerJob(
        engine, dict(options), dict(env or {}), PAIR_TIMEOUT_S, bad_first, stall_s
    )
    receiver_end, writer_end = children.context.Pipe()
    receiver, writer = children.run(
        [
            (f"{engine}-receiver", engine_peers.receiver_main, (job, receiver_end)),
            (f"{engine}-writer", engine_peers.writer_main, (job, writer_end)),
        ]
    )
    return PairResult(receiver, writer)


def run_threaded(children: Children, engine: str, options: Mapping[str, Any]) -> Any:
    """Run the threaded scenario of ``engine`` in one child process."""
    job = engine_peers.PeerJob(engine, dict(options), {}, PAIR_TIMEOUT_S)
    return children.run([(f"{engine}-threads", engine_peers.threaded_main, (job,))])[0]


@pytest.mark.mooncake
@needs_mooncake
def test_mooncake_moves_bytes_between_processes(children: Children) -> None:
    """A Mooncake TCP bulk write lands every byte of several transfers in the peer process."""
    result = run_pair(children, "mooncake", MOONCAKE_OPTIONS)
    assert result.receiver == 0
    assert result.writer["rejected"] == []


@pytest.mark.mooncake
@needs_mooncake
def test_mooncake_rejects_writes_outside_peer_memory(children: Children) -> None:
    """Mooncake raises TransferError for unregistered remote ranges and then writes again."""
    result = run_pair(children, "mooncake", MOONCAKE_OPTIONS, bad_first=True)
    rejected = result.writer["rejected"]
    assert len(rejected) == 2
    assert all(text.startswith("mooncake engine '127.0.0.1:") for text in rejected)
    assert all("failed to write 1 transfers (100 bytes)" in text for text in rejected)


@pytest.mark.nixl
@needs_nixl
@pytest.mark.parametrize("env", [{}, {"UCX_TLS": "tcp"}], ids=["default", "ucx-tcp"])
def test_nixl_moves_bytes_then_notifies(children: Children, env: Mapping[str, str]) -> None:
    """A NIXL bulk write lands every byte in the peer, and the notification follows the data."""
    result = run_pair(children, "nixl", NIXL_OPTIONS, env=env)
    assert result.receiver == 1
    assert result.writer["rejected"] == []


@pytest.mark.nixl
@needs_nixl
def test_nixl_rejects_writes_outside_peer_memory(children: Children) -> None:
    """NIXL raises TransferError for unregistered remote ranges and then writes again."""
    result = run_pair(children, "nixl", NIXL_OPTIONS, bad_first=True)
    rejected = result.writer["rejected"]
    assert len(rejected) == 2
    assert all(text.startswith("NIXL engine 'nixl-") for text in rejected)
    assert all("NIXL_ERR_NOT_FOUND" in text for text in rejected)


@pytest.mark.mooncake
@needs_mooncake
def test_mooncake_writes_from_two_threads(children: Children) -> None:
    """Two threads write through one Mooncake engine at once and every byte lands."""
    assert run_threaded(children, "mooncake", MOONCAKE_OPTIONS) == 0


@pytest.mark.nixl
@needs_nixl
def test_nixl_writes_from_two_threads_while_a_third_polls(children: Children) -> None:
    """Two threads write through one NIXL engine while another polls; notes keep their order."""
    assert run_threaded(children, "nixl", NIXL_OPTIONS) == 102


NO_LEAK = {"never_freed": 0, "checked_after_free": 0}
"""What a :class:`engine_peers.BatchLedger` must show once the engine is closed."""


def run_stopped(children: Children, writer: Callable[..., None], job: engine_peers.PeerJob) -> Any:
    """A receiver that the writer stops and resumes, and ``writer``; the writer's report."""
    receiver_end, writer_end = children.context.Pipe()
    return children.run(
        [
            ("mooncake-stopped", engine_peers.stopped_receiver_main, (job, receiver_end)),
            ("mooncake-writer", writer, (job, writer_end)),
        ]
    )[1]


@pytest.mark.mooncake
@needs_mooncake
def test_mooncake_write_to_a_stopped_peer_times_out_and_holds_its_source(
    children: Children,
) -> None:
    """A write to a stopped process times out; its source range is refused until that
    write ends; once the peer resumes, the same write lands in full, and every batch id
    Mooncake allocated was freed exactly once."""
    job = engine_peers.PeerJob(
        "mooncake", {**MOONCAKE_OPTIONS, "write_timeout_s": 0.3}, {}, PAIR_TIMEOUT_S, ledger=True
    )
    report = run_stopped(children, engine_peers.stopped_writer_main, job)
    timed_out, refused = report["errors"]
    assert timed_out.startswith("mooncake write of 67108864 bytes to '127.0.0.1:")
    assert "timed out after 0.4 s; its source range stays in use" in timed_out
    assert refused.endswith("is still read by a write that timed out")
    assert report["held"] == 1  # unfinished_writes while the peer was stopped
    ledger: dict[str, int] = report["ledger"]
    assert ledger.items() >= NO_LEAK.items(), ledger
    assert ledger["submitted"] == ledger["freed"] >= 3


@pytest.mark.mooncake
@needs_mooncake
def test_mooncake_batch_reported_timed_out_holds_its_source_and_is_freed_when_it_ends(
    children: Children,
) -> None:
    """A batch Mooncake reports timed out (-2, which does not free it) still reads its
    source: the same range is refused until it ends, and its id is freed once it does.

    The -2 comes from the fake in BatchLedger (Mooncake's RDMA slice timeout; its TCP
    transport never reports one); everything else is the real engine between two processes.
    """
    job = engine_peers.PeerJob(
        "mooncake",
        {**MOONCAKE_OPTIONS, "write_timeout_s": 20.0},
        {},
        PAIR_TIMEOUT_S,
        slice_timeout_s=0.3,
        ledger=True,
    )
    report = run_stopped(children, engine_peers.stopped_writer_main, job)
    timed_out, refused = report["errors"]
    assert "status -2 (Mooncake's transfer timeout; the source stays in use" in timed_out
    assert refused.endswith("is still read by a write that timed out")
    assert report["held"] == 1  # unfinished_writes while the peer was stopped
    ledger: dict[str, int] = report["ledger"]
    assert ledger.items() >= NO_LEAK.items(), ledger
    assert ledger["timeouts_reported"] >= 1
    assert ledger["submitted"] == ledger["freed"] >= 3


@pytest.mark.mooncake
@needs_mooncake
def test_mooncake_multi_range_write_times_out_and_close_frees_it_once_it_ends(
    children: Children,
) -> None:
    """A write of several ranges to a stopped process gives up after ``write_timeout_s``
    (not Mooncake's own 5 s or more), and ``close`` waits for it to end, then frees its ids."""
    job = engine_peers.PeerJob(
        "mooncake",
        {**MOONCAKE_OPTIONS, "write_timeout_s": 0.3, "close_timeout_s": 20.0},
        {"MC_TRANSFER_TIMEOUT": "5"},
        PAIR_TIMEOUT_S,
    )
    report = run_stopped(children, engine_peers.closing_writer_main, job)
    assert report["error"].startswith("mooncake write of 67108864 bytes to '127.0.0.1:")
    assert "its 2 source ranges stay in use" in report["error"]
    assert report["write_s"] < 2.5
    assert 0.2 < report["close_s"] < 10.0  # it waited for the receiver to resume
    ledger: dict[str, int] = report["ledger"]
    assert ledger.items() >= NO_LEAK.items(), ledger
    assert ledger["submitted"] == ledger["freed"] == 3
    assert ledger["sync_calls"] == 0


@pytest.mark.nixl
@needs_nixl
def test_nixl_poll_that_fails_loses_no_notification(children: Children) -> None:
    """A NIXL poll that fails (a fake failure in the real agent) returns the notification
    fetched before it, logs the failure with its cause, and the next poll returns the one
    the agent still held: each arrives once, in order."""
    job = engine_peers.PeerJob("nixl", dict(NIXL_OPTIONS), {}, PAIR_TIMEOUT_S)
    [report] = children.run([("nixl-failing-poll", engine_peers.failing_poll_main, (job,))])
    assert report["payloads"] == [b"first", b"second"]
    assert report["raised"] == []
    [warning] = [line for line in report["logs"] if line.startswith("WARNING")]
    assert "failed to fetch notifications (failure 1 in a row; 1 fetched earlier are kept)" in (
        warning
    )
    assert "RuntimeError: injected: the agent failed to poll" in warning  # the traceback
    assert any("fetches notifications again after 1 failures" in line for line in report["logs"])


@pytest.mark.nixl
@needs_nixl
def test_nixl_write_times_out_while_the_receiver_drives_no_progress(children: Children) -> None:
    """Over UCX TCP a write to a receiver that does not poll times out, then the next lands."""
    options = {**NIXL_OPTIONS, "write_timeout_s": 0.5}
    result = run_pair(children, "nixl", options, env={"UCX_TLS": "tcp"}, stall_s=2.0)
    assert result.receiver == 1
    [timed_out] = result.writer["rejected"]
    assert timed_out.startswith("NIXL write to 'nixl-")
    assert "timed out after 0.5 s (does the peer poll its notifications?)" in timed_out
