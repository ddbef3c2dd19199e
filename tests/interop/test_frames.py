"""The four staging messages, both ways, against the reference's own encoders and decoders.

Ours -> theirs: our records' frames are handed to the reference's handlers
(``handle_staging_req``, ``handle_staging_rsp``, ``handle_watermark_msg``,
``CommonKVManager.handle_chunk_ready``) and what they did is checked. Theirs -> ours: what the
reference sends (``handle_staging_req``'s answer, ``prefetch_staging_reqs`` over a real ZMQ
socket, ``DecodeStagingHandler._send_watermark``, ``CommonKVManager.send_chunk_ready``) is
decoded by ``decode_message`` and compared field by field.
"""

from __future__ import annotations

from typing import Any

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from staging_contracts import KVArgsRecord
from staging_contracts._control.wire import (
    ALLOC_OVERSIZED,
    ChunkReady,
    Message,
    StagingReq,
    StagingRsp,
    WatermarkUpdate,
    decode_message,
)
from staging_contracts._staging.layout import compute_staging_layout
from tests.interop._fakes import (
    ArrivalLog,
    ChunkReadySender,
    PrefillInfo,
    Receiver,
    RecordingSocket,
    TransferInfo,
)
from tests.interop._reference import Reference, cpu_staging_allocator

EXAMPLES = settings(max_examples=150, deadline=None)

I64 = 2**63 - 1
rooms = st.integers(0, I64)
small = st.integers(0, 64)
sessions = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=64)

# Decode rank 1 of TP 2, 8 KV heads of 128 x bf16, 2 layers, pages of 16 tokens.
DECODE_ARGS = KVArgsRecord(
    page_size=16,
    kv_item_lens=(16 * 4 * 128 * 2,) * 4,
    engine_rank=1,
    device="cpu",
    total_kv_head_num=8,
    kv_head_num=4,
    kv_layer_ids=(0, 1),
)
PREFILL_TP = 4
RING_BYTES = 1 << 24


def region_bytes(num_pages: int) -> int:
    """Our size of a chunk region of decode rank 1 (what the reference must allocate)."""
    layout = compute_staging_layout(PREFILL_TP, 2, 1, 8, num_pages * 16, 128 * 2, 2)
    return layout.total_bytes


class DecodeSide:
    """The reference's decode-side STAGING_REQ handling, with its allocator on the CPU and
    two prefill ranks (pipeline stages 0 and 1) to answer."""

    def __init__(self, reference: Reference, ring_bytes: int = RING_BYTES) -> None:
        self.reference = reference
        self.allocator = cpu_staging_allocator(reference, ring_bytes)
        self.sockets = {0: RecordingSocket(), 1: RecordingSocket()}
        self.receivers: dict[int, Receiver] = {}
        self.bootstrap: dict[int, list[dict[str, int]]] = {}

    def register(self, room: int) -> None:
        infos = [{"rank": 0, "pp_rank": 0}, {"rank": 1, "pp_rank": 1}]
        self.bootstrap[room] = infos
        self.receivers[room] = Receiver(infos, self.sockets, PrefillInfo(PREFILL_TP))

    def handle(self, frames: list[bytes]) -> dict[int, list[list[bytes]]]:
        """Run the reference's handle_staging_req; return what each prefill rank was sent."""
        self.reference.staging_handler.handle_staging_req(
            frames,
            self.allocator,
            DECODE_ARGS,
            2,
            PREFILL_TP,
            None,
            self.receivers,
            self.bootstrap,
        )
        return {rank: socket.take() for rank, socket in self.sockets.items()}


@EXAMPLES
@given(
    room=rooms,
    chunk_idx=small,
    num_pages=st.integers(1, 64),
    session=sessions,
    pp_rank=st.none() | st.integers(0, 1),
)
def test_our_staging_req_is_read_by_its_handler_and_its_answer_by_our_codec(
    reference: Reference,
    room: int,
    chunk_idx: int,
    num_pages: int,
    session: str,
    pp_rank: int | None,
) -> None:
    """Our STAGING_REQ (with and without pp_rank) drives its handle_staging_req: it allocates
    exactly our region size for that many pages, answers only the requesting pipeline stage
    (every stage without pp_rank), and its STAGING_RSP decodes with our codec."""
    decode = DecodeSide(reference)
    decode.register(room)
    sent = decode.handle(StagingReq(room, chunk_idx, num_pages, session, pp_rank).to_frames())
    answered = [rank for rank, messages in sent.items() if messages]
    assert answered == ([0, 1] if pp_rank is None else [pp_rank])
    for rank in answered:
        (frames,) = sent[rank]
        answer = decode_message(frames)
        assert isinstance(answer, StagingRsp)
        assert (answer.room, answer.chunk_idx, answer.session_id) == (room, chunk_idx, session)
        assert answer.end - answer.offset == region_bytes(num_pages)
        info = decode.receivers[room].chunk_staging_infos[chunk_idx]
        assert (info[1], info[2], info[3], info[4]) == (
            answer.offset,
            answer.round,
            answer.end,
            num_pages,
        )


