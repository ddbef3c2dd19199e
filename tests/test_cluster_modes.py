"""The anchors' paths in the rank processes (TransferConfig.mode per-token and raw), warm-up
requests, and what they are built from: transfer plans, raw shares, PLAIN_DONE, the book."""

from __future__ import annotations

import ctypes
import multiprocessing

import pytest
import torch

from staging_contracts._cluster.bootstrap import MAX_POOL_POINTERS, RankInfo
from staging_contracts._cluster.plain_paths import (
    MOONCAKE_MAX_TRANSFERS_PER_WRITE,
    ArrivalBook,
    PlainDone,
    RoomWaiter,
    per_token_batch,
    per_token_writes,
    pool_pointers,
    pool_regions,
    raw_offset,
    raw_request_bytes,
    raw_share,
    verify_raw,
)
from staging_contracts._cluster.runner import run_cluster
from staging_contracts._control.wire import MalformedMessage
from staging_contracts._run.workload import (
    TransferConfig,
    fill_prefill_pool,
    request_plans,
    verify_decode_pool,
    warmup_plans,
)
from staging_contracts._staging.layout import decode_ranks_for_prefill
from staging_contracts.backends._kv_requests import KVPoll
from staging_contracts.engines import engine_available
from staging_contracts.protocols import Transfer


def _marks(name: str) -> list[pytest.MarkDecorator]:
    """The engine's marker, and a skip where it cannot be imported."""
    available, why = engine_available(name)
    return [getattr(pytest.mark, name), pytest.mark.skipif(not available, reason=why)]


TP_PAIRS = [(4, 2, 8), (1, 4, 2), (2, 4, 8), (4, 1, 2), (4, 4, 2)]


def small(prefill_tp: int = 4, decode_tp: int = 2, heads: int = 8, **kw: object) -> TransferConfig:
    return TransferConfig(
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        kv_heads=heads,
        layers=2,
        head_dim=16,
        tokens=40,
        page_size=16,
        requests=2,
        chunk_tokens=16,
        ring_chunks=2,
        **kw,  # type: ignore[arg-type]  # fields of TransferConfig
    )


def _copy(transfers: list[Transfer]) -> None:
    for t in transfers:
        ctypes.memmove(t.remote, t.local, t.length)


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "heads"), TP_PAIRS)
@pytest.mark.parametrize("separate_layers", [False, True])
def test_per_token_writes_fill_every_decode_pool_exactly(
    prefill_tp: int, decode_tp: int, heads: int, separate_layers: bool
) -> None:
    """Carried out by hand (memmove), the planned transfers leave every decode pool bit-exact
    (checked from first principles), with one transfer per (K/V, layer, token)."""
    config = small(prefill_tp, decode_tp, heads, separate_layers=separate_layers)
    prefill = [config.empty_pool(prefill_tp, p) for p in range(prefill_tp)]
    for rank, pool in enumerate(prefill):
        fill_prefill_pool(pool, config, rank)
    decode = [config.empty_pool(decode_tp, d) for d in range(decode_tp)]
    tokens = config.num_pages * config.page_size
    for plan in request_plans(config):
        for p in range(prefill_tp):
            for d in decode_ranks_for_prefill(prefill_tp, decode_tp, p):
                calls = per_token_writes(
                    config, plan, p, pool_pointers(prefill[p]), d, pool_pointers(decode[d]), 16
                )
                assert [len(c) for c in calls] == [16, 16, 16] * 2 * config.layers
                assert sum(len(c) for c in calls) == 2 * config.layers * tokens
                for call in calls:
                    _copy(call)
    for d, pool in enumerate(decode):
        assert verify_decode_pool(pool, config, d) == []


def test_per_token_writes_in_one_call_and_refusals() -> None:
    """Batch 0 is one call for everything; a pool of the wrong size or a rank that does not
    feed the decode rank is refused."""
    config = small()
    plan = request_plans(config)[0]
    ptrs = tuple(range(0, 4 * 1 << 20, 1 << 20))
    calls = per_token_writes(config, plan, 0, ptrs, 0, ptrs, 0)
    assert len(calls) == 1
    assert len(calls[0]) == 2 * config.layers * 48
    with pytest.raises(ValueError, match="tensor addresses"):
        per_token_writes(config, plan, 0, ptrs[:2], 0, ptrs, 0)
    with pytest.raises(ValueError, match="does not feed"):
        per_token_writes(config, plan, 0, ptrs, 1, ptrs, 0)


