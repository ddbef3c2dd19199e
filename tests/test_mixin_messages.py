"""The mixin's message handling: decode requests and arrivals, prefill answers and watermarks."""

from __future__ import annotations

import pytest

from staging_contracts import (
    ArrivalMode,
    ArrivalOutcome,
    DecodeStagingContext,
    PrefillStagingContext,
    StagingHandler,
    StagingManagerMixin,
    StagingReqOutcome,
    StagingStats,
)
from staging_contracts._control.wire import (
    ChunkReady,
    MalformedMessage,
    StagingReq,
    StagingRsp,
    WatermarkUpdate,
)
from staging_contracts._prefill.books import RegionAnswerTable, WatermarkTracker
from staging_contracts._staging.allocator import StagingAllocator
from tests.hosts import CommonBase, RecordingHandler


class Host(StagingManagerMixin, CommonBase):
    """A staging host whose context is chosen per test."""

    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"


def decode_host() -> tuple[Host, RecordingHandler]:
    """A decode host with a ring context and an attached recording handler."""
    host = Host()
    host._staging_ctx = DecodeStagingContext(StagingAllocator(1024))
    handler = RecordingHandler()
    host.attach_staging_handler(handler)
    return host, handler


def prefill_host() -> Host:
    """A prefill host with fresh books."""
    host = Host()
    host._staging_ctx = PrefillStagingContext(WatermarkTracker(), RegionAnswerTable())
    return host


def test_staging_req_reaches_the_handler_and_is_counted() -> None:
    """A valid STAGING_REQ is decoded, handed to the handler and counted by outcome."""
    host, handler = decode_host()
    outcome = host._handle_staging_req(StagingReq(7, 1, 4, "decode-0", 2).to_frames())
    assert outcome is StagingReqOutcome.ALLOCATED
    assert handler.requests == [(7, 1, 4, "decode-0", 2)]
    assert host.staging_stats() == StagingStats(received=1, allocated=1)


def test_chunk_ready_and_notification_reach_the_handler() -> None:
    """CHUNK_READY frames and NIXL-style payloads deliver the same arrival."""
    host, handler = decode_host()
    arrival = ChunkReady(7, 1, 4, 2, "decode-0", 3)
    assert host._handle_chunk_ready(arrival.to_frames()) is ArrivalOutcome.WAITING
    assert host._handle_chunk_notification(arrival.to_notification()) is ArrivalOutcome.WAITING
    assert handler.arrivals == [(7, 1, 4, 2, "decode-0", 3)] * 2
    assert host.staging_stats().arrivals == 2


def test_malformed_frames_raise_and_are_counted() -> None:
    """Bad frames raise MalformedMessage after being counted; nothing reaches the handler."""
    host, handler = decode_host()
    with pytest.raises(MalformedMessage, match=r"^STAGING_REQ frame 1 \('room'\)"):
        host._handle_staging_req([b"STAGING_REQ", b"+5", b"0", b"1", b"s"])
    with pytest.raises(
        MalformedMessage, match=r"^frame 0 \('type'\): expected STAGING_REQ, got WATERMARK$"
    ):
        host._handle_staging_req(WatermarkUpdate(1, 0).to_frames())
    with pytest.raises(MalformedMessage):
        host._handle_chunk_notification(b"CHUNK_READY\x00nope")
    assert handler.requests == []
    assert host.staging_stats() == StagingStats(received=3, malformed=3)


def test_messages_before_a_handler_is_attached_are_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Requests and arrivals before attach_staging_handler are dropped with a warning."""
    host = Host()
    host._staging_ctx = DecodeStagingContext(StagingAllocator(64))
    assert host._handle_staging_req(StagingReq(1, 0, 1, "d").to_frames()) is None
    assert host._handle_chunk_ready(ChunkReady(1, 0, 0, 1, "d").to_frames()) is None
    assert host.staging_stats() == StagingStats(received=2, dropped=2)
    assert caplog.text.count("no staging handler attached yet") == 2


def test_prefill_records_answers_and_watermarks() -> None:
    """STAGING_RSP lands in the region book; WATERMARK moves the session forward only."""
    host = prefill_host()
    answer = host._handle_staging_rsp(StagingRsp(3, 0, 128, 1, 256, "d").to_frames())
    assert answer is not None
    assert (answer.offset, answer.round, answer.end) == (128, 1, 256)
    assert not host._is_watermark_ready("d", 1, 256)
    assert host._handle_watermark(WatermarkUpdate(0, 256, "d").to_frames())
    assert not host._handle_watermark(WatermarkUpdate(0, 100, "d").to_frames())
    assert host._is_watermark_ready("d", 1, 256)
    stats = host.staging_stats()
    assert (stats.received, stats.responses, stats.watermarks) == (3, 1, 1)


def test_dispatch_routes_by_type_and_ignores_foreign_messages() -> None:
    """_dispatch_staging routes the four types and returns False for anything else."""
    host = prefill_host()
    assert host._dispatch_staging(WatermarkUpdate(1, 0, "d").to_frames())
    assert host._dispatch_staging(StagingRsp(1, 0, 0, 0, 8, "d").to_frames())
    assert not host._dispatch_staging([b"BOOTSTRAP", b"x"])
    assert not host._dispatch_staging([])
    assert host.staging_stats().received == 2


def test_prefill_messages_on_a_decode_host_are_dropped() -> None:
    """A decode host has no region book: a stray STAGING_RSP is dropped and counted."""
    host, _ = decode_host()
    assert host._handle_staging_rsp(StagingRsp(1, 0, 0, 0, 8, "d").to_frames()) is None
    assert not host._handle_watermark(WatermarkUpdate(1, 0, "d").to_frames())
    assert not host._is_watermark_ready("d", 0, 8)
    assert host.staging_stats().dropped == 2


def test_host_without_context_reports_zero_stats() -> None:
    """Without a staging context the counters read as zeros."""
    assert Host().staging_stats() == StagingStats()
