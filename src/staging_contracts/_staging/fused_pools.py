"""Every K and V pool of a rank as page rows of one allocation, when they share one.

Serving engines that allocate the whole KV cache as one buffer (vLLM, TensorRT-LLM) hand out
each layer's K and V pool as a view of it. Then a page of any pool is a row of one 2-D view
of the buffer, and a chunk's pages in every layer are a single index list: one index op
moves the whole chunk instead of one op per layer and per K/V (64 for 32 layers), which on
CPU saves the per-op dispatch and on CUDA all but one kernel launch. Where the pools are
also evenly spaced (:class:`PoolRun`), a run of them is one strided view, which a CPU scatter
copies page by page.

:func:`fuse_pools` finds that view. It needs every pool to live in the same storage, at byte
offsets that differ by whole pages, and no two pools to share a page (a scatter would write
such a page twice). Pools allocated one by one (SGLang does) return ``None``: the kernels
then go layer by layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["FusedPages", "PoolRun", "fuse_pools"]


class PoolRun(NamedTuple):
    """Consecutive pools (in the given order) whose first rows are evenly spaced."""

    first_pool: int
    """Index of the run's first pool."""
    length: int
    """Pools in the run (>= 1)."""
    first_row: int
    """Row of page 0 of the run's first pool."""
    step: int
    """Rows from one pool of the run to the next (> 0; 0 when ``length`` is 1)."""


class FusedPages(NamedTuple):
    """Page rows of the allocation every pool lives in."""

    rows: torch.Tensor
    """``[rows, page_size, words]`` view of the allocation, in the caller's word dtype: row
    ``first_row[i] + p`` is page ``p`` of pool ``i``."""
    first_row: torch.Tensor
    """int64 ``[pools]`` on the pools' device: the row of page 0 of each pool, in the order
    the pools were given (K of every layer, then V of every layer)."""

    runs: tuple[PoolRun, ...]
    """The pools split into runs of evenly spaced pools, in order: one run for K-then-V
    caches (``[2, layers, ...]``), two for layer-major ones (``[layers, 2, ...]``)."""
    pool_pages: int
    """Whole pages of each pool."""

    def rows_of(self, page_indices: torch.Tensor) -> torch.Tensor:
        """Rows of ``page_indices`` in every pool, pool by pool: ``[pools · pages]`` int64."""
        return (self.first_row[:, None] + page_indices[None, :]).reshape(-1)

    def run_pages(self, run: PoolRun) -> torch.Tensor:
        """The run's pools as one view ``[length, pool_pages, page_size, words]``."""
        rows = self.rows
        page_words = rows.stride(0)
        return rows.as_strided(
            (run.length, self.pool_pages, *rows.shape[1:]),
            (run.step * page_words, *rows.stride()),
            rows.storage_offset() + run.first_row * page_words,
        )


def fuse_pools(
    pools: Sequence[torch.Tensor],
    *,
    pool_pages: int,
    page_size: int,
    page_bytes: int,
    word: torch.dtype,
) -> FusedPages | None:
    """The page rows shared by ``pools``, or ``None`` when they are not one allocation.

    Args:
        pools: contiguous ``[tokens, heads, head_dim]`` pools of one geometry (validated by
            the caller), K of every layer then V of every layer.
        pool_pages: whole pages in each pool.
        page_size: tokens per page.
        page_bytes: bytes of one page of one pool.
        word: integer dtype the rows are viewed as; its size divides ``page_bytes`` and every
            pool's byte offset.

    Returns:
        The rows, or ``None`` when the pools are in different storages, at offsets that are
        not whole pages apart, or overlap.
    """
    storage = pools[0].untyped_storage().data_ptr()
    offsets: list[int] = []
    for pool in pools:
        if pool.untyped_storage().data_ptr() != storage:
            return None
        offsets.append(int(pool.storage_offset()) * pool.element_size())
    base = min(offsets)
    if any((offset - base) % page_bytes for offset in offsets):
        return None
    first_rows = [(offset - base) // page_bytes for offset in offsets]
    ordered = sorted(first_rows)
    if any(later - earlier < pool_pages for earlier, later in itertools.pairwise(ordered)):
        return None
    anchor = pools[offsets.index(base)]
    words = anchor.view(anchor.shape[0], -1).view(torch.uint8).view(word)
    row_words = page_bytes // words.element_size()
    rows = words.as_strided(
        (ordered[-1] + pool_pages, page_size, row_words // page_size),
        (row_words, row_words // page_size, 1),
        words.storage_offset(),
    )
    return FusedPages(
        rows,
        torch.tensor(first_rows, dtype=torch.int64, device=anchor.device),
        _even_runs(first_rows),
        pool_pages,
    )


def _even_runs(first_rows: list[int]) -> tuple[PoolRun, ...]:
    """Split the pools, in order, into maximal runs of evenly spaced, increasing first rows
    (a view cannot step backwards)."""
    runs: list[PoolRun] = []
    for index, row in enumerate(first_rows):
        if runs:
            last = runs[-1]
            step = row - (last.first_row + (last.length - 1) * last.step)
            if step > 0 and (last.length == 1 or step == last.step):
                runs[-1] = last._replace(length=last.length + 1, step=step)
                continue
        runs.append(PoolRun(index, 1, row, 0))
    return tuple(runs)
