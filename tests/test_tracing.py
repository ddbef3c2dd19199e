"""OpenTelemetry traces of rooms: a span per room and side, an event per chunk, recorded by
the SDK's in-memory exporter over real transfers; nothing at all without a provider."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Final

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from staging_contracts import tracing
from staging_contracts.backends._kv_requests import KVPoll, KVReceiver, KVSender
from staging_contracts.outcomes import FailureReason
from tests.local_cluster import Geometry, sides, wait_for, wait_states

REPO: Final = Path(__file__).resolve().parent.parent
CHUNK_PAGES = 2
ROOM_PAGES = 6


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """Room spans go to an in-memory exporter (for managers built in the test)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.use_tracer_provider(provider)
    try:
        yield memory
    finally:
        tracing.use_tracer_provider(None)
        provider.shutdown()


def _room_spans(memory: InMemorySpanExporter, room: int) -> dict[str, ReadableSpan]:
    spans = [s for s in memory.get_finished_spans() if s.name == tracing.SPAN_NAME]
    mine = [s for s in spans if s.attributes is not None and s.attributes["staging.room"] == room]
    by_side = {str(s.attributes["staging.side"]): s for s in mine if s.attributes is not None}
    assert len(by_side) == len(mine), "one span per room and side"
    return by_side


def _chunk(attributes: object) -> int:
    """The ``staging.chunk`` attribute of a chunk event."""
    assert isinstance(attributes, Mapping)
    index = attributes["staging.chunk"]
    assert isinstance(index, int)
    return index


def test_a_room_has_a_span_per_side_with_its_chunks_and_outcome(
    exporter: InMemorySpanExporter,
) -> None:
    """A room that succeeds: one decode and one prefill span, each with the room id, the
    outcome ``success`` and one ``chunk`` event per chunk, in order."""
    with sides(Geometry(1, 1, 2)) as s:
        c = s.cluster
        request = c.add_request(70, num_pages=ROOM_PAGES, chunk_pages=CHUNK_PAGES)
        c.handlers[0].release_room(70)
        exporter.clear()  # add_request's own registration, released: not this test's
        receiver = KVReceiver(s.decode[0], 70)
        receiver.init(request.decode_pages, chunk_pages=CHUNK_PAGES)
        receiver.send_metadata()
        sender = KVSender(s.prefill[0], 70)
        sender.init(ROOM_PAGES, c.targets)
        chunks = request.chunks()
        for chunk in chunks:
            sender.send(chunk.pages, last=chunk is chunks[-1])
        assert wait_states([sender]) == [KVPoll.Success]
        assert wait_states([receiver]) == [KVPoll.Success]
        assert wait_for(lambda: set(_room_spans(exporter, 70)) == {"decode", "prefill"})
    for side, span in _room_spans(exporter, 70).items():
        assert span.attributes is not None
        assert span.attributes["staging.outcome"] == "success", side
        assert "staging.failure_reason" not in span.attributes
        assert span.status.status_code is not StatusCode.ERROR
        events = [e for e in span.events if e.name == "chunk"]
        assert sorted(_chunk(e.attributes) for e in events) == [0, 1, 2]
        assert all(e.attributes and e.attributes["staging.pages"] == CHUNK_PAGES for e in events)


def test_a_failed_room_s_spans_name_the_reason(exporter: InMemorySpanExporter) -> None:
    """A room that cannot finish within a drain: both spans end failed, with reason
    ``draining`` and status ERROR; the chunks written before it are events."""
    with sides(Geometry(1, 1, 2)) as s:
        c = s.cluster
        request = c.add_request(71, num_pages=ROOM_PAGES, chunk_pages=CHUNK_PAGES)
        c.handlers[0].release_room(71)
        exporter.clear()  # add_request's own registration, released: not this test's
        receiver = KVReceiver(s.decode[0], 71)
        receiver.init(request.decode_pages, chunk_pages=CHUNK_PAGES)
        receiver.send_metadata()
        sender = KVSender(s.prefill[0], 71)
        sender.init(ROOM_PAGES, c.targets)
        sender.send(request.chunks()[0].pages)  # the rest never comes
        state = c.handlers[0]._rooms[71]
        assert wait_for(lambda: state.consumed == {0})  # chunk 0 landed and was scattered
        result = c.decode[0].close(drain_s=0.2)
        assert result.failed == (71,)
        assert wait_states([sender]) == [KVPoll.Failed]
        assert wait_for(lambda: set(_room_spans(exporter, 71)) == {"decode", "prefill"})
    for side, span in _room_spans(exporter, 71).items():
        assert span.attributes is not None
        assert span.attributes["staging.outcome"] == "failed", side
        assert span.attributes["staging.failure_reason"] == FailureReason.DRAINING.value
        assert "draining" in str(span.attributes["staging.failure_detail"])
        assert span.status.status_code is StatusCode.ERROR
        chunks = [_chunk(e.attributes) for e in span.events if e.name == "chunk"]
        assert chunks == [0], side


def test_without_a_provider_nothing_is_traced_or_imported() -> None:
    """No provider: ``room_tracer`` is ``None``; a decode handler and a prefill transfer layer
    built then hold none, and OpenTelemetry is never imported. Imported but with no provider
    set (the API's proxy): still ``None``."""
    probe = (
        "import sys\n"
        "from staging_contracts.backends._common import Role\n"
        "from staging_contracts.backends._kv_requests import PrefillTransfers\n"
        "from staging_contracts.backends.local import LocalKVManager\n"
        "from staging_contracts.backends._staging_setup import (\n"
        "    enable_decode_staging, enable_prefill_staging)\n"
        "from tests.local_cluster import Geometry\n"
        "g = Geometry(1, 1, 2)\n"
        "d = LocalKVManager(g.kv_args(1, 0), role=Role.DECODE, attn_tp_size=1)\n"
        "h = enable_decode_staging(d, kv_buffers=g.empty_pool(1, 0), ring_bytes=4096)\n"
        "p = LocalKVManager(g.kv_args(1, 0), role=Role.PREFILL, attn_tp_size=1)\n"
        "w = enable_prefill_staging(p, kv_buffers=g.empty_pool(1, 0), max_chunk_pages=2)\n"
        "t = PrefillTransfers(p, w)\n"
        "assert h._tracer is None and t._tracer is None\n"
        "assert not any(m.startswith('opentelemetry') for m in sys.modules), 'imported'\n"
        "import opentelemetry.trace\n"
        "from staging_contracts.tracing import room_tracer\n"
        "assert room_tracer('decode') is None\n"
        "t.close(); p.close(); d.close()\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
