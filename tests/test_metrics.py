"""The Prometheus collectors: names, labels and values after real in-process transfers."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from staging_contracts._cluster._messages import Metrics
from staging_contracts._control.wire import MalformedMessage
from staging_contracts._run._codec import decode, encode
from staging_contracts.backends._kv_requests import KVPoll, KVReceiver, KVSender
from staging_contracts.metrics import register, snapshot_of
from staging_contracts.metrics._collector import SERIES
from staging_contracts.outcomes import FailureReason
from staging_contracts.stats import LATENCY_BUCKETS_S, RoomTally
from tests.local_cluster import Geometry, sides, wait_for, wait_states

Sample = tuple[str, dict[str, str], float]


def scrape(registry: CollectorRegistry) -> list[Sample]:
    text = generate_latest(registry).decode()
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [v for n, lab, v in samples if n == name and labels.items() <= lab.items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_a_transfer_moves_every_series_and_the_sides_agree() -> None:
    """One room P=2 -> D=1: prefill's staged bytes add up to decode's scattered bytes, each
    side counts its 3 chunks and 1 success with its latency, decode counts the STAGING_REQs
    and its ring; every sample is labelled role, rank, engine and named in SERIES."""
    with sides(Geometry(2, 1, 4)) as s:
        c = s.cluster
        registry = CollectorRegistry()
        register(c.decode[0], registry, engine="local")
        for p, manager in enumerate(c.prefill):
            register(manager, registry, transfers=s.prefill[p], engine="local")
        before = scrape(registry)
        assert value(before, "staging_contracts_scattered_bytes_total", role="decode") == 0

        request = c.add_request(50, num_pages=6, chunk_pages=2)
        c.handlers[0].release_room(50)
        receiver = KVReceiver(s.decode[0], 50)
        receiver.init(request.decode_pages, chunk_pages=2)
        senders = [KVSender(t, 50) for t in s.prefill]
        for sender in senders:
            sender.init(6, c.targets)
        receiver.send_metadata()
        for sender in senders:
            for chunk in request.chunks():
                sender.send(chunk.pages, last=chunk.chunk_idx == 2)
        assert wait_states(senders) == [KVPoll.Success] * 2
        assert wait_states([receiver]) == [KVPoll.Success]
        during = scrape(registry)
        receiver.release()
        after = scrape(registry)

    assert {name for name, _, _ in after} <= SERIES
    assert {name for name, _, _ in after} >= SERIES
    for name, labels, _ in after:
        assert {"role", "rank", "engine"} <= labels.keys(), name
        assert labels["engine"] == "local"
    staged = [
        value(after, "staging_contracts_staged_bytes_total", role="prefill", rank=str(p))
        for p in range(2)
    ]
    assert all(n > 0 for n in staged)
    assert value(after, "staging_contracts_scattered_bytes_total", role="decode") == sum(staged)
    for role, rank in (("prefill", "0"), ("prefill", "1"), ("decode", "0")):
        assert value(after, "staging_contracts_chunks_total", role=role, rank=rank) == 3
        ended = value(
            after, "staging_contracts_rooms_ended_total", role=role, rank=rank, outcome="success"
        )
        assert ended == 1
        assert (
            value(after, "staging_contracts_room_latency_seconds_count", role=role, rank=rank) == 1
        )
        assert value(after, "staging_contracts_room_latency_seconds_sum", role=role, rank=rank) > 0
        inf = value(
            after, "staging_contracts_room_latency_seconds_bucket", role=role, rank=rank, le="+Inf"
        )
        assert inf == 1
    # Both writers asked for each of the 3 chunks at least once.
    reqs = value(
        after, "staging_contracts_control_messages_total", role="decode", kind="STAGING_REQ"
    )
    assert reqs >= 6
    rsps = value(
        after,
        "staging_contracts_control_messages_total",
        role="prefill",
        rank="0",
        kind="STAGING_RSP",
    )
    assert rsps >= 3
    assert value(after, "staging_contracts_ring_capacity_bytes", role="decode") == 1 << 20
    assert value(after, "staging_contracts_ring_in_use_bytes", role="decode") == 0
    assert value(after, "staging_contracts_ring_reserved_bytes", role="decode") == 0
    for name in (
        "staging_contracts_malformed_messages_total",
        "staging_contracts_unauthorized_messages_total",
        "staging_contracts_dropped_messages_total",
        "staging_contracts_peers_declared_dead_total",
        "staging_contracts_fences_outstanding",
    ):
        assert value(after, name, role="decode") == 0, name
    assert value(during, "staging_contracts_rooms_ended_total", role="decode") == 1


def test_a_failed_room_is_counted_by_its_reason() -> None:
    """A room decode never announced fails on prefill as ``no ROOM_META``."""
    with sides(Geometry(1, 1, 2)) as s:
        registry = CollectorRegistry()
        register(s.cluster.prefill[0], registry, transfers=s.prefill[0])
        sender = KVSender(s.prefill[0], 52)
        sender.init(2, s.cluster.targets)
        sender.send((1, 2), last=True)
        assert wait_states([sender], timeout=10) == [KVPoll.Failed]
        samples = scrape(registry)
    failed = value(
        samples,
        "staging_contracts_rooms_ended_total",
        outcome="failed",
        reason=FailureReason.NO_ROOM_META.label,
    )
    assert failed == 1
    assert value(samples, "staging_contracts_room_latency_seconds_count") == 0
    assert value(samples, "staging_contracts_staged_bytes_total") == 0


def test_a_malformed_message_is_counted() -> None:
    """A STAGING_REQ with broken frames reaches the listener: malformed goes up by one."""
    with sides(Geometry(1, 1, 2)) as s:
        c = s.cluster
        registry = CollectorRegistry()
        register(c.decode[0], registry)
        c.prefill[0].send(c.decode[0].endpoint, [b"STAGING_REQ", b"junk"])
        assert wait_for(lambda: c.decode[0].listener.stats().malformed > 0)
        samples = scrape(registry)
    assert value(samples, "staging_contracts_malformed_messages_total") == 1


def test_a_snapshot_survives_the_rank_message_codec_and_junk_is_refused() -> None:
    """The snapshot travels to the driver's relay as a :class:`Metrics` message."""
    with sides(Geometry(1, 1, 2)) as s:
        snap = snapshot_of(s.cluster.decode[0], engine="local")
    assert snap.role == "decode"
    assert snap.ring_capacity_bytes == 1 << 20
    assert decode(encode(Metrics(snap), "decode", 0)).message == Metrics(snap)
    doc = json.loads(encode(Metrics(snap), "decode", 0))
    body = doc["body"]["snapshot"]
    broken: object
    for broken in ({**body, "chunks": "3"}, {**body, "rooms": [[1]]}, []):
        raw = json.dumps({**doc, "body": {"snapshot": broken}}).encode()
        with pytest.raises(MalformedMessage):
            decode(raw)


