"""Tests of the head-slice and staging-region math."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from staging_contracts._staging.layout import (
    HeadSlice,
    StagingLayout,
    WriterPlacement,
    compute_head_slice_params,
    compute_staging_layout,
    decode_ranks_for_prefill,
    heads_per_rank,
    num_writers,
    prefill_ranks_for_decode,
    validate_tp_pair,
    writer_index,
    writer_placements,
)

SIZES = [1, 2, 3, 4, 6, 8, 12, 16, 32]


def global_heads(total_kv_heads: int, tp: int, rank: int) -> list[int]:
    """The model-level head of each local head of a rank (replicated under GQA)."""
    if tp <= total_kv_heads:
        per_rank = total_kv_heads // tp
        return [rank * per_rank + j for j in range(per_rank)]
    return [rank // (tp // total_kv_heads)]


def is_valid(prefill_tp: int, decode_tp: int, total_kv_heads: int) -> bool:
    """Whether the configuration is one the layout supports."""
    try:
        validate_tp_pair(prefill_tp, decode_tp, total_kv_heads)
    except ValueError:
        return False
    return True


def test_fan_in_head_slices() -> None:
    """Sends every local head of each prefill rank to its slot of the decode rank (P > D)."""
    assert compute_head_slice_params(4, 2, 0, 0, 8) == HeadSlice(0, 2, 0)
    assert compute_head_slice_params(4, 2, 1, 0, 8) == HeadSlice(0, 2, 2)
    assert compute_head_slice_params(4, 2, 3, 1, 8) == HeadSlice(0, 2, 2)


def test_fan_out_head_slices() -> None:
    """Sends each decode rank its slice of the single prefill rank feeding it (P < D)."""
    assert compute_head_slice_params(2, 4, 0, 1, 8) == HeadSlice(2, 2, 0)
    assert compute_head_slice_params(2, 4, 1, 2, 8) == HeadSlice(0, 2, 0)
    # GQA replication on decode: consecutive decode ranks share one head.
    assert compute_head_slice_params(1, 8, 0, 5, 2) == HeadSlice(1, 1, 0)


def test_rank_mapping_fan_in() -> None:
    """Maps decode ranks to their k = P // D prefill feeders and back (P > D)."""
    assert prefill_ranks_for_decode(8, 2, 1) == range(4, 8)
    assert decode_ranks_for_prefill(8, 2, 5) == range(1, 2)
    assert writer_index(8, 2, 5) == 1
    assert num_writers(8, 2) == 4


def test_rank_mapping_fan_out() -> None:
    """Maps a prefill rank to the D // P decode ranks it feeds, one writer each (P <= D)."""
    assert prefill_ranks_for_decode(2, 8, 5) == range(1, 2)
    assert decode_ranks_for_prefill(2, 8, 1) == range(4, 8)
    assert writer_index(2, 8, 1) == 0
    assert num_writers(2, 8) == 1
    assert num_writers(4, 4) == 1


def test_staging_layout_offsets() -> None:
    """Places writers back to back with their sizes and offsets."""
    layout = compute_staging_layout(4, 2, 1, 8, 16, 256, 3)
    writer = 16 * 2 * 256 * 3 * 2
    assert layout == StagingLayout(2, (writer, writer), 2 * writer, (0, writer))


def test_writer_placements() -> None:
    """Builds a decode rank's placements from the layout and the head slices."""
    placements = writer_placements(4, 2, 1, 8, 16, 256, 3)
    writer = 16 * 2 * 256 * 3 * 2
    assert placements == (WriterPlacement(0, 0, 2), WriterPlacement(writer, 2, 2))


def test_heads_per_rank() -> None:
    """Gives each rank its share of the heads, at least one."""
    assert heads_per_rank(8, 2) == 4
    assert heads_per_rank(2, 8) == 1


def test_rejects_tp_sizes_that_do_not_divide() -> None:
    """Rejects TP sizes that do not divide one another, naming both."""
    with pytest.raises(ValueError, match=r"^prefill_tp=3 and decode_tp=2 must divide one another$"):
        num_writers(3, 2)


def test_rejects_non_positive_tp() -> None:
    """Rejects a TP size below one, naming it."""
    with pytest.raises(ValueError, match=r"^decode_tp=0 must be >= 1$"):
        prefill_ranks_for_decode(2, 0, 0)


