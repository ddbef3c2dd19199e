"""``--metrics-port``: a short soak's ranks relay their series to the driver, served live."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from staging_contracts import cli
from staging_contracts._cluster.metrics_relay import MetricsRelay
from staging_contracts._cluster.soak import run_soak
from staging_contracts._cluster.soak_report import SoakConfig
from staging_contracts._control.security import SECRET_ENV, SECRET_FILE_ENV
from staging_contracts.engines import engine_available
from staging_contracts.outcomes import FailureReason

NIXL_OK, NIXL_WHY = engine_available("nixl")

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY),
    pytest.mark.timeout(180),
]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and wanted <= lab)


class Scraper:
    """Scrapes every 0.2 s from a thread while the soak runs; keeps the non-empty scrapes."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.scrapes: list[Samples] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(0.2):
            try:
                samples = scrape(self.port)
            except OSError as exc:  # not yet serving, or no longer
                self.errors.append(str(exc))
                continue
            if samples:
                self.scrapes.append(samples)

    def __enter__(self) -> Scraper:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def moved(scrapes: list[Samples], name: str) -> bool:
    values = [total(s, name) for s in scrapes]
    return len(set(values)) > 1 and values == sorted(values)


@pytest.fixture(autouse=True)
def _no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(SECRET_ENV, raising=False)


def test_a_soak_serves_every_rank_and_its_final_series_agree_with_the_summary() -> None:
    """2 prefill -> 1 decode, no faults, 3 s: scrapes during the run see the counters move;
    the last snapshots agree with the summary (rooms by outcome, every chunk of every room on
    every rank, prefill's staged bytes = decode's scattered bytes, the ring empty)."""
    config = SoakConfig(duration_s=3.0, faults=(), settle_s=0.5, room_bound_s=30.0)
    relay = MetricsRelay()
    relay.serve(0)
    assert relay.port
    try:
        with Scraper(relay.port) as scraper:
            result = run_soak(config, relay=relay)
        final = scrape(relay.port)
    finally:
        relay.close()
    assert result.ok, result.problems
    assert len(scraper.scrapes) >= 2
    assert moved(scraper.scrapes, "staging_contracts_chunks_total")
    assert moved(scraper.scrapes, "staging_contracts_rooms_ended_total")

    ranks = {(dict(lab)["role"], dict(lab)["rank"]) for (_, lab) in final}
    assert ranks == {("decode", "0"), ("prefill", "0"), ("prefill", "1")}
    chunks_per_room = len(list(config.transfer().chunks()))
    for role, rank in ranks:
        ended = total(final, "staging_contracts_rooms_ended_total", role=role, rank=rank)
        ok = total(
            final, "staging_contracts_rooms_ended_total", role=role, rank=rank, outcome="success"
        )
        assert ended == ok == result.rooms_succeeded == result.rooms_started, (role, rank)
        chunks = total(final, "staging_contracts_chunks_total", role=role, rank=rank)
        assert chunks == result.rooms_succeeded * chunks_per_room, (role, rank)
        count = total(final, "staging_contracts_room_latency_seconds_count", role=role, rank=rank)
        assert count == result.rooms_succeeded
        assert {dict(lab)["engine"] for (_, lab) in final} == {"nixl"}
    assert result.failed_by_reason == {}
    staged = total(final, "staging_contracts_staged_bytes_total", role="prefill")
    assert staged > 0
    assert (
        staged
        == result.bytes_verified
        == result.rooms_succeeded * (config.transfer().request_bytes)
    )
    assert total(final, "staging_contracts_scattered_bytes_total", role="decode") == staged
    assert total(final, "staging_contracts_ring_in_use_bytes") == result.ring_live_bytes_end == 0
    assert total(final, "staging_contracts_ring_capacity_bytes", role="decode") > 0
    assert total(final, "staging_contracts_fences_outstanding") == result.fenced_rooms_end
    assert total(final, "staging_contracts_unauthorized_messages_total") == result.unauthorized


def test_under_a_fault_decode_s_failed_rooms_by_reason_agree_with_the_summary() -> None:
    """2 prefill -> 1 decode with ``stall-long`` (a prefill rank stopped past the liveness
    timeout): rooms fail; decode's ``rooms_ended_total{outcome="failed"}`` by ``reason``
    equals the summary's failed rooms by reason (the summary groups by decode's first
    reason, the same enum), and every room started ended on decode."""
    config = SoakConfig(duration_s=9.0, faults=("stall-long",), settle_s=0.5, room_bound_s=30.0)
    relay = MetricsRelay()
    relay.serve(0)
    assert relay.port
    try:
        result = run_soak(config, relay=relay)
        final = scrape(relay.port)
    finally:
        relay.close()
    assert result.ok, result.problems
    assert result.faults_injected.get("stall-long") == 1
    assert result.rooms_failed > 0
    failed: dict[str, float] = {}
    for (name, labels), value in final.items():
        label = dict(labels)
        if (name, label["role"], label.get("outcome")) == (
            "staging_contracts_rooms_ended_total",
            "decode",
            "failed",
        ):
            failed[label["reason"]] = failed.get(label["reason"], 0) + value
    expected = {FailureReason(group).label: n for group, n in result.failed_by_reason.items()}
    assert {k: v for k, v in failed.items() if v} == expected
    ended = total(final, "staging_contracts_rooms_ended_total", role="decode")
    assert ended == result.rooms_started
    assert total(final, "staging_contracts_scattered_bytes_total", role="decode") >= (
        result.bytes_verified
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_the_soak_command_serves_its_metrics_on_the_port_it_is_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``soak --metrics-port PORT``: /metrics answers during the run with every rank's series,
    and nothing is served once the command returned."""
    port = free_port()
    with Scraper(port) as scraper:
        status = cli.main(
            ["soak", "--duration", "2", "--faults", "none", "--metrics-port", str(port)]
        )
    assert status == 0, capsys.readouterr()
    assert len(scraper.scrapes) >= 2
    last = scraper.scrapes[-1]
    roles = {dict(lab)["role"] for (_, lab) in last}
    assert roles == {"prefill", "decode"}
    assert total(last, "staging_contracts_rooms_ended_total", outcome="success") > 0
    with pytest.raises(urllib.error.URLError, match="refused"):
        scrape(port)
