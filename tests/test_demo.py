"""The main job: the demo command end to end, and its summary."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from staging_contracts._cluster._messages import RankMemory, RankSummary
from staging_contracts._cluster.demo import format_summary
from staging_contracts._cluster.runner import ClusterResult, RankReport
from staging_contracts._run.workload import TransferConfig
from staging_contracts.cli import main
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
    assert re.search(
        r"peak RSS to done +prefill \d+, \d+, \d+, \d+ MiB; decode \d+, \d+ MiB \(by rank;"
        r" from the timed requests' start to the done barrier, before verification\)",
        out,
    )
    assert re.search(r"RSS at done +prefill \d+, \d+, \d+, \d+ MiB; decode \d+, \d+ MiB", out)
    assert re.search(r"ring reserved peak +decode 0: [\d.]+ of [\d.]+ MiB.*; decode 1: ", out)


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
    """The summary names failed requests, the ring's reserved peak (above the ring: why that
    is no overflow), what each rank held at the done barrier and a FAIL verdict."""
    config = TransferConfig(requests=2, tokens=64, page_size=16)
    decode = RankReport(
        "decode",
        0,
        True,
        RankSummary(
            verified=True,
            chunks=2,
            ring_peak=2 << 20,
            ring_size=4 << 20,
            control_messages=10,
            failed={1: "boom"},
            peak_rss_bytes=900 << 20,
            memory=RankMemory(300 << 20, "timed requests", 280 << 20),
        ),
        0,
    )
    wrapped = RankReport(
        "decode", 1, True, RankSummary(ring_peak=6 << 20, ring_size=4 << 20, verified=True), 0
    )
    prefill = RankReport(
        "prefill",
        0,
        True,
        RankSummary(
            bytes_written=1 << 20,
            control_messages=5,
            failed={1: "engine write failed"},
            peak_rss_bytes=800 << 20,
            memory=RankMemory(512 << 20, "timed requests", 500 << 20),
        ),
        0,
    )
    result = ClusterResult(config, (decode, wrapped, prefill), 0.5, frozenset({1}))
    text = format_summary(result)
    assert "failed requests          1" in text
    assert (
        "ring reserved peak       decode 0: 2.0 of 4.0 MiB; decode 1: 6.0 of 4.0 MiB (1.5x);"
        " above the ring: next-round regions reserved ahead, written once the watermark frees"
        " them (never more in use than the ring)" in text
    )
    assert (
        "peak RSS to done         prefill 512, ?, ?, ? MiB; decode 300, ? MiB (by rank; from"
        " the timed requests' start to the done barrier, before verification)" in text
    )
    assert "RSS at done              prefill 500, ?, ?, ? MiB; decode 280, ? MiB (by rank)" in text
    assert "900" not in text  # the whole-life peak (verification included) is not shown
    assert "CUDA" not in text
    assert "verification             FAIL" in text
    assert "device                   cpu" in text
    assert "throughput               0.00 GB/s" in text


def test_summary_says_where_a_peak_counts_from_and_the_cuda_peak() -> None:
    """A rank that could not reset its peak makes the line say 'since the process started';
    on CUDA the allocator's peak is shown, and the device line says the ranks share a GPU."""
    config = TransferConfig(prefill_tp=1, decode_tp=1, kv_heads=1, device="cuda")
    fields = RankSummary(memory=RankMemory(100 << 20, "process start", None, 64 << 20))
    reports = (RankReport("decode", 0, True, fields, 0), RankReport("prefill", 0, True, fields, 0))
    text = format_summary(ClusterResult(config, reports, 0.5))
    assert "(by rank; since the process started to the done barrier" in text
    assert "RSS at done              prefill ? MiB; decode ? MiB (by rank)" in text
    assert (
        "CUDA peak allocated      prefill 64 MiB; decode 64 MiB (by rank, timed requests;"
        " every rank on the same GPU)" in text
    )
    assert "device                   cuda (every rank on its current GPU, the same one" in text