def test_batching_follows_the_reference_per_engine() -> None:
    assert per_token_batch("nixl", 4096) == 0
    assert per_token_batch("mooncake", 512) == 512
    assert per_token_batch("mooncake", 4096) == MOONCAKE_MAX_TRANSFERS_PER_WRITE
    assert per_token_batch(None, 300) == 300


def test_pool_regions_merge_views_of_one_allocation() -> None:
    fused = small().empty_pool(4, 0)
    separate = small(separate_layers=True).empty_pool(4, 0)
    assert len(pool_regions(fused)) == 1
    assert pool_regions(fused)[0][1] == sum(t.numel() * 2 for t in fused.k_buffers) * 2
    assert len(pool_regions(separate)) <= 2 * small().layers


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "heads"), TP_PAIRS)
def test_raw_shares_tile_each_decode_buffer_and_are_checked_byte_for_byte(
    prefill_tp: int, decode_tp: int, heads: int
) -> None:
    """Every writer's share lands at its own offset, the shares fill the buffer exactly, and
    one wrong byte is found."""
    config = small(prefill_tp, decode_tp, heads)
    for d in range(decode_tp):
        buffer = torch.zeros(config.requests * raw_request_bytes(config, d), dtype=torch.uint8)
        filled = 0
        for index in range(config.requests):
            for p in range(prefill_tp):
                if d not in decode_ranks_for_prefill(prefill_tp, decode_tp, p):
                    continue
                share = raw_share(config, index, p, d)
                start = raw_offset(config, index, p, d)
                buffer[start : start + share.numel()] = share
                filled += share.numel()
        assert filled == buffer.numel()
        assert verify_raw(buffer, config, d, range(config.requests)) == []
        buffer[buffer.numel() // 2] ^= 1
        assert len(verify_raw(buffer, config, d, range(config.requests))) == 1


def test_plain_done_codec_is_strict() -> None:
    message = PlainDone(1001, 3, ok=False)
    assert PlainDone.from_frames(message.to_frames()) == message
    for frames in (
        [b"PLAIN_DONE", b"1", b"2"],
        [b"PLAIN_DONE", b"x", b"2", b"1"],
        [b"PLAIN_DONE", b"1", b"2", b"yes"],
        [b"STAGING_REQ", b"1", b"2", b"1"],
    ):
        with pytest.raises(MalformedMessage):
            PlainDone.from_frames(frames)


def test_arrival_book_completes_a_room_with_its_last_writer() -> None:
    """SUCCESS once every writer said ok, FAILED when one did not; duplicates, strangers and
    unknown rooms are malformed; only the named writer's listener may report."""
    book = ArrivalBook([2, 3], {2: "tcp://p2", 3: "tcp://p3"})
    book.expect([7, 8])
    waiter = RoomWaiter(book, 7)
    assert waiter.wait(0.0) is KVPoll.Transferring
    book.on_message(PlainDone(7, 2, ok=True).to_frames())
    assert book.done_at(7) is None
    with pytest.raises(MalformedMessage):
        book.on_message(PlainDone(7, 2, ok=True).to_frames())
    book.on_message(PlainDone(7, 3, ok=True).to_frames())
    assert waiter.wait(0.0) is KVPoll.Success
    assert book.done_at(7) is not None
    book.on_message(PlainDone(8, 2, ok=False).to_frames())
    book.on_message(PlainDone(8, 3, ok=True).to_frames())
    assert book.wait(8, 0.0) is KVPoll.Failed
    assert book.failure(8) == "prefill ranks [2] failed their writes"
    for frames in (PlainDone(9, 2, ok=True).to_frames(), PlainDone(8, 1, ok=True).to_frames()):
        with pytest.raises(MalformedMessage):
            book.on_message(frames)
    assert book.malformed == 3
    assert book.authorize(PlainDone(7, 2, ok=True).to_frames(), "tcp://p2")
    assert not book.authorize(PlainDone(7, 2, ok=True).to_frames(), "tcp://p3")
    assert book.authorize([b"PING"], "tcp://anyone")


def test_rank_info_carries_pool_pointers_checked() -> None:
    info = RankInfo("decode", 0, "tcp://h:1", "d0", b"m", pool_ptrs=(1, 2, 2**64 - 1))
    assert RankInfo.from_json(info.to_json()) == info
    for bad in ([-1], ["1"], [True], list(range(MAX_POOL_POINTERS + 1)), 5):
        with pytest.raises(ValueError, match="pool_ptrs"):
            RankInfo.from_json(info.to_json() | {"pool_ptrs": bad})


def test_config_refuses_unknown_modes_devices_and_faults_outside_staging() -> None:
    with pytest.raises(ValueError, match="mode="):
        TransferConfig(mode="bulk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device="):
        TransferConfig(device="mps")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup_requests"):
        TransferConfig(warmup_requests=-1)
    with pytest.raises(ValueError, match="fail_rooms"):
        TransferConfig(mode="raw", fail_rooms=(0,))


def test_warmup_requests_repeat_timed_ones_in_rooms_of_their_own() -> None:
    config = small(warmup_requests=3)
    timed = request_plans(config)
    warm = warmup_plans(config)
    assert [w.index for w in warm] == [0, 1, 0]
    assert [w.decode_pages for w in warm] == [timed[i].decode_pages for i in (0, 1, 0)]
    assert len({w.room for w in warm} | {t.room for t in timed}) == 5


# Each mode over each engine and on both sides of the TP pair, without the full product:
# the plans themselves are checked for every TP pair above, in-process; what processes add
# is the engine, and the transfer bench's live test runs both modes over both engines too.
@pytest.mark.parametrize(
    ("backend", "mode", "prefill_tp", "decode_tp", "heads"),
    [
        pytest.param("nixl", "per-token", 2, 4, 8, marks=_marks("nixl")),
        pytest.param("mooncake", "per-token", 4, 1, 2, marks=_marks("mooncake")),
        pytest.param("mooncake", "raw", 2, 4, 8, marks=_marks("mooncake")),
        pytest.param("nixl", "raw", 4, 1, 2, marks=_marks("nixl")),
    ],
)
def test_anchor_modes_run_in_the_rank_processes_verified(
    backend: str, mode: str, prefill_tp: int, decode_tp: int, heads: int
) -> None:
    """The per-token and raw paths, after a warm-up request, move exactly the staged path's
    bytes through the same processes, verified on decode, with every clock stamped."""
    config = small(prefill_tp, decode_tp, heads, backend=backend, mode=mode, warmup_requests=1)
    result = run_cluster(config, timeout_s=180)
    assert result.verified, [r.fields.trace or r.fields.problems for r in result.reports]
    # What the staged path's writers stage for each decode rank (replicated heads included).
    staged = sum(raw_request_bytes(config, d) for d in range(decode_tp))
    assert result.bytes_moved == config.requests * staged
    for report in result.reports:
        assert report.exitcode == 0
        assert report.fields.registered_after == 0
        assert report.fields.mode == mode
    for report in result.ranks("decode"):
        assert report.fields.malformed == 0
    assert sorted(result.request_latencies_s()) == list(range(config.requests))
    assert multiprocessing.active_children() == []


# Warm-up is the ranks' own logic, the same over every engine: one engine shows it.
@pytest.mark.parametrize("backend", [pytest.param("nixl", marks=_marks("nixl"))])
def test_staged_warmup_is_not_counted_and_pages_verify(backend: str) -> None:
    """Two warm-up requests first: the timed figures count the timed requests only."""
    config = small(backend=backend, warmup_requests=2)
    result = run_cluster(config, timeout_s=180)
    assert result.verified, [r.fields.trace for r in result.reports]
    assert result.bytes_moved == config.requests * config.request_bytes
    assert result.chunks == config.decode_tp * config.requests * 3
