"""Golden vectors: the reference implementation's own outputs, matched entry by entry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from staging_contracts._staging.allocator import StagingAllocator, is_watermark_ready
from staging_contracts._staging.layout import compute_head_slice_params, compute_staging_layout
from staging_contracts.protocols import Allocation, Watermark

VECTORS = Path(__file__).resolve().parent / "data" / "reference_staging.json"
"""Vendored in the repository (``tests/data/README.md`` says where it came from)."""


def _load() -> dict[str, Any]:
    if not VECTORS.is_file():
        # Collected at import time on purpose: a missing file fails the run, never skips.
        raise FileNotFoundError(f"golden vectors missing: {VECTORS}")
    data: dict[str, Any] = json.loads(VECTORS.read_text())
    return data


DATA = _load()


def _case_id(case: dict[str, Any]) -> str:
    return "-".join(
        f"{key}{case[key]}"
        for key in ("total_kv_heads", "prefill_tp", "decode_tp", "prefill_rank", "decode_rank")
        if key in case
    )


@pytest.mark.parametrize("case", DATA["head_slices"], ids=_case_id)
def test_head_slice(case: dict[str, Any]) -> None:
    """Computes the reference's head slice for every prefill/decode rank pair."""
    result = compute_head_slice_params(
        case["prefill_tp"],
        case["decode_tp"],
        case["prefill_rank"],
        case["decode_rank"],
        case["total_kv_heads"],
    )
    assert result == (case["src_head_start"], case["num_heads"], case["dst_head_start"])


@pytest.mark.parametrize("case", DATA["layouts"], ids=_case_id)
def test_layout(case: dict[str, Any]) -> None:
    """Computes the reference's staging layout: writer count, writer sizes and total."""
    layout = compute_staging_layout(
        case["prefill_tp"],
        case["decode_tp"],
        case["decode_rank"],
        case["total_kv_heads"],
        case["num_tokens"],
        case["bytes_per_head_token"],
        case["num_layers"],
    )
    assert layout.num_writers == case["num_writers"]
    assert list(layout.writer_bytes) == case["writer_bytes"]
    assert layout.total_bytes == case["total_bytes"]
    offsets = [sum(case["writer_bytes"][:w]) for w in range(case["num_writers"])]
    assert list(layout.writer_offsets) == offsets


@pytest.mark.parametrize(
    "trace",
    DATA["allocator_traces"],
    ids=[f"trace{i}" for i in range(len(DATA["allocator_traces"]))],
)
def test_allocator_trace(trace: dict[str, Any]) -> None:
    """Replays a reference trace: every result, watermark and readiness of every live region."""
    ring = StagingAllocator(trace["total_size"])
    live: dict[int, Allocation] = {}
    for number, step in enumerate(trace["steps"]):
        where = f"step {number}: {step}"
        if step["op"] == "assign":
            allocation = ring.assign(step["size"])
            if step["result"] is None:
                assert allocation is None, where
            else:
                assert allocation is not None, where
                assert [allocation.alloc_id, allocation.offset, allocation.round] == step[
                    "result"
                ], where
                assert allocation.end == allocation.offset + step["size"], where
                live[allocation.alloc_id] = allocation
        else:
            assert step["op"] == "free", where
            ring.free(step["alloc_id"])
            live.pop(step["alloc_id"], None)
        watermark = ring.get_watermark()
        assert watermark == Watermark(*step["watermark"]), where
        ready = {
            str(alloc_id): is_watermark_ready(watermark, a.round, a.end)
            for alloc_id, a in live.items()
        }
        assert ready == step["ready"], where
        assert ring.live_count == len(live), where


def test_vectors_cover_every_section() -> None:
    """Holds entries in every section, so an emptied file cannot pass silently."""
    assert DATA["head_slices"]
    assert DATA["layouts"]
    assert DATA["allocator_traces"]
