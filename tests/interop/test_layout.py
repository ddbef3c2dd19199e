"""Head slices and staging layouts against the reference's ``compute_head_slice_params`` and
``compute_staging_layout``, over every valid TP pair up to 8 and every head count from GQA
replication (fewer heads than ranks) to many heads per rank."""

from __future__ import annotations

import itertools

import pytest

from staging_contracts._staging.layout import (
    compute_head_slice_params,
    compute_staging_layout,
    prefill_ranks_for_decode,
    validate_tp_pair,
    writer_placements,
)
from tests.interop._reference import Reference

HEADS = (1, 2, 4, 8, 16, 32)
"""KV head counts: 1-4 replicate heads across TP 8 (GQA), 32 gives 4-32 heads per rank."""


def valid_cases() -> list[tuple[int, int, int]]:
    """Every (P, D, heads) with P, D in 1..8 that our layout accepts."""
    cases = []
    for prefill_tp, decode_tp, heads in itertools.product(range(1, 9), range(1, 9), HEADS):
        try:
            validate_tp_pair(prefill_tp, decode_tp, heads)
        except ValueError:
            continue
        cases.append((prefill_tp, decode_tp, heads))
    return cases


CASES = valid_cases()


def test_the_cases_cover_every_tp_pair_and_gqa() -> None:
    """Every TP pair up to 8 that divide one another is here, with GQA head counts."""
    pairs = {(p, d) for p, d, _ in CASES}
    assert pairs == {(p, d) for p in range(1, 9) for d in range(1, 9) if max(p, d) % min(p, d) == 0}
    assert any(h < max(p, d) for p, d, h in CASES)  # replicated heads
    assert any(p > d for p, d, _ in CASES)
    assert any(p < d for p, d, _ in CASES)


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "heads"), CASES)
def test_head_slices_and_layouts_agree(
    reference: Reference, prefill_tp: int, decode_tp: int, heads: int
) -> None:
    """For every decode rank and each prefill rank feeding it, the head slice is its head
    slice; its decode-side view (writer index as the source rank) puts each writer where
    ours does; and the region's writer sizes and total are its own."""
    buffer = reference.staging_buffer
    for decode_rank in range(decode_tp):
        feeders = prefill_ranks_for_decode(prefill_tp, decode_tp, decode_rank)
        for prefill_rank in feeders:
            mine = compute_head_slice_params(
                prefill_tp, decode_tp, prefill_rank, decode_rank, heads
            )
            theirs = buffer.compute_head_slice_params(
                prefill_tp, decode_tp, prefill_rank, decode_rank, heads
            )
            assert theirs == (
                mine.src_head_start,
                mine.num_heads,
                mine.dst_head_start,
                mine.num_heads,
            )
        for tokens, head_bytes, layers in ((16, 256, 2), (48, 2, 61), (1, 1, 1)):
            layout = compute_staging_layout(
                prefill_tp, decode_tp, decode_rank, heads, tokens, head_bytes, layers
            )
            their_layout = buffer.compute_staging_layout(
                prefill_tp, decode_tp, decode_rank, heads, tokens, head_bytes, layers
            )
            assert their_layout == (
                layout.num_writers,
                list(layout.writer_bytes),
                layout.total_bytes,
            )
            placements = writer_placements(
                prefill_tp, decode_tp, decode_rank, heads, tokens, head_bytes, layers
            )
            for writer, placement in enumerate(placements):
                _, count, dst_start, _ = buffer.compute_head_slice_params(
                    prefill_tp, decode_tp, writer, decode_rank, heads
                )
                assert (dst_start, count) == (placement.dst_head_start, placement.num_heads)
                assert placement.byte_offset == sum(layout.writer_bytes[:writer])


def test_its_head_count_resolution_matches_the_count_we_are_given(reference: Reference) -> None:
    """Its resolve_total_kv_heads takes the model's count when present, as ours always does
    (ours never guesses it from a per-rank count)."""
    from staging_contracts import KVArgsRecord

    args = KVArgsRecord(
        16, (4096,) * 4, 0, "cpu", total_kv_head_num=8, kv_head_num=1, kv_layer_ids=(0, 1)
    )
    assert reference.staging_buffer.resolve_total_kv_heads(args, 8) == 8
