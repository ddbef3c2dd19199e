"""The staging and contract bench groups, run once each in quick mode: rows' names, units,
notes and goals (none when quick: a smoke test), finite positive figures. No timing is
asserted (figures are for people)."""

from __future__ import annotations

import math

import pytest
import torch

from staging_contracts._bench import BenchOptions, BenchRow, contract_bench, staging_bench
from staging_contracts._contract.valuecheck import _ProtocolChecker
from staging_contracts.mixin import STAGING_CONTRACT

STAGING_ROWS = [  # name, unit, goal in full mode (quick rows have none)
    ("staging.gather.p4d2", "GB/s", ">= 0.5"),
    ("staging.scatter.p4d2", "GB/s", ">= 0.5"),
    ("staging.gather.p2d4-gqa", "GB/s", ">= 0.5"),
    ("staging.scatter.p2d4-gqa", "GB/s", ">= 0.5"),
    ("staging.gather.p1d4-gqa", "GB/s", ">= 0.5"),
    ("staging.scatter.p1d4-gqa", "GB/s", ">= 0.5"),
    ("staging.gather", "GB/s", ">= 0.5"),
    ("staging.scatter", "GB/s", ">= 0.5"),
    *(
        (f"staging.integrity.{what}.{case}", "ms/chunk", "<= 1.1" if what == "transfer" else "")
        for case in ("p4d2", "p2d4-gqa", "p1d4-gqa")
        for what in ("tag", "check", "transfer")
    ),
    ("staging.alloc-scaling", "ns/assign+free (@100k, @10 live)", "<= 1.2"),
    ("staging.alloc-scaling.anchor", "ns/assign+free (@100k, @10 live)", ""),
]

# What each head-slice row's note must state: the TP pair and heads, the rows moved.
HEAD_SLICE_NOTES = {
    "staging.gather.p4d2": ("P=4 -> D=2, 8 KV heads", "heads 0-1 of its 2", "whole 8192 B"),
    "staging.scatter.p4d2": (
        "P=4 -> D=2, 8 KV heads",
        "2 writers x 2 heads into its 4-head pool",
        "512 B pieces side by side in each 1024 B token row",
    ),
    "staging.gather.p2d4-gqa": ("P=2 -> D=4, 2 KV heads", "head 0 of its 1", "whole 4096 B"),
    "staging.scatter.p2d4-gqa": ("P=2 -> D=4, 2 KV heads", "1 writer x 1 head", "whole 4096 B"),
    "staging.gather.p1d4-gqa": (
        "P=1 -> D=4, 2 KV heads",
        "head 0 of its 2",
        "256 B of each 512 B token row",
    ),
    "staging.scatter.p1d4-gqa": ("P=1 -> D=4, 2 KV heads", "into its 1-head pool", "whole"),
}

CONTRACT_ROWS = [  # name, unit, goal in full mode (quick rows have none)
    ("contract.per-call", "ns/call", "<= 1.02"),
    ("contract.member-read", "ns/read", "<= 1.05"),
    ("contract.member-assign", "ns/assign", ""),
    ("contract.member-assign.unwatched", "ns/assign", ""),
    ("contract.instance-check", "us/check", "<= 0.3"),
    ("contract.instance-check.cold", "us/check", "<= 1.0"),
    ("contract.class-check", "us/class", ""),
]


def assert_finite_positive(rows: list[BenchRow]) -> None:
    for row in rows:
        for figure in (row.ours, row.anchor, row.ratio):
            assert math.isfinite(figure), row
            assert figure > 0, row


QUICK = "quick: smoke only"


@pytest.fixture(scope="module")
def staging_rows() -> list[BenchRow]:
    return staging_bench.run(BenchOptions(quick=True))


def test_staging_group_rows(staging_rows: list[BenchRow]) -> None:
    """Head-slice rows for P > D and P < D (GQA), gather and scatter each, then the
    all-heads and allocator rows; every figure finite and positive; ratio = ours / anchor;
    quick rows have no goal and say so first in their notes."""
    assert [(r.name, r.unit) for r in staging_rows] == [(n, u) for n, u, _ in STAGING_ROWS]
    assert [r.goal for r in staging_rows] == [""] * len(STAGING_ROWS)
    assert all(r.note.startswith(QUICK) for r in staging_rows)
    assert_finite_positive(staging_rows)
    for row in staging_rows:
        assert row.ratio == pytest.approx(row.ours / row.anchor)


