"""With ``--log-format json`` a command's stderr is JSON throughout: the soak's progress,
fault and warning lines are JSON log objects as the rank and driver log lines are (review
of issue 26, item 11); its summary stays on stdout, as text."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from staging_contracts._cluster import logformat
from staging_contracts._cluster.logformat import json_line
from staging_contracts.engines import engine_available

REPO = Path(__file__).resolve().parents[1]
NIXL = engine_available("nixl")


def test_a_progress_line_is_one_json_log_object() -> None:
    doc = json.loads(json_line("  10.0 s  progress: 3 rooms", logger="staging_contracts.cli"))
    assert list(doc) == list(logformat.JSON_KEYS)
    assert doc["message"] == "  10.0 s  progress: 3 rooms"
    assert (doc["level"], doc["logger"], doc["role"], doc["rank"]) == (
        "INFO",
        "staging_contracts.cli",
        "driver",
        None,
    )
    assert doc["pid"] == os.getpid()


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL[0], reason=NIXL[1])
@pytest.mark.timeout(240)
def test_every_stderr_line_of_a_json_soak_is_a_json_object() -> None:
    """A short soak with a stall, the ranks' warnings on (--verbose), the metrics served on
    a free port and a variable the soak ignores: every stderr line parses, and the lines the
    command says itself (the start, the URL with its real port, the warning, the fault) are
    among them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGING_CONTRACTS_")}
    env["STAGING_CONTRACTS_RING_BYTES"] = "4096"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "staging_contracts.cli", "--log-format", "json", "soak"),
            *("--duration", "3", "--faults", "stall", "--verbose", "--metrics-port", "0"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert lines
    docs = [json.loads(line) for line in lines]  # each one parses, or this fails
    assert all(list(doc)[: len(logformat.JSON_KEYS)] == list(logformat.JSON_KEYS) for doc in docs)
    said = [doc["message"] for doc in docs if doc["logger"] == "staging_contracts.cli"]
    assert any(line.startswith("soak over nixl") for line in said), said
    warned = [
        doc for doc in docs if "STAGING_CONTRACTS_RING_BYTES=4096 is ignored" in doc["message"]
    ]
    assert [doc["level"] for doc in warned] == ["WARNING"], said
    urls = [m for line in said if (m := re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line))]
    assert len(urls) == 1, said
    assert int(urls[0][1]) > 0
    assert any(re.search(r"s  stall: stopped prefill \d", line) for line in said), said
    assert "verdict            PASS" in done.stdout