def test_rejects_heads_that_do_not_divide() -> None:
    """Rejects a head count that neither divides nor is divided by a TP size."""
    with pytest.raises(
        ValueError, match=r"^total_kv_heads=6 and decode_tp=4 must divide one another$"
    ):
        compute_head_slice_params(2, 4, 0, 0, 6)


def test_rejects_non_positive_heads() -> None:
    """Rejects a head count below one instead of guessing it."""
    with pytest.raises(ValueError, match=r"^total_kv_heads=0 must be >= 1$"):
        compute_staging_layout(2, 2, 0, 0, 16, 256, 1)


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("num_tokens", (0, 256, 1)),
        ("bytes_per_head_token", (16, -1, 1)),
        ("num_layers", (16, 256, 0)),
    ],
)
def test_rejects_non_positive_region_sizes(name: str, args: tuple[int, int, int]) -> None:
    """Rejects a non-positive token count, head size or layer count, naming it."""
    with pytest.raises(ValueError, match=rf"^{name}=-?\d+ must be >= 1$"):
        compute_staging_layout(2, 2, 0, 8, *args)


def test_rejects_rank_out_of_range() -> None:
    """Rejects a rank outside its TP size."""
    with pytest.raises(ValueError, match=r"^decode_rank=2 is out of range for TP size 2$"):
        compute_staging_layout(4, 2, 2, 8, 16, 256, 1)
    with pytest.raises(ValueError, match=r"^prefill_rank=-1 is out of range for TP size 4$"):
        writer_index(4, 2, -1)


def test_rejects_rank_pair_that_does_not_feed() -> None:
    """Rejects a prefill rank that does not write to the decode rank."""
    with pytest.raises(
        ValueError, match=r"^prefill rank src_rank=2 does not feed decode rank dst_rank=0 "
    ):
        compute_head_slice_params(4, 2, 2, 0, 8)


@settings(max_examples=300, deadline=None)
@given(
    prefill_tp=st.sampled_from(SIZES),
    decode_tp=st.sampled_from(SIZES),
    total_kv_heads=st.sampled_from(SIZES),
    num_tokens=st.integers(1, 64),
    bytes_per_head_token=st.sampled_from([1, 2, 64, 256]),
    num_layers=st.integers(1, 4),
)
def test_writers_cover_every_decode_head(
    *,
    prefill_tp: int,
    decode_tp: int,
    total_kv_heads: int,
    num_tokens: int,
    bytes_per_head_token: int,
    num_layers: int,
) -> None:
    """Covers each head of every decode rank with the right model head; sizes add up."""
    assume(is_valid(prefill_tp, decode_tp, total_kv_heads))
    dst_heads = heads_per_rank(total_kv_heads, decode_tp)
    for d in range(decode_tp):
        feeders = prefill_ranks_for_decode(prefill_tp, decode_tp, d)
        assert len(feeders) == num_writers(prefill_tp, decode_tp)
        written = [0] * dst_heads
        heads_sent = 0
        for position, p in enumerate(feeders):
            assert writer_index(prefill_tp, decode_tp, p) == position
            assert d in decode_ranks_for_prefill(prefill_tp, decode_tp, p)
            head_slice = compute_head_slice_params(prefill_tp, decode_tp, p, d, total_kv_heads)
            src = global_heads(total_kv_heads, prefill_tp, p)
            dst = global_heads(total_kv_heads, decode_tp, d)
            for j in range(head_slice.num_heads):
                assert src[head_slice.src_head_start + j] == dst[head_slice.dst_head_start + j]
                written[head_slice.dst_head_start + j] += 1
            heads_sent += head_slice.num_heads
        assert min(written) >= 1
        if prefill_tp <= total_kv_heads:
            assert written == [1] * dst_heads  # no prefill replication: exactly once
        layout = compute_staging_layout(
            prefill_tp,
            decode_tp,
            d,
            total_kv_heads,
            num_tokens,
            bytes_per_head_token,
            num_layers,
        )
        assert layout.num_writers == len(feeders)
        assert sum(layout.writer_bytes) == layout.total_bytes
        assert layout.total_bytes == num_tokens * heads_sent * bytes_per_head_token * num_layers * 2
        assert layout.writer_offsets == tuple(
            sum(layout.writer_bytes[:w]) for w in range(layout.num_writers)
        )
    for p in range(prefill_tp):
        for d in decode_ranks_for_prefill(prefill_tp, decode_tp, p):
            assert p in prefill_ranks_for_decode(prefill_tp, decode_tp, d)