def test_staging_notes_state_the_case(staging_rows: list[BenchRow]) -> None:
    """Each bandwidth row's note names its case, the anchor's bytes, one torch thread and the
    device; the all-heads rows say they are not the ranks' fused path."""
    notes = {row.name: row.note for row in staging_rows}
    for name, parts in HEAD_SLICE_NOTES.items():
        for part in parts:
            assert part in notes[name], (name, part)
    for name in (*HEAD_SLICE_NOTES, "staging.gather", "staging.scatter"):
        assert notes[name].endswith("; 1 torch thread, cpu"), name
        assert "copy_ of " in notes[name], name
    for name in ("staging.gather", "staging.scatter"):
        assert "all 8 heads" in notes[name]
        assert "not the ranks' fused pools" in notes[name]
    assert notes["staging.alloc-scaling"] == QUICK


def test_integrity_rows_state_what_they_compare(staging_rows: list[BenchRow]) -> None:
    """Each integrity row names its case and what it adds to which work; the transfer rows
    include the engine's write (a copy_ into the ring)."""
    notes = {row.name: row.note for row in staging_rows if ".integrity." in row.name}
    assert len(notes) == 9
    for name, note in notes.items():
        assert note.endswith("; 1 torch thread, cpu"), name
        assert "tokens x" in note, name
    assert "XXH3-64 digest" in notes["staging.integrity.tag.p4d2"]
    assert "ArrivalVerifier.check of each writer's bytes" in notes["staging.integrity.check.p4d2"]
    assert "2 writers" in notes["staging.integrity.check.p4d2"]
    assert "copy_ into the ring" in notes["staging.integrity.transfer.p1d4-gqa"]


def test_staging_group_restores_torch_threads() -> None:
    """The group runs on one torch thread, as the ranks do, and gives the count back."""
    before = torch.get_num_threads()
    seen: list[int] = []
    real = staging_bench._ratio

    def spy(*args: object, **kwargs: object) -> BenchRow:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    torch.set_num_threads(2)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(staging_bench, "_ratio", spy)
            patch.setattr(staging_bench, "_alloc_scaling", lambda quick: [])
            staging_bench.run(BenchOptions(quick=True))
        assert seen == [1] * 8
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_contract_group_rows() -> None:
    """Per-call, warm and cold instance checks, class check; notes on both instance rows."""
    rows = contract_bench.run(BenchOptions(quick=True))
    assert [(r.name, r.unit) for r in rows] == [(n, u) for n, u, _ in CONTRACT_ROWS]
    assert [r.goal for r in rows] == [""] * len(CONTRACT_ROWS)  # quick: no goal
    assert all(r.note.startswith(QUICK) for r in rows)
    assert_finite_positive(rows)
    notes = {row.name: row.note for row in rows}
    assert "cache of its Protocol-typed members always hits" in notes["contract.instance-check"]
    assert "first of a host of a new class" in notes["contract.instance-check.cold"]
    assert "typeguard.check_type(host, HostValues" in notes["contract.instance-check.cold"]


def test_cold_hosts_are_unseen_by_the_conformance_cache() -> None:
    """Every cold host, its kv_args and its handler are of a class of their own, which the
    contract's kv_args checker has not verified before the host's check and has after."""
    hosts = contract_bench._cold_hosts(3, "Test")
    assert len({type(host) for host in hosts}) == 3
    assert len({type(host.kv_args) for host in hosts}) == 3
    assert len({type(host._staging_handler) for host in hosts}) == 3
    checker = next(c for s, c in STAGING_CONTRACT._checkers if s.name == "kv_args")
    assert isinstance(checker, _ProtocolChecker)
    for host in hosts:
        assert type(host.kv_args) not in checker._conforming
        STAGING_CONTRACT.check_instance(host)
        assert type(host.kv_args) in checker._conforming
