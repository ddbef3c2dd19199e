"""The demo's placement options: one side's ranks here, the other side's bootstrap joined."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from staging_contracts._cluster._messages import RankSummary
from staging_contracts._cluster.demo import (
    DEFAULT_TIMEOUT_S,
    DemoPlacement,
    add_demo_arguments,
    config_from_args,
    format_summary,
    placement_from_args,
)
from staging_contracts._cluster.runner import ClusterResult, RankReport, _roles, run_cluster
from staging_contracts._control.security import SECRET_ENV, SECRET_FILE_ENV
from staging_contracts._run.workload import TransferConfig
from staging_contracts.cli import main

SECRET = "0123456789abcdef0123456789abcdef"


def parse(*argv: str) -> argparse.Namespace:
    """The demo's options as the CLI parses them."""
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """No cluster secret in the environment."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)


@pytest.mark.usefixtures("no_secret")
def test_defaults_run_every_rank_here_on_loopback() -> None:
    """Without placement options the demo is the one-machine run it always was."""
    args = parse()
    assert placement_from_args(args) == DemoPlacement("all", None, DEFAULT_TIMEOUT_S)
    assert config_from_args(args).host == "127.0.0.1"


def test_one_side_joins_a_bootstrap_on_its_own_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """--ranks, --bootstrap (IPv4 or bracketed IPv6), --host and --timeout reach the run."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    args = parse(
        "--ranks", "decode", "--bootstrap", "tcp://10.0.0.1:5555",
        "--host", "10.0.0.2", "--timeout", "30",
    )  # fmt: skip
    assert placement_from_args(args) == DemoPlacement("decode", "tcp://10.0.0.1:5555", 30.0)
    assert config_from_args(args).host == "10.0.0.2"
    six = parse("--bootstrap", "tcp://[fd00::1]:80", "--host", "fd00::2")
    assert placement_from_args(six).bootstrap == "tcp://[fd00::1]:80"


@pytest.mark.usefixtures("no_secret")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--bootstrap", "10.0.0.1:5555"), r"--bootstrap '10.0.0.1:5555' is not tcp://ADDR:PORT"),
        (("--bootstrap", "tcp://10.0.0.1"), r"is not tcp://ADDR:PORT"),
        (("--bootstrap", "tcp://10.0.0.1:5555/x"), r"is not tcp://ADDR:PORT"),
        (("--timeout", "0"), r"--timeout 0.0 must be > 0"),
        (("--host", "10.0.0.2"), r"refusing to bind '10.0.0.2' without authentication"),
    ],
)
def test_bad_placement_is_refused_with_the_reason(argv: tuple[str, ...], message: str) -> None:
    """A malformed endpoint, a timeout that is not positive, or a non-loopback host without
    the cluster secret are refused before anything starts."""
    with pytest.raises(ValueError, match=message):
        placement_from_args(parse(*argv))


@pytest.mark.usefixtures("no_secret")
def test_the_command_refuses_a_non_loopback_host_without_the_secret(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The CLI exits 2 and names the secret to set; nothing is started."""
    assert main(["demo", "--ranks", "prefill", "--host", "10.0.0.2"]) == 2
    err = capsys.readouterr().err
    assert "staging-contracts demo: refusing to bind '10.0.0.2'" in err
    assert SECRET_ENV in err


def test_empty_host_is_not_a_config() -> None:
    """TransferConfig refuses a host that names no address."""
    with pytest.raises(ValueError, match=r"host must name an address"):
        TransferConfig(host="[]")


def test_a_split_run_needs_the_bootstrap_both_sides_use() -> None:
    """run_cluster of one side without a bootstrap endpoint is refused, before spawning."""
    with pytest.raises(ValueError, match=r"a run of the decode ranks only needs the bootstrap"):
        run_cluster(TransferConfig(), ranks="decode")


def test_roles_of_each_side_decode_first() -> None:
    """Each driver starts its own side's ranks only; decode's first, as in a full run."""
    config = TransferConfig(prefill_tp=2, decode_tp=1, kv_heads=2)
    assert _roles(config, "all") == [("decode", 0), ("prefill", 0), ("prefill", 1)]
    assert _roles(config, "prefill") == [("prefill", 0), ("prefill", 1)]
    assert _roles(config, "decode") == [("decode", 0)]


def _report(role: str, rank: int, **fields: Any) -> RankReport:
    return RankReport(role, rank, True, RankSummary(**fields), 0)


def test_summary_of_the_prefill_side_points_at_the_decode_side() -> None:
    """The prefill side passes on requests sent, and leaves the pages to the decode side."""
    config = TransferConfig(prefill_tp=2, decode_tp=1, kv_heads=2, requests=2, host="10.0.0.1")
    reports = tuple(
        _report("prefill", p, bytes_written=1 << 20, control_messages=3) for p in range(2)
    )
    text = format_summary(ClusterResult(config, reports, 0.5, side="prefill"))
    assert "ranks here               prefill on 10.0.0.1" in text
    assert "bytes moved              2.0 MiB" in text
    assert "transfer time            0.500 s (this side's clock)" in text
    assert "chunks staged            (on the decode side)" in text
    assert "ring reserved peak       (on the decode side)" in text
    assert (
        "verification             PASS: every one of 2 requests sent by 2 prefill ranks"
        " (the decode side verifies the pages)"
    ) in text


def test_summary_of_the_decode_side_verifies_the_pages() -> None:
    """The decode side passes only on verified pages, and leaves bytes to the prefill side."""
    config = TransferConfig(prefill_tp=2, decode_tp=1, kv_heads=2, requests=2, host="10.0.0.2")
    good = _report("decode", 0, verified=True, chunks=4, ring_peak=1 << 20, ring_size=2 << 20)
    text = format_summary(ClusterResult(config, (good,), 0.25, side="decode"))
    assert "ranks here               decode on 10.0.0.2" in text
    assert "bytes moved              (on the prefill side)" in text
    assert "throughput               (on the prefill side)" in text
    assert "chunks staged            4" in text
    assert "verification             PASS: every page of 2 requests on 1 decode ranks" in text
    bad = _report("decode", 0, verified=False, problems=["room 1 page 3 head 0: mismatch"])
    text = format_summary(ClusterResult(config, (bad,), 0.25, side="decode"))
    assert "verification             FAIL: room 1 page 3 head 0: mismatch" in text
