"""The main job: the demo command end to end, and its summary."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from staging_contracts.cli import main
from staging_contracts.cluster.demo import format_summary
from staging_contracts.cluster.runner import ClusterResult, RankReport
from staging_contracts.cluster.workload import TransferConfig
from staging_contracts.engines import engine_available

REPO = Path(__file__).resolve().parents[1]
NIXL = engine_available("nixl")


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL[0], reason=NIXL[1])
def test_demo_command_verifies_and_exits_zero() -> None:
    """staging-contracts demo runs across processes, shows progress and a PASS summary."""
    script = Path(sys.executable).with_name("staging-contracts")
    args = [
        "--layers",
        "2",
        "--head-dim",
        "32",
        "--tokens",
        "96",
        "--requests",
        "3",
        "--chunk-tokens",
        "32",
    ]
    result = subprocess.run(
        [str(script), "demo", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "] 6/6 rooms done" in out
    assert "verification             PASS: every page of 3 requests on 2 decode ranks" in out
    assert "prefill TP -> decode TP  4 -> 2" in out
    assert re.search(r"peak RSS +prefill \d+, \d+, \d+, \d+ MiB; decode \d+, \d+ MiB", out)
    assert re.search(r"ring peak use +decode 0: [\d.]+ of [\d.]+ MiB.*; decode 1: ", out)


def test_demo_rejects_impossible_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    """A non-positive size is a usage error with exit status 2."""
    assert main(["demo", "--tokens", "0"]) == 2
    assert "tokens=0 must be >= 1" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is available here")
def test_demo_refuses_cuda_without_a_gpu_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """--device cuda without a CUDA device: one line, exit status 2, nothing started."""
    assert main(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "staging-contracts demo: --device cuda: no CUDA device here"
        " (torch.cuda.is_available() is false)"
    ]


def test_summary_reports_failures_and_peak_use() -> None:
    """The summary names failed requests, the ring's peak and a FAIL verdict."""
    config = TransferConfig(requests=2, tokens=64, page_size=16)
    decode = RankReport(
        "decode",
        0,
        True,
        {
            "verified": True,
            "chunks": 2,
            "ring_peak": 2 << 20,
            "ring_size": 4 << 20,
            "control_messages": 10,
            "failed": {"1": "boom"},
            "peak_rss_bytes": 300 << 20,
        },
        0,
    )
    wrapped = RankReport(
        "decode", 1, True, {"ring_peak": 6 << 20, "ring_size": 4 << 20, "verified": True}, 0
    )
    prefill = RankReport(
        "prefill",
        0,
        True,
        {
            "bytes_written": 1 << 20,
            "control_messages": 5,
            "failed": {"1": "engine write failed"},
            "peak_rss_bytes": 512 << 20,
        },
        0,
    )
    result = ClusterResult(config, (decode, wrapped, prefill), 0.5, frozenset({1}))
    text = format_summary(result)
    assert "failed requests          1" in text
    assert (
        "ring peak use            decode 0: 2.0 of 4.0 MiB; decode 1: 6.0 of 4.0 MiB (1.5x);"
        " later rounds wait for the watermark" in text
    )
    assert "peak RSS                 prefill 512, ?, ?, ? MiB; decode 300, ? MiB (by rank)" in text
    assert "verification             FAIL" in text
    assert "device                   cpu" in text
    assert "throughput               0.00 GB/s" in text
