"""Tests of contiguous page runs and the choice between slice copies and one index op."""

from __future__ import annotations

import pytest
import torch

from staging_contracts import page_runs
from staging_contracts.page_runs import MIN_RUN_BYTES, PageRun, contiguous_runs, plan_page_runs


@pytest.mark.parametrize(
    ("pages", "runs"),
    [
        ([], []),
        ([7], [PageRun(7, 0, 1)]),
        ([3, 4, 5, 6], [PageRun(3, 0, 4)]),
        ([5, 4, 3], [PageRun(5, 0, 1), PageRun(4, 1, 1), PageRun(3, 2, 1)]),
        ([9, 10, 2, 3, 4, 11], [PageRun(9, 0, 2), PageRun(2, 2, 3), PageRun(11, 5, 1)]),
        ([0, 2, 4], [PageRun(0, 0, 1), PageRun(2, 1, 1), PageRun(4, 2, 1)]),
        ([1, 1, 2], [PageRun(1, 0, 1), PageRun(1, 1, 2)]),
    ],
)
def test_contiguous_runs_split_at_every_break(pages: list[int], runs: list[PageRun]) -> None:
    """Splits the page list into maximal runs of consecutive pages, in chunk order."""
    assert contiguous_runs(torch.tensor(pages, dtype=torch.int64)) == runs


def test_runs_cover_every_position_once() -> None:
    """The runs of a random page list rebuild it exactly."""
    pages = torch.randperm(200, generator=torch.Generator().manual_seed(5))[:120]
    rebuilt = [run.pool_page + i for run in contiguous_runs(pages) for i in range(run.length)]
    assert rebuilt == pages.tolist()


def test_plan_takes_runs_only_when_they_are_long_enough() -> None:
    """Chooses slice copies when a run moves MIN_RUN_BYTES on average, the index op below."""
    pages = torch.tensor([0, 1, 2, 3, 10, 11, 12, 13])  # two runs of four pages
    enough = MIN_RUN_BYTES // 4
    assert plan_page_runs(pages, enough) == [PageRun(0, 0, 4), PageRun(10, 4, 4)]
    assert plan_page_runs(pages, enough - 1) is None
    assert plan_page_runs(torch.tensor([4]), MIN_RUN_BYTES) == [PageRun(4, 0, 1)]
    assert plan_page_runs(torch.tensor([], dtype=torch.int64), MIN_RUN_BYTES) is None


def test_plan_is_the_index_op_off_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never plans runs for pages off the CPU (finding them would need a host copy)."""
    monkeypatch.setattr(page_runs, "MIN_RUN_BYTES", 0)
    assert plan_page_runs(torch.tensor([0, 1], device="meta"), 1 << 20) is None
    assert plan_page_runs(torch.tensor([0, 1]), 1) == [PageRun(0, 0, 2)]
