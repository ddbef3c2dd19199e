"""Contiguous runs of a chunk's pool pages, and when copying run by run beats an index op.

A chunk's pages are usually allocated together, so their pool indices come in long runs of
consecutive pages. When a page's bytes are strided (a head slice of each token row, or
several writers' bytes side by side), one slice ``copy_`` per run moves them at close to
memcpy speed on CPU, while ``index_select`` / ``index_copy_`` stay near half of it whatever
the pages; but every slice copy costs a few microseconds of dispatch. :func:`plan_page_runs`
picks the runs when they are long enough to pay for that, and the index op otherwise. (Whole
contiguous page rows need no plan: the index op copies each with one memcpy.)

Measured on the project's 2-core CPU host (strided bf16 rows, one torch thread): index ops
move about 3 GB/s at any run length; slice copies move 2.4 GB/s for 16 KiB runs, 3.4 for
32 KiB, 4.2 for 64 KiB and over 5 for 256 KiB and more. Hence :data:`MIN_RUN_BYTES`.

On CUDA the index op is one kernel launch, and finding runs would need the page indices on
the host, so the plan is always the index op there.
"""

from __future__ import annotations

from typing import Final, NamedTuple

import torch

__all__ = ["MIN_RUN_BYTES", "PageRun", "contiguous_runs", "plan_page_runs"]

MIN_RUN_BYTES: Final = 32 * 1024
"""Mean bytes a slice copy must move (per run, per copied block) to be chosen over an index
op on CPU."""


class PageRun(NamedTuple):
    """``length`` consecutive pool pages that are also consecutive in the chunk."""

    pool_page: int
    """First pool page of the run."""
    chunk_page: int
    """Position of that page in the chunk's page list."""
    length: int
    """Pages in the run (>= 1)."""


def contiguous_runs(page_indices: torch.Tensor) -> list[PageRun]:
    """Split a chunk's page list into maximal runs of consecutive pool pages, in chunk order.

    Args:
        page_indices: 1-D int64 tensor of pool pages, on the CPU.

    Returns:
        Runs covering every position of ``page_indices`` once, in order; empty for no pages.
    """
    count = int(page_indices.numel())
    if count == 0:
        return []
    breaks = torch.nonzero(page_indices[1:] - page_indices[:-1] != 1).flatten().add_(1)
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], count]
    firsts = page_indices[starts].tolist()
    return [
        PageRun(first, start, end - start)
        for first, start, end in zip(firsts, starts, ends, strict=True)
    ]


def plan_page_runs(page_indices: torch.Tensor, bytes_per_page: int) -> list[PageRun] | None:
    """The runs to copy slice by slice, or ``None`` to use one index op.

    Args:
        page_indices: 1-D int64 tensor of the chunk's pool pages.
        bytes_per_page: bytes one slice copy moves per page (of one layer's block).

    Returns:
        The chunk's runs when ``page_indices`` is on the CPU and a run moves at least
        :data:`MIN_RUN_BYTES` on average; ``None`` otherwise.
    """
    if page_indices.device.type != "cpu":
        return None
    runs = contiguous_runs(page_indices)
    if not runs or int(page_indices.numel()) * bytes_per_page < MIN_RUN_BYTES * len(runs):
        return None
    return runs
