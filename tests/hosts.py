"""Test support: a conforming staging handler, KV arguments and a common base like the real one."""

from __future__ import annotations

from staging_contracts import (
    ArrivalOutcome,
    KVArgs,
    KVArgsRecord,
    StagingReqOutcome,
)


class RecordingHandler:
    """A StagingHandler that records what it was given and answers fixed outcomes."""

    def __init__(self) -> None:
        self.requests: list[tuple[int, int, int, str, int | None]] = []
        self.arrivals: list[tuple[int, int, int, int, str, int | None]] = []

    def handle_staging_req(
        self, room: int, chunk_idx: int, *, num_pages: int, session_id: str, pp_rank: int | None
    ) -> StagingReqOutcome:
        self.requests.append((room, chunk_idx, num_pages, session_id, pp_rank))
        return StagingReqOutcome.ALLOCATED

    def handle_chunk_arrival(
        self,
        room: int,
        chunk_idx: int,
        *,
        page_start: int,
        num_pages: int,
        session_id: str,
        writer_rank: int | None,
    ) -> ArrivalOutcome:
        self.arrivals.append((room, chunk_idx, page_start, num_pages, session_id, writer_rank))
        return ArrivalOutcome.WAITING


def make_kv_args(engine_rank: int = 0) -> KVArgsRecord:
    """KV arguments of a decode rank of TP 2 with 8 KV heads."""
    return KVArgsRecord(
        page_size=16,
        kv_item_lens=(16 * 4 * 128 * 2,) * 4,
        engine_rank=engine_rank,
        device="cpu",
        total_kv_head_num=8,
        kv_head_num=4,
        kv_layer_ids=(0, 1),
    )


class CommonBase:
    """Like CommonKVManager: declares the KV arguments and the TP size, knows no staging."""

    kv_args: KVArgs
    attn_tp_size: int

    def __init__(self, attn_tp_size: object = 2) -> None:
        self.kv_args = make_kv_args()
        self.attn_tp_size = attn_tp_size  # type: ignore[assignment]  # tests pass bad values