def test_its_repeated_and_oversized_answers_decode_with_our_codec(reference: Reference) -> None:
    """A second request for an allocated chunk is answered with the same region; a chunk that
    can never fit is answered with offset -2 (round 0, end -1), our ALLOC_OVERSIZED."""
    ring = region_bytes(8)
    decode = DecodeSide(reference, ring_bytes=ring)
    decode.register(5)
    first = decode.handle(StagingReq(5, 0, 8, "d-1").to_frames())[0]
    again = decode.handle(StagingReq(5, 0, 8, "d-1").to_frames())[0]
    assert first == again
    assert decode_message(first[0]) == StagingRsp(5, 0, 0, 0, ring, "d-1")
    (refused,) = decode.handle(StagingReq(5, 1, 9, "d-1").to_frames())[0]
    assert refused == [b"STAGING_RSP", b"5", b"1", b"-2", b"0", b"-1", b"d-1"]
    answer = decode_message(refused)
    assert answer == StagingRsp.oversized(5, 1, "d-1")
    assert isinstance(answer, StagingRsp)
    assert answer.is_oversized
    assert (
        answer.offset
        == ALLOC_OVERSIZED
        == reference.staging_buffer.StagingAllocator.ALLOC_OVERSIZED
    )


@pytest.mark.parametrize(
    ("pages", "chunked_prefill_size", "pp_rank"),
    [(1, 16, None), (5, 32, None), (40, 128, 0), (40, 128, 3), (9, 8192, 1)],
)
def test_its_prefetched_staging_reqs_cross_a_real_socket_and_decode_with_our_codec(
    reference: Reference, pages: int, chunked_prefill_size: int, pp_rank: int | None
) -> None:
    """Its prefill's prefetch_staging_reqs sends one STAGING_REQ per chunk (with the
    requester's pp_rank when it has one) over its own ZMQ socket to our PULL socket; each
    decodes to the StagingReq we expect."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pull = context.socket(zmq.PULL)
    sockets: dict[str, Any] = {}
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        info = TransferInfo("127.0.0.1", port, list(range(100, 100 + pages)))
        reference.staging_handler.prefetch_staging_reqs(
            9,
            {9: {"decode-session": info}},
            {"page_size": 16},
            chunked_prefill_size,
            set(),
            sockets,
            requester_pp_rank=pp_rank,
        )
        grid_pages = max(1, chunked_prefill_size // 16)
        expected = [
            StagingReq(9, c, min(grid_pages, pages - c * grid_pages), "decode-session", pp_rank)
            for c in range(-(-pages // grid_pages))
        ]
        received: list[Message] = []
        while len(received) < len(expected) and pull.poll(5000):
            received.append(decode_message(pull.recv_multipart()))
        assert received == expected
        assert not pull.poll(50)
    finally:
        for socket in sockets.values():  # each in a context of its own, which it leaves open
            owner = socket.context
            socket.close(linger=0)
            owner.term()
        pull.close(linger=0)


@EXAMPLES
@given(
    room=rooms,
    chunk_idx=small,
    session=sessions,
    region=st.none()
    | st.tuples(st.integers(0, I64 - 10**9), st.integers(0, 1000), st.integers(1, 10**9)),
)
def test_our_staging_rsp_is_read_by_its_handler(
    reference: Reference,
    room: int,
    chunk_idx: int,
    session: str,
    region: tuple[int, int, int] | None,
) -> None:
    """Our STAGING_RSP (a region, or the oversized answer) lands in its transfer info as the
    (offset, round, end) of that chunk, for the session it names."""
    if region is None:
        rsp = StagingRsp.oversized(room, chunk_idx, session)
    else:
        offset, rnd, size = region
        rsp = StagingRsp(room, chunk_idx, offset, rnd, offset + size, session)
    info = TransferInfo()
    reference.staging_handler.handle_staging_rsp(rsp.to_frames(), {room: {session: info}})
    staging = info.staging
    assert (staging.offsets[chunk_idx], staging.rounds[chunk_idx], staging.ends[chunk_idx]) == (
        rsp.offset,
        rsp.round,
        rsp.end,
    )


@EXAMPLES
@given(rnd=st.integers(0, I64), tail=st.integers(0, I64), session=st.just("") | sessions)
def test_its_watermark_decodes_with_our_codec(
    reference: Reference, rnd: int, tail: int, session: str
) -> None:
    """Its decode's WATERMARK, with a session or with the empty session frame it sends for
    none, decodes as our WatermarkUpdate (the empty frame as no session)."""
    socket = RecordingSocket()
    receiver = Receiver([{"rank": 0, "pp_rank": 0}], {0: socket}, PrefillInfo(1))
    reference.staging_handler.DecodeStagingHandler._send_watermark(receiver, session, (rnd, tail))
    (frames,) = socket.take()
    assert frames == [b"WATERMARK", b"%d" % rnd, b"%d" % tail, session.encode()]
    assert decode_message(frames) == WatermarkUpdate(rnd, tail, session)


def test_its_empty_session_watermark_is_exactly_the_issue_frames(reference: Reference) -> None:
    """The frames of issue 17, produced by its code and accepted by ours."""
    socket = RecordingSocket()
    receiver = Receiver([{"rank": 0, "pp_rank": 0}], {0: socket}, PrefillInfo(1))
    reference.staging_handler.DecodeStagingHandler._send_watermark(receiver, "", (3, 4096))
    assert socket.take() == [[b"WATERMARK", b"3", b"4096", b""]]
    assert decode_message([b"WATERMARK", b"3", b"4096", b""]) == WatermarkUpdate(3, 4096)


@EXAMPLES
@given(rnd=st.integers(0, I64), tail=st.integers(0, I64), session=st.just("") | sessions)
def test_our_watermark_is_read_by_its_handler(
    reference: Reference, rnd: int, tail: int, session: str
) -> None:
    """Our WATERMARK (three frames without a session) moves its prefill's watermark of that
    session (its absent session is the empty one too)."""
    context = reference.staging_handler.PrefillStagingContext()
    frames = WatermarkUpdate(rnd, tail, session).to_frames()
    assert len(frames) == (3 if session == "" else 4)
    reference.staging_handler.handle_watermark_msg(context, frames)
    assert context.remote_watermarks.get(session, (0, 0)) == (rnd, tail)


@EXAMPLES
@given(
    room=rooms,
    chunk_idx=small,
    page_start=st.integers(0, 10**6),
    num_pages=st.integers(1, 10**6),
    writer=sessions,
    unique_rank=st.integers(0, 1024),
)
def test_its_chunk_ready_decodes_with_our_codec(
    reference: Reference,
    room: int,
    chunk_idx: int,
    page_start: int,
    num_pages: int,
    writer: str,
    unique_rank: int,
) -> None:
    """Its prefill's 7-frame CHUNK_READY (the decode session, then its unique rank) decodes
    as our ChunkReady with that writer rank, sent to the decode's endpoint."""
    sent: list[tuple[str, list[bytes]]] = []
    sender = ChunkReadySender(unique_rank, lambda endpoint, frames: sent.append((endpoint, frames)))
    reference.common_conn.CommonKVManager.send_chunk_ready(
        sender,
        room=room,
        chunk_idx=chunk_idx,
        page_start=page_start,
        num_pages=num_pages,
        writer_id=writer,
        targets=[("127.0.0.1", 4242)],
    )
    ((endpoint, frames),) = sent
    assert endpoint == "tcp://127.0.0.1:4242"
    assert len(frames) == 7
    assert decode_message(frames) == ChunkReady(
        room, chunk_idx, page_start, num_pages, writer, unique_rank
    )


@EXAMPLES
@given(
    room=rooms,
    chunk_idx=small,
    page_start=st.integers(0, 10**6),
    num_pages=st.integers(1, 10**6),
    session=sessions,
    writer_rank=st.none() | st.integers(0, 1024),
)
def test_our_chunk_ready_is_read_by_its_handler(
    reference: Reference,
    room: int,
    chunk_idx: int,
    page_start: int,
    num_pages: int,
    session: str,
    writer_rank: int | None,
) -> None:
    """Our CHUNK_READY, with or without the writer rank, is taken by its handle_chunk_ready
    and handed to its staging handler field by field."""
    log = ArrivalLog({room})
    frames = ChunkReady(room, chunk_idx, page_start, num_pages, session, writer_rank).to_frames()
    assert reference.common_conn.CommonKVManager.handle_chunk_ready(log, frames) is True
    assert log.arrivals == [(room, chunk_idx, page_start, num_pages, session)]
