"""The bench's KV geometry (``bench.anchor_geometry``): the share each prefill rank sends."""

from __future__ import annotations

import pytest

from staging_contracts._bench.anchor_geometry import BENCH_GEOMETRY, AnchorGeometry

# P < D: 4 heads on prefill into 2 on decode, two layers, a partial last page.
SMALL_P_LT_D = AnchorGeometry(2, 4, 2, 16, 2, tokens=40, page_size=4)


def test_bench_geometry_is_the_request_share() -> None:
    """The bench geometry sends 512-byte slices at head offset 2, 128 MiB per prefill rank."""
    assert BENCH_GEOMETRY.slice_bytes == 512
    assert BENCH_GEOMETRY.head_offsets_bytes == (0, 512)
    assert BENCH_GEOMETRY.share_bytes() == 128 << 20
    assert 4 * BENCH_GEOMETRY.share_bytes() == 512 << 20
    assert SMALL_P_LT_D.head_offsets_bytes == (64, 0)


def test_geometry_rejects_heads_that_do_not_divide() -> None:
    """Head counts where neither divides the other, and empty sizes, raise ValueError."""
    with pytest.raises(ValueError, match="multiple of the smaller"):
        AnchorGeometry(2, 3, 4, 16, 2, tokens=8)
    with pytest.raises(ValueError, match=r"^layers=0 must be >= 1$"):
        AnchorGeometry(0, 2, 4, 16, 2, tokens=8)
