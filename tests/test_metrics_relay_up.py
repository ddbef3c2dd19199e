"""The relay says which ranks are alive: ``staging_contracts_rank_up`` is 1 while a rank's
snapshots arrive, 0 once it is stale or known dead, and a dead rank's last values are not
served as current (review of issue 26, item 9)."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from staging_contracts._cluster.metrics_relay import STALE_AFTER_S, UP_SERIES, MetricsRelay
from staging_contracts._cluster.soak import run_soak
from staging_contracts._cluster.soak_report import SoakConfig
from staging_contracts._control.security import SECRET_ENV, SECRET_FILE_ENV
from staging_contracts.engines import engine_available
from staging_contracts.metrics import MetricsSnapshot

NIXL_OK, NIXL_WHY = engine_available("nixl")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def up_of(samples: Samples) -> dict[tuple[str, str], float]:
    return {
        (dict(lab)["role"], dict(lab)["rank"]): value
        for (name, lab), value in samples.items()
        if name == UP_SERIES
    }


def ranks_with(samples: Samples, name: str) -> set[tuple[str, str]]:
    return {(dict(lab)["role"], dict(lab)["rank"]) for (n, lab) in samples if n == name}


@pytest.fixture
def relay_clock() -> Iterator[tuple[MetricsRelay, Clock]]:
    clock = Clock()
    relay = MetricsRelay(clock=clock)
    relay.serve(0)
    yield relay, clock
    relay.close()


def test_a_rank_is_up_while_its_snapshots_arrive_and_down_once_stale(
    relay_clock: tuple[MetricsRelay, Clock],
) -> None:
    relay, clock = relay_clock
    assert relay.port
    relay.update(MetricsSnapshot("prefill", 0, "nixl", chunks=3))
    relay.update(MetricsSnapshot("decode", 0, "nixl", chunks=3))
    first = scrape(relay.port)
    assert up_of(first) == {("prefill", "0"): 1.0, ("decode", "0"): 1.0}
    assert {dict(lab)["engine"] for (n, lab) in first if n == UP_SERIES} == {"nixl"}

    clock.now += STALE_AFTER_S + 0.1
    relay.update(MetricsSnapshot("decode", 0, "nixl", chunks=4))  # decode still reports
    stale = scrape(relay.port)
    assert up_of(stale) == {("prefill", "0"): 0.0, ("decode", "0"): 1.0}
    # a stale rank's last values are still there, marked by rank_up 0
    assert ("prefill", "0") in ranks_with(stale, "staging_contracts_chunks_total")

    relay.update(MetricsSnapshot("prefill", 0, "nixl", chunks=5))
    assert up_of(scrape(relay.port))[("prefill", "0")] == 1.0


def test_a_rank_known_dead_is_down_at_once_and_its_series_are_dropped(
    relay_clock: tuple[MetricsRelay, Clock],
) -> None:
    relay, _ = relay_clock
    assert relay.port
    relay.update(MetricsSnapshot("prefill", 0, "nixl", chunks=3))
    relay.update(MetricsSnapshot("prefill", 1, "nixl", chunks=3))
    relay.mark_dead("prefill", 1)
    dead = scrape(relay.port)
    assert up_of(dead) == {("prefill", "0"): 1.0, ("prefill", "1"): 0.0}
    assert ranks_with(dead, "staging_contracts_chunks_total") == {("prefill", "0")}
    assert [s.rank for s in relay.snapshots()] == [0, 1]  # the last word of each is kept

    relay.update(MetricsSnapshot("prefill", 1, "nixl", chunks=0))  # its new process
    back = scrape(relay.port)
    assert up_of(back) == {("prefill", "0"): 1.0, ("prefill", "1"): 1.0}
    assert ranks_with(back, "staging_contracts_chunks_total") == {
        ("prefill", "0"),
        ("prefill", "1"),
    }


class UpWatcher:
    """Scrapes every 0.2 s while a soak runs; keeps every ``rank_up`` reading."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.readings: list[dict[tuple[str, str], float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(0.2):
            try:
                self.readings.append(up_of(scrape(self.port)))
            except OSError:
                continue


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
@pytest.mark.timeout(240)
def test_a_killed_rank_reads_down_until_its_new_process_reports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kill-prefill: the killed rank's ``rank_up`` goes to 0 while it is gone, and to 1
    again once its new process reports; the others stay 1 throughout."""
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    config = SoakConfig(duration_s=2.0, faults=("kill-prefill",), settle_s=0.5)
    relay = MetricsRelay()
    relay.serve(0)
    assert relay.port
    watcher = UpWatcher(relay.port)
    watcher.thread.start()
    try:
        result = run_soak(config, relay=relay)
    finally:
        watcher.stop.set()
        watcher.thread.join(10)
        relay.close()
    assert len(result.kills) == 1, result.kills
    killed = ("prefill", str(result.kills[0].rank))
    seen = [r.get(killed) for r in watcher.readings]
    assert 0.0 in seen, seen
    down_at = seen.index(0.0)
    assert 1.0 in seen[:down_at], "up before the kill"
    assert 1.0 in seen[down_at:], "its new process reported"
    back_at = seen.index(1.0, down_at)
    survivors = {key for r in watcher.readings for key in r} - {killed}
    assert survivors
    # (the stop at the end may leave them stale: read them up to the killed rank's return)
    assert all(
        r.get(key) == 1.0 for r in watcher.readings[:back_at] for key in survivors if key in r
    )