def test_room_latencies_fall_into_their_buckets() -> None:
    tally = RoomTally()
    tally.ended("success", latency_s=LATENCY_BUCKETS_S[0])  # le is inclusive
    tally.ended("success", latency_s=LATENCY_BUCKETS_S[-1] + 1)
    tally.ended("failed", "stalled")
    snap = tally.snapshot()
    assert snap.latency_buckets[0] == 1
    assert snap.latency_buckets[-1] == 1
    assert sum(snap.latency_buckets) == snap.latency_count == 2
    assert snap.ended == (("failed", "stalled", 1), ("success", "", 2))


def test_each_side_exports_only_its_series_and_the_engine_by_name() -> None:
    """Decode has no staged bytes, prefill no ring, scatters or fences; the ``engine`` label
    is the engine's name (as the CLI's relay gives it), not its class; a prefill manager
    registered without ``transfers=`` has them found."""
    with sides(Geometry(1, 1, 2)) as s:
        registry = CollectorRegistry()
        register(s.cluster.decode[0], registry)
        register(s.cluster.prefill[0], registry)
        samples = scrape(registry)
    by_role: dict[str, set[str]] = {}
    for name, labels, _ in samples:
        by_role.setdefault(labels["role"], set()).add(name)
        assert labels["engine"] == "local", (name, labels)
    decode_only = {
        "staging_contracts_scattered_bytes_total",
        "staging_contracts_ring_in_use_bytes",
        "staging_contracts_ring_reserved_bytes",
        "staging_contracts_ring_capacity_bytes",
        "staging_contracts_fences_outstanding",
    }
    assert decode_only <= by_role["decode"]
    assert not decode_only & by_role["prefill"]
    assert "staging_contracts_staged_bytes_total" in by_role["prefill"]
    assert "staging_contracts_staged_bytes_total" not in by_role["decode"]
    # The prefill's transfers were found: its latency histogram is exported.
    assert "staging_contracts_room_latency_seconds_count" in by_role["prefill"]


def test_a_prefill_without_its_transfers_is_refused() -> None:
    """Registering a prefill manager before its ``PrefillTransfers`` exist would export no
    rooms nor latency, silently: it is refused, saying what to do."""
    from staging_contracts.backends._common import Role
    from staging_contracts.backends.local import LocalKVManager
    from staging_contracts.testing import DecodeSetup

    setup = DecodeSetup()
    manager = LocalKVManager(setup.kv_args, role=Role.PREFILL, attn_tp_size=1)
    try:
        with pytest.raises(ValueError, match="transfers="):
            register(manager, CollectorRegistry())
    finally:
        manager.close()


def test_without_prometheus_client_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The extra's install command is in the ImportError."""
    import sys

    for name in [n for n in sys.modules if n.split(".")[0] == "prometheus_client"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.delitem(sys.modules, "staging_contracts.metrics._collector")
    with sides(Geometry(1, 1, 2)) as s, pytest.raises(ImportError) as caught:
        register(s.cluster.decode[0], CollectorRegistry())
    assert "pip install 'staging-contracts[metrics]'" in str(caught.value)
