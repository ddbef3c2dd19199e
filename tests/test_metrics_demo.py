"""``demo --metrics-port``: the demo's rank processes push their series to the driver."""

from __future__ import annotations

import pytest

from staging_contracts import cli
from staging_contracts._cluster.metrics_relay import MetricsRelay
from staging_contracts._cluster.runner import run_cluster
from staging_contracts._control.security import SECRET_ENV, SECRET_FILE_ENV
from staging_contracts._run.workload import TransferConfig
from staging_contracts.engines import engine_available
from tests.test_metrics_soak import Scraper, free_port, total

NIXL_OK, NIXL_WHY = engine_available("nixl")

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY),
    pytest.mark.timeout(180),
]


@pytest.fixture(autouse=True)
def _no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(SECRET_ENV, raising=False)


def test_every_demo_rank_reports_its_rooms_chunks_and_bytes() -> None:
    """P=2 -> D=1, 3 requests: the relay holds each rank's last snapshot, and it counts
    every room a success, every chunk, and decode scattered what prefill staged."""
    config = TransferConfig(
        backend="nixl",
        prefill_tp=2,
        decode_tp=1,
        kv_heads=2,
        layers=2,
        head_dim=16,
        tokens=48,
        page_size=4,
        requests=3,
        chunk_tokens=16,
        ring_chunks=2,
        warmup_requests=0,
    )
    relay = MetricsRelay()
    result = run_cluster(config, timeout_s=120, metrics=relay)
    assert result.verified
    snaps = {(s.role, s.rank): s for s in relay.snapshots()}
    assert set(snaps) == {("decode", 0), ("prefill", 0), ("prefill", 1)}
    chunks = len(list(config.chunks()))
    for snap in snaps.values():
        assert [(r.outcome, r.count) for r in snap.rooms] == [("success", 3)], snap
        assert snap.chunks == 3 * chunks
        assert snap.latency_count == 3
        assert snap.engine == "nixl"
    staged = snaps["prefill", 0].staged_bytes + snaps["prefill", 1].staged_bytes
    assert staged == result.bytes_moved > 0
    assert snaps["decode", 0].scattered_bytes == staged
    assert snaps["decode", 0].ring_in_use_bytes == 0


def test_the_demo_command_serves_its_metrics_on_the_port_it_is_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = free_port()
    args = ["demo", "--prefill-tp", "2", "--decode-tp", "1", "--tokens", "256", "--requests", "2"]
    with Scraper(port) as scraper:
        status = cli.main([*args, "--metrics-port", str(port)])
    assert status == 0, capsys.readouterr()
    assert scraper.scrapes, scraper.errors[-3:]
    last = scraper.scrapes[-1]
    assert {dict(lab)["role"] for (_, lab) in last} == {"prefill", "decode"}
    assert total(last, "staging_contracts_ring_capacity_bytes", role="decode") > 0