def test_counts_and_indices_are_ints() -> None:
    """Returns writer counts and writer indices as ints, never floats."""
    assert type(num_writers(8, 2)) is int
    assert type(writer_index(8, 2, 5)) is int
    assert type(heads_per_rank(8, 2)) is int


def test_single_head_model_is_supported() -> None:
    """Accepts a model of one KV head, replicated on every rank."""
    assert heads_per_rank(1, 4) == 1
    validate_tp_pair(2, 4, 1)
    assert compute_head_slice_params(2, 4, 1, 3, 1) == HeadSlice(0, 1, 0)


@pytest.mark.parametrize(
    ("total_kv_heads", "tp", "match"),
    [
        (8, 0, r"^tp=0 must be >= 1$"),
        (0, 2, r"^total_kv_heads=0 must be >= 1$"),
        (6, 4, r"^total_kv_heads=6 and tp=4 must divide one another$"),
    ],
    ids=["tp-positive", "heads-positive", "heads-divide"],
)
def test_heads_per_rank_names_the_broken_rule(total_kv_heads: int, tp: int, match: str) -> None:
    """Rejects an invalid head count or TP size, naming the argument and the rule."""
    with pytest.raises(ValueError, match=match):
        heads_per_rank(total_kv_heads, tp)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 2, None), r"^prefill_tp=0 must be >= 1$"),
        ((-1, 2, None), r"^prefill_tp=-1 must be >= 1$"),
        ((2, -3, None), r"^decode_tp=-3 must be >= 1$"),
        ((4, 6, None), r"^prefill_tp=4 and decode_tp=6 must divide one another$"),
        ((4, 4, 6), r"^total_kv_heads=6 and prefill_tp=4 must divide one another$"),
        ((2, 4, 6), r"^total_kv_heads=6 and decode_tp=4 must divide one another$"),
        ((2, 2, -1), r"^total_kv_heads=-1 must be >= 1$"),
    ],
    ids=[
        "prefill-zero",
        "prefill-negative",
        "decode-negative",
        "tp-divide",
        "heads-prefill",
        "heads-decode",
        "heads-positive",
    ],
)
def test_validate_tp_pair_names_the_broken_rule(
    args: tuple[int, int, int | None], match: str
) -> None:
    """Rejects an invalid TP pair or head count, naming the argument and the rule."""
    with pytest.raises(ValueError, match=match):
        validate_tp_pair(*args)


def test_rank_errors_name_the_rank_argument() -> None:
    """Names which rank argument is out of range, and against which TP size."""
    with pytest.raises(ValueError, match=r"^prefill_rank=2 is out of range for TP size 2$"):
        decode_ranks_for_prefill(2, 4, 2)
    with pytest.raises(ValueError, match=r"^prefill_rank=-1 is out of range for TP size 4$"):
        decode_ranks_for_prefill(4, 2, -1)
    with pytest.raises(ValueError, match=r"^decode_rank=4 is out of range for TP size 4$"):
        prefill_ranks_for_decode(2, 4, 4)
    with pytest.raises(ValueError, match=r"^src_rank=4 is out of range for TP size 4$"):
        compute_head_slice_params(4, 2, 4, 0, 8)
    with pytest.raises(ValueError, match=r"^decode_rank=2 is out of range for TP size 2$"):
        compute_head_slice_params(4, 2, 0, 2, 8)


def test_rank_pair_error_lists_the_feeders() -> None:
    """Names the pair, the TP sizes and the decode rank's feeders when a rank does not feed."""
    with pytest.raises(
        ValueError,
        match=r"^prefill rank src_rank=2 does not feed decode rank dst_rank=0 at src_tp=4, "
        r"dst_tp=2 \(its feeders are 0\.\.1\)$",
    ):
        compute_head_slice_params(4, 2, 2, 0, 8)
    with pytest.raises(
        ValueError,
        match=r"^prefill rank src_rank=0 does not feed decode rank dst_rank=3 at src_tp=2, "
        r"dst_tp=4 \(its feeders are 1\.\.1\)$",
    ):
        compute_head_slice_params(2, 4, 0, 3, 8)


def test_staging_layout_checks_heads_before_the_rank() -> None:
    """Reports an invalid head count before a decode rank out of range."""
    with pytest.raises(ValueError, match=r"^total_kv_heads=0 must be >= 1$"):
        compute_staging_layout(2, 2, 5, 0, 16, 256, 1)
    with pytest.raises(ValueError, match=r"^total_kv_heads=6 and decode_tp=4 must divide"):
        writer_placements(2, 4, 9, 6, 16, 256, 1)
