"""What an operator watches: ``--version``, the ``--json`` summaries, the log lines, and the
soak's progress tally (issue 26)."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from staging_contracts import cli
from staging_contracts._cluster import logformat, summary_json
from staging_contracts._cluster._messages import RankSummary
from staging_contracts._cluster.runner import ClusterResult, RankReport
from staging_contracts._cluster.soak_ticker import Ticker, tally_line
from staging_contracts._cluster.summary_json import COMMON_KEYS, SCHEMA, demo_summary, soak_summary
from staging_contracts._run.workload import TransferConfig
from staging_contracts.engines import engine_available
from tests.test_soak import passing_result

REPO = Path(__file__).resolve().parents[1]
NIXL = engine_available("nixl")
STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00 ")
"""The start of every text log line: its UTC time, ISO 8601 with milliseconds."""
TALLY = re.compile(
    r"^ *(?P<at>[\d.]+) s  progress: (?P<started>\d+) rooms started, (?P<ok>\d+) ok, "
    r"(?P<failed>\d+) failed, (?P<corrupt>\d+) corrupt, (?P<hung>\d+) hung, \d+ in flight$"
)


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without the cluster secret (loopback runs need none)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGING_CONTRACTS_")}
    return {**env, **extra}


def _cli(*args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "staging_contracts.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=_env(**env),
    )


def _common(doc: dict[str, Any], command: str) -> None:
    assert list(doc)[: len(COMMON_KEYS)] == list(COMMON_KEYS)
    assert doc["schema"] == SCHEMA == 1
    assert doc["command"] == command
    assert doc["version"] == metadata.version("staging-contracts")
    assert doc["verdict"] in ("PASS", "FAIL")
    assert (doc["verdict"] == "PASS") == (doc["problems"] == [])
    assert isinstance(doc["partial"], bool)


# --------------------------------------------------------------------------- --version


def test_version_is_the_installed_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"staging-contracts {metadata.version('staging-contracts')}\n"


def test_version_falls_back_when_the_package_is_not_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert summary_json.package_version() == "unknown"


# --------------------------------------------------------------------------- check --json


def test_check_json_gives_each_class_its_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "check.json"
    targets = ["examples.hosts:ExampleKVManager", "examples.hosts:MoriStyleKVManager", "no_mod:X"]
    assert cli.main(["check", *targets, "--json", str(path)]) == 2
    assert f"wrote the verdicts to {path}" in capsys.readouterr().out
    doc = json.loads(path.read_text())
    _common(doc, "check")
    assert doc["verdict"] == "FAIL"
    assert doc["partial"] is False
    assert doc["exit_status"] == 2
    good, bad, missing = doc["classes"]
    assert (good["target"], good["status"], good["exit_status"]) == (targets[0], "conforms", 0)
    assert good["contracts"] == [{"protocol": "StagingHost", "conforms": True, "error": None}]
    assert (bad["status"], bad["exit_status"]) == ("does not conform", 1)
    assert bad["contracts"][0]["conforms"] is False
    assert "_staging_handler" in bad["contracts"][0]["error"]
    assert (missing["status"], missing["contracts"]) == ("not importable", [])
    assert doc["problems"] == [f"{targets[1]}: does not conform", f"{targets[2]}: not importable"]


def test_check_json_of_a_conforming_class_passes(tmp_path: Path) -> None:
    path = tmp_path / "ok.json"
    assert cli.main(["check", "examples.hosts:ExampleKVManager", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert (doc["verdict"], doc["problems"], doc["exit_status"]) == ("PASS", [], 0)


def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "absent" / "x.json"
    assert cli.main(["check", "examples.hosts:ExampleKVManager", "--json", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("staging-contracts check: --json ")
    assert "does not exist or is not writable" in err
    assert not target.parent.exists()


# --------------------------------------------------------------------------- partial runs


def test_a_stopped_soak_says_partial_in_its_json() -> None:
    doc = soak_summary(passing_result(interrupted="SIGTERM"))
    _common(doc, "soak")
    assert (doc["partial"], doc["interrupted"], doc["verdict"]) == (True, "SIGTERM", "FAIL")
    assert doc["problems"][0] == "interrupted by SIGTERM: a partial soak"
    assert doc["rooms"]["by_reason"] == {"peer dead": 15, "stalled": 5}
    assert soak_summary(passing_result())["partial"] is False


def test_a_stopped_demo_says_partial_and_counts_the_rooms_it_had() -> None:
    config = TransferConfig(requests=4, tokens=64, page_size=16, decode_tp=1, prefill_tp=1)
    decode = RankReport(
        "decode",
        0,
        False,
        RankSummary(stopped=True, error="RankStopped: stopped", rooms={0: True, 1: False}),
        0,
    )
    prefill = RankReport(
        "prefill", 0, True, RankSummary(bytes_written=4096, failed={1: "engine write failed"}), 0
    )
    result = ClusterResult(
        config, (decode, prefill), 0.5, frozenset({1}), interrupted="SIGINT", side="all"
    )
    doc = demo_summary(result)
    _common(doc, "demo")
    assert (doc["partial"], doc["interrupted"], doc["verdict"]) == (True, "SIGINT", "FAIL")
    assert doc["rooms"] == {
        "total": 4,
        "succeeded": 1,
        "failed": 1,
        "unfinished": 2,
        "by_reason": {"engine error": 1},
    }
    assert doc["bytes"] == 4096
    json.dumps(doc)  # every value is JSON
    done = dataclasses.replace(result, interrupted=None)
    assert demo_summary(done)["partial"] is False


# --------------------------------------------------------------------------- log lines


def _record(room: object = None, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            info = sys.exc_info()
    record = logging.LogRecord(
        "staging_contracts._decode.handler", logging.WARNING, __file__, 1, "room %d: %s",
        (7, "stalled"), info,
    )  # fmt: skip
    if room is not None:
        record.room = room
    return record


def test_text_lines_start_with_the_time_and_end_with_the_room() -> None:
    line = logformat.TextFormatter("decode0 pid 1").format(_record(room=7))
    assert STAMP.match(line), line
    assert line.endswith(
        " [decode0 pid 1] WARNING staging_contracts._decode.handler: room 7: stalled [room 7]"
    )
    assert "[room" not in logformat.TextFormatter("x").format(_record())


def test_json_lines_carry_every_key_and_the_room_as_a_field() -> None:
    doc = json.loads(logformat.JsonFormatter("decode", 0).format(_record(room=7, exc=True)))
    assert list(doc)[: len(logformat.JSON_KEYS)] == list(logformat.JSON_KEYS)
    assert (doc["room"], doc["rank"], doc["role"], doc["level"]) == (7, 0, "decode", "WARNING")
    assert doc["message"] == "room 7: stalled"
    assert "RuntimeError: boom" in doc["exc"]
    assert STAMP.match(doc["time"] + " ")
    plain = json.loads(logformat.JsonFormatter("driver", None).format(_record()))
    assert (plain["room"], plain["rank"], "exc" in plain) == (None, None, False)


@pytest.fixture
def root_handler() -> Iterator[None]:
    """Removes the handler a test installed on the root logger."""
    before = list(logging.getLogger().handlers)
    level = logging.getLogger().level
    yield
    for handler in logging.getLogger().handlers:
        if handler not in before:
            logging.getLogger().removeHandler(handler)
    logging.getLogger().setLevel(level)


@pytest.mark.usefixtures("root_handler")
def test_install_reads_the_format_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(logformat.LOG_FORMAT_ENV, "json")
    logformat.install(role="prefill", rank=1)
    logging.getLogger("staging_contracts.x").warning("room %d", 3, extra={"room": 3})
    logformat.install(role="prefill", rank=1)  # replaces the first: one line per record
    logging.getLogger("staging_contracts.x").warning("again")
    lines = capsys.readouterr().err.splitlines()
    docs = [json.loads(line) for line in lines]
    assert [(d["message"], d["room"], d["role"], d["rank"]) for d in docs] == [
        ("room 3", 3, "prefill", 1),
        ("again", None, "prefill", 1),
    ]
    monkeypatch.setenv(logformat.LOG_FORMAT_ENV, "xml")
    logformat.install(role="prefill", rank=1)  # a rank never fails over its log format
    err = capsys.readouterr().err
    assert STAMP.match(err), err
    assert "STAGING_CONTRACTS_LOG_FORMAT='xml': choose text or json; writing text" in err


def test_a_bad_log_format_in_the_environment_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(logformat.LOG_FORMAT_ENV, "xml")
    assert cli.main(["check", "examples.hosts:ExampleKVManager"]) == 2
    assert capsys.readouterr().err == (
        "staging-contracts: STAGING_CONTRACTS_LOG_FORMAT='xml': choose text or json\n"
    )


def _room_log_calls() -> Iterator[tuple[str, int, ast.Call]]:
    for path in sorted((REPO / "src" / "staging_contracts").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "logger"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and "room %d" in str(node.args[0].value)
            ):
                yield str(path.relative_to(REPO)), node.lineno, node


def test_every_log_line_about_a_room_carries_the_room_as_a_field() -> None:
    """A logger call whose message names ``room %d`` passes ``extra={"room": <that id>}``
    (the JSON lines' ``room``, the text lines' ``[room N]``)."""
    calls = list(_room_log_calls())
    assert len(calls) >= 20
    missing = []
    for where, line, call in calls:
        extra = next((k.value for k in call.keywords if k.arg == "extra"), None)
        room = ast.unparse(call.args[1]) if len(call.args) > 1 else None
        if not (
            isinstance(extra, ast.Dict)
            and any(isinstance(k, ast.Constant) and k.value == "room" for k in extra.keys)
            and room is not None
            and room in [ast.unparse(v) for v in extra.values]
        ):
            missing.append(f"{where}:{line}")
    assert missing == []


# --------------------------------------------------------------------------- real runs


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL[0], reason=NIXL[1])
@pytest.mark.timeout(300)
def test_demo_json_and_json_log_lines(tmp_path: Path) -> None:
    """``demo --json`` writes its summary; with ``--log-format json`` every line a process
    logs is one JSON object, rank lines naming their role and rank."""
    path = tmp_path / "demo.json"
    args = ["--layers", "2", "--head-dim", "32", "--tokens", "96", "--requests", "3"]
    done = _cli("demo", *args, "--chunk-tokens", "32", "--json", str(path), "--log-format", "json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"wrote the summary to {path}" in done.stdout
    doc = json.loads(path.read_text())
    _common(doc, "demo")
    assert (doc["verdict"], doc["partial"], doc["interrupted"]) == ("PASS", False, None)
    assert doc["rooms"] == {
        "total": 3,
        "succeeded": 3,
        "failed": 0,
        "unfinished": 0,
        "by_reason": {},
    }
    assert doc["bytes"] > 0
    assert doc["chunks"] > 0
    assert doc["config"]["prefill_tp"] == 4
    assert sorted(doc["ring_peaks"]) == ["0", "1"]
    assert sorted(doc["memory"]["prefill"]) == ["0", "1", "2", "3"]
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert lines, "the ranks warn that no cluster secret is set"
    for line in lines:
        assert list(line)[: len(logformat.JSON_KEYS)] == list(logformat.JSON_KEYS)
        assert STAMP.match(line["time"] + " ")
    ranks = {(line["role"], line["rank"]) for line in lines if line["rank"] is not None}
    assert ("prefill", 0) in ranks
    assert ("decode", 0) in ranks


@pytest.fixture(scope="module")
def soak_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A 13 s soak without faults, over the CLI, with ``--json`` (text log lines)."""
    path = tmp_path_factory.mktemp("soak") / "soak.json"
    args = ["soak", "--duration", "13", "--faults", "none", "--verbose", "--json", str(path)]
    return _cli(*args, timeout=200), path


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL[0], reason=NIXL[1])
@pytest.mark.timeout(240)
def test_soak_json_has_the_rooms_by_outcome(
    soak_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, path = soak_run
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"wrote the summary to {path}" in done.stdout
    doc = json.loads(path.read_text())
    _common(doc, "soak")
    assert (doc["verdict"], doc["partial"], doc["interrupted"]) == ("PASS", False, None)
    rooms = doc["rooms"]
    assert rooms["succeeded"] > 0
    assert (
        rooms["started"] == rooms["succeeded"] + rooms["failed"] + rooms["corrupt"] + rooms["hung"]
    )
    assert sum(rooms["by_reason"].values()) == rooms["failed"]
    assert doc["config"]["faults"] == []
    assert doc["end"]["idle"] is True
    assert doc["memory"]["flat"] is True


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL[0], reason=NIXL[1])
@pytest.mark.timeout(240)
def test_soak_tallies_the_rooms_every_ten_seconds_and_stamps_rank_log_lines(
    soak_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, _ = soak_run
    assert done.returncode == 0, done.stdout + done.stderr
    tallies = [m for m in map(TALLY.match, done.stderr.splitlines()) if m is not None]
    ran = float(re.findall(r"^ran +([\d.]+) s", done.stdout, re.M)[0])
    assert len(tallies) >= 1, done.stderr
    stamps = [float(m["at"]) for m in tallies]
    # one at least every 10 s of the soak's own clock: the first at 10 s, each next 10 s on
    # (a turn of the driver's loop is 20 ms; 3 s of slack for a loaded machine)
    assert 10.0 <= stamps[0] <= 13.0
    assert all(10.0 <= b - a <= 13.0 for a, b in itertools.pairwise(stamps))
    assert len(tallies) >= int(ran // 10) - 2  # the stop at the end is not tallied
    assert int(tallies[-1]["started"]) > 0
    rank_lines = [line for line in done.stderr.splitlines() if "[soak " in line]
    assert rank_lines, "the ranks warn that no cluster secret is set"
    assert all(STAMP.match(line) for line in rank_lines), rank_lines[:3]


# --------------------------------------------------------------------------- the ticker


def test_the_ticker_is_due_once_per_gap() -> None:
    ticker = Ticker(100.0, every_s=10.0)
    assert [ticker.due(t) for t in (100.0, 109.9, 110.0, 110.1, 119.9, 120.5)] == [
        False,
        False,
        True,
        False,
        False,
        True,
    ]
    with pytest.raises(ValueError, match="every_s"):
        Ticker(0.0, every_s=0.0)


def test_the_tally_counts_each_outcome() -> None:
    outcomes = ["succeeded", "succeeded", "failed", None, "hung", "corrupt", None]
    assert tally_line(iter(outcomes)) == (
        "progress: 7 rooms started, 2 ok, 1 failed, 1 corrupt, 1 hung, 2 in flight"
    )
    assert TALLY.match(f"  10.0 s  {tally_line([])}")
