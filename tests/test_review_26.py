"""Review of issue 26 (operators): defects found trying the library as an operator would.

Each test here fails on ``soak-typed`` as reviewed; the report says what it shows."""

from __future__ import annotations

import time

import pytest

from staging_contracts.backends._kv_requests import KVPoll, KVReceiver, KVSender
from staging_contracts.metrics import snapshot_of
from staging_contracts.outcomes import Outcome
from tests.local_cluster import Geometry, Sides, sides, wait_for, wait_states
from tests.test_drain_health import _Closer, _draining, _send_last, _start_room


def _one_room(s: Sides, room: int) -> tuple[KVReceiver, KVSender]:
    c = s.cluster
    request = c.add_request(room, num_pages=4, chunk_pages=2)
    c.handlers[0].release_room(room)
    receiver = KVReceiver(s.decode[0], room)
    receiver.init(request.decode_pages, chunk_pages=2)
    receiver.send_metadata()
    sender = KVSender(s.prefill[0], room)
    sender.init(4, c.targets)
    chunks = request.chunks()
    for chunk in chunks:
        sender.send(chunk.pages, last=chunk is chunks[-1])
    assert wait_states([sender]) == [KVPoll.Success]
    assert wait_states([receiver]) == [KVPoll.Success]
    return receiver, sender


def test_transfer_record_end_time_is_when_the_room_ended_not_when_it_was_asked() -> None:
    """A scheduler collects the record some time after the room ended (it polls, it batches):
    the record's end and latency must be the room's, not the moment of the first call
    (SGLang's KVTransferMetric times the transfer itself)."""
    with sides(Geometry(1, 1, 2)) as s:
        receiver, sender = _one_room(s, 70)
        ended = time.monotonic()
        time.sleep(1.0)  # the scheduler gets to it a second later
        for record in (sender.get_transfer_metric(), receiver.get_transfer_metric()):
            assert record is not None
            assert record.end_monotonic <= ended + 0.2, (
                f"end stamped {record.end_monotonic - ended:.2f} s after the room ended"
            )


def test_transfer_record_after_release_is_not_a_failure() -> None:
    """A scheduler that releases the request and then asks for its record (or asks on
    another thread, as the docstring allows) gets a FAILED record ("unknown room") for a
    room that succeeded. Expected: the success, or ``None``, never a made-up failure."""
    with sides(Geometry(1, 1, 2)) as s:
        receiver, sender = _one_room(s, 71)
        sender.release()
        receiver.release()
        for record in (sender.get_transfer_metric(), receiver.get_transfer_metric()):
            assert record is None or record.outcome is Outcome.SUCCESS, record


def test_ring_bytes_in_use_never_exceeds_the_ring() -> None:
    """``staging_contracts_ring_bytes_in_use`` is documented as "ring bytes assigned and not
    yet freed" and the dashboard plots it over ``ring_capacity_bytes`` as a percentage; the
    docs say the bytes in use never exceed the ring. It exports the allocator's
    *reservation* (``live_bytes``), which overcommits: here 8x the ring with no chunk sent,
    so a "ring nearly full" panel or alert reads 800 % on an idle ring."""
    geometry = Geometry(1, 1, 2)
    page = sum(geometry.kv_args(1, 0).kv_item_lens)
    with sides(geometry, ring_bytes=page * 4) as s:
        c = s.cluster
        for room in (1, 2, 3, 4):
            request = c.add_request(room, num_pages=8, chunk_pages=2, seed=room)
            c.handlers[0].release_room(room)
            receiver = KVReceiver(s.decode[0], room)
            receiver.init(request.decode_pages, chunk_pages=2)
            receiver.send_metadata()
            KVSender(s.prefill[0], room).init(8, c.targets)
        deadline = time.monotonic() + 5
        peak = 0
        while time.monotonic() < deadline:  # prefill prefetches the rooms' regions
            snap = snapshot_of(c.decode[0])
            peak = max(peak, snap.ring_in_use_bytes)
            time.sleep(0.05)
        assert peak <= snap.ring_capacity_bytes, (peak, snap.ring_capacity_bytes)


def test_health_is_not_ok_while_draining() -> None:
    """A readiness probe reads ``health().ok``; while the manager drains it refuses every new
    room (reason draining), so it must not be reported ready (a load balancer would keep
    sending it requests that all fail)."""
    with sides(Geometry(1, 1, 2)) as s:
        decode = s.cluster.decode[0]
        request, _receiver, sender = _start_room(s, 80, seed=8)
        closer = _Closer(decode, drain_s=30.0)
        assert wait_for(_draining(decode))
        ok_while_draining = decode.health().ok
        _send_last(request, sender)
        closer.join()
        assert not ok_while_draining


def test_an_engine_error_is_an_engine_error_whatever_the_engine_says() -> None:
    """Reasons are still recovered from free text by substring (``classify``), so the
    engine's own wording picks the label: a write the engine reports as timed out is
    counted ``timeout`` (the prefill deadline's label), and decode's scatter failure is
    ``other``. Expected: the reason set where the failure happens (both are engine errors)."""
    from staging_contracts.outcomes import FailureReason, classify

    assert (
        classify("chunk 1: engine write failed: transfer timed out") is FailureReason.ENGINE_ERROR
    )
    assert (
        classify("scatter of chunk 3 failed: RuntimeError: CUDA error")
        is FailureReason.ENGINE_ERROR
    )


def test_two_managers_on_one_registry_give_a_scrape_prometheus_can_parse() -> None:
    """observability.md says to call ``register`` once per manager, on the default registry
    unless one is given. Two managers in one process (two ranks, or a prefill and a decode
    manager) then export every family twice (two ``# TYPE`` lines each), and the OpenMetrics
    exposition, which Prometheus asks for first, does not parse ("Clashing name"): the whole
    target's scrape fails. Expected: one family per name, a sample per manager."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.openmetrics.exposition import generate_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from staging_contracts.backends._common import Role
    from staging_contracts.backends.local import LocalKVManager
    from staging_contracts.metrics import register
    from staging_contracts.testing import DecodeSetup

    registry = CollectorRegistry()
    managers = []
    try:
        for rank in (0, 1):
            setup = DecodeSetup()
            manager = LocalKVManager(setup.kv_args, role=Role.DECODE, attn_tp_size=1)
            managers.append(setup.start(manager))
            register(manager, registry, rank=rank)
        text = generate_latest(registry).decode()  # type: ignore[no-untyped-call]
    finally:
        for manager in managers:
            manager.close()
    families = list(text_string_to_metric_families(text))  # type: ignore[no-untyped-call]
    assert len({f.name for f in families}) == len(families)


def test_a_room_in_flight_at_shutdown_still_exports_its_prefill_span() -> None:
    """Shutting down with a room in flight (the incident one wants traced): decode's span
    ends (failed) when the cluster is torn down, prefill's never ends, so the exporter never
    gets it. Expected: closing the manager and its ``PrefillTransfers`` ends every open
    span (failed), as a drain does."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from staging_contracts import tracing

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.use_tracer_provider(provider)
    try:
        with sides(Geometry(1, 1, 2)) as s:
            c = s.cluster
            request = c.add_request(5, num_pages=6, chunk_pages=2, seed=1)
            c.handlers[0].release_room(5)
            receiver = KVReceiver(s.decode[0], 5)
            receiver.init(request.decode_pages, chunk_pages=2)
            receiver.send_metadata()
            sender = KVSender(s.prefill[0], 5)
            sender.init(6, c.targets)
            sender.send(request.chunks()[0].pages)
            time.sleep(0.3)
            for manager in (*c.prefill, *c.decode):
                manager.close()
        sides_seen = {
            str(span.attributes["staging.side"])
            for span in memory.get_finished_spans()
            if span.attributes is not None
        }
        assert sides_seen == {"decode", "prefill"}
    finally:
        tracing.use_tracer_provider(None)
        provider.shutdown()


def test_a_bad_variable_is_refused_before_any_rank_process_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``STAGING_CONTRACTS_STALL_TIMEOUT_S=abc staging-contracts demo`` starts all six rank
    processes; one dies of the ConfigError, the driver waits 5 s to kill the others, and a
    full summary of ``?`` follows (about 20 s, exit 1), whereas a bad
    ``STAGING_CONTRACTS_SECRET`` is one line at once (exit 2). Expected: the demo's
    preflight refuses the variable, as it refuses the options."""
    from staging_contracts._cluster.preflight import preflight
    from staging_contracts._run.workload import TransferConfig
    from staging_contracts.config import ConfigError

    monkeypatch.setenv("STAGING_CONTRACTS_STALL_TIMEOUT_S", "abc")
    with pytest.raises(ConfigError):
        preflight(TransferConfig(), ignore_memory=True)
