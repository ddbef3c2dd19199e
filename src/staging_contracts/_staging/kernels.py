"""Gather a chunk's head slice out of paged KV pools into staging bytes, and scatter it back.

Layout of one writer's bytes (SPEC §3): K of layer ``0 .. L-1``, then V of layer ``0 .. L-1``,
each block row-major ``[tokens, heads, head_dim]`` in the KV dtype, tokens in the chunk's page
order. A chunk is whole pages: page ``p`` of a pool holds pool tokens
``p * page_size .. p * page_size + page_size - 1``.

Bytes are moved as integer words (8, 4, 2 or 1 bytes, the widest the geometry allows), through
``Tensor.view(dtype)``: no numeric conversion, so every KV dtype (fp8, fp16, bf16, fp32,
fp64, int64, ...) round-trips bit for bit, NaN payloads included. A gather is one
``index_select`` (of page rows; on CPU, of token rows for a head slice, so that each token's
heads are one memcpy) and a scatter one indexed assignment (``index_copy_``, or on a CPU rank
with one torch thread NumPy copies from :mod:`~.host_rows`): over every layer at
once when the pools are views of one allocation (:mod:`~.fused_pools`), else
one per layer.
Nothing is allocated per call except what the page count needs. :class:`PagedKVPools` checks
the pools once for the transfer path; :func:`gather_chunk` and :func:`scatter_chunk` check
them per call.

The scatter writes whole token rows where it can: writers whose destination heads follow each
other and whose bytes are evenly spaced in the region (a decode rank fed by several prefill
ranks, P > D) are read through one strided view and copied together, so each destination row
is written once instead of once per writer.

On CUDA the work is enqueued on the caller's ``stream`` (which first waits on the current
stream) or, without one, on the current stream; the functions return once it is enqueued.
On CPU they return once the bytes are copied.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .fused_pools import FusedPages, fuse_pools
from .host_rows import HostRows, host_rows, put_each, put_pages, put_rows
from .layout import WriterPlacement

__all__ = [
    "KernelBackend",
    "PagedKVPools",
    "PoolGeometry",
    "WriterPlacement",
    "gather_chunk",
    "pool_geometry",
    "scatter_chunk",
]

_MAX_HOST_RUNS = 4
"""CPU scatters into fused pools copy run by run when the pools form at most this many runs
of evenly spaced pools (:func:`~.host_rows.put_pages`, one indexed NumPy assignment per pool
of a run); with more runs the per-copy cost wins (figures in the docs' Design page)."""

_WORDS: dict[int, torch.dtype] = {
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}


class KernelBackend(enum.Enum):
    """Which implementation moves the bytes (a typed setting, never an environment string)."""

    TORCH = "torch"
    """Torch indexing ops, except that a CPU scatter copies its rows with NumPy
    (:mod:`~staging_contracts._staging.host_rows`) while torch runs one intra-op thread, as a rank
    sharing a host with other ranks does: NumPy's copies are faster on one thread, torch's
    ``index_copy_`` spreads over several; and that a CPU gather of a head slice indexes token
    rows instead of page rows (one memcpy per token's heads). The default."""
    TORCH_ONLY = "torch-only"
    """Torch indexing ops on every device: exactly the CUDA code path, runnable on CPU
    tensors (so hosts without a GPU can test it)."""


class PoolGeometry(NamedTuple):
    """Shape facts shared by every K and V pool of one rank."""

    pool_pages: int
    """Whole pages in each pool (``pool_tokens // page_size``)."""
    num_heads: int
    """KV heads per pool token (this rank's heads)."""
    head_dim: int
    """Elements per head."""
    element_size: int
    """Bytes per element of the KV dtype."""
    num_layers: int
    """Layers (length of the K and of the V buffer sequences)."""
    dtype: torch.dtype
    """The KV dtype."""
    device: torch.device
    """Device of every pool."""

    @property
    def bytes_per_head_token(self) -> int:
        """``head_dim · element_size``: bytes of one head of one token."""
        return self.head_dim * self.element_size


def pool_geometry(
    k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], page_size: int
) -> PoolGeometry:
    """Validate a rank's paged KV pools and describe them.

    Args:
        k_buffers: one K pool per layer, each contiguous ``[pool_tokens, heads, head_dim]``.
        v_buffers: one V pool per layer, same shape, dtype and device as the K pools.
        page_size: tokens per page (>= 1).

    Returns:
        The geometry shared by all pools.

    Raises:
        ValueError: no layers, K/V counts differ, a pool is not 3-D or not contiguous, pools
            disagree in shape, dtype or device, ``page_size < 1``, or a pool holds no whole
            page.
    """
    if page_size < 1:
        raise ValueError(f"page_size={page_size!r} must be >= 1")
    if len(k_buffers) != len(v_buffers):
        raise ValueError(f"{len(k_buffers)} K buffers but {len(v_buffers)} V buffers")
    if not k_buffers:
        raise ValueError("at least one layer of K and V buffers is needed")
    first = k_buffers[0]
    if first.dim() != 3:
        raise ValueError(
            f"KV pools must be [pool_tokens, heads, head_dim], got shape {tuple(first.shape)}"
        )
    for kind, buffers in (("K", k_buffers), ("V", v_buffers)):
        for layer, pool in enumerate(buffers):
            if pool.shape != first.shape or pool.dtype != first.dtype:
                raise ValueError(
                    f"{kind} pool of layer {layer} is {tuple(pool.shape)} {pool.dtype}, "
                    f"expected {tuple(first.shape)} {first.dtype} like K pool of layer 0"
                )
            if pool.device != first.device:
                raise ValueError(
                    f"{kind} pool of layer {layer} is on {pool.device}, expected {first.device}"
                )
            if not pool.is_contiguous():
                raise ValueError(f"{kind} pool of layer {layer} is not contiguous")
    tokens, heads, head_dim = first.shape
    pool_pages = tokens // page_size
    if pool_pages < 1 or heads < 1 or head_dim < 1:
        raise ValueError(
            f"KV pools of shape {tuple(first.shape)} hold no whole page of page_size={page_size}"
        )
    return PoolGeometry(
        pool_pages,
        heads,
        head_dim,
        first.element_size(),
        len(k_buffers),
        first.dtype,
        first.device,
    )


class PagedKVPools:
    """A rank's paged K and V pools, checked once, for the gathers and scatters of every chunk.

    **Side:** either. **Built:** once, when staging is set up (the checks walk every pool);
    the methods then check only their own arguments. **Thread-safety:** methods may run on
    several threads, on distinct ``out`` buffers and pages.

    When every pool is a view of one allocation at whole-page offsets (one KV cache buffer,
    as vLLM and TensorRT-LLM allocate it), a chunk moves with one index op for all layers
    (:mod:`~staging_contracts._staging.fused_pools`); pools allocated one by one move layer by
    layer.

    Args:
        k_buffers: one K pool per layer, each contiguous ``[pool_tokens, heads, head_dim]``.
        v_buffers: one V pool per layer, same shape, dtype and device as the K pools.
        page_size: tokens per page (>= 1).

    Raises:
        ValueError: as :func:`pool_geometry`.
    """

    def __init__(
        self, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], page_size: int
    ) -> None:
        self.geometry: PoolGeometry = pool_geometry(k_buffers, v_buffers, page_size)
        """Shape facts shared by every pool."""
        self.page_size = page_size
        """Tokens per page."""
        self._pools = (*k_buffers, *v_buffers)
        self._offsets = _pool_offsets(k_buffers, v_buffers, self.geometry.element_size)
        self._fused: dict[torch.dtype, FusedPages | None] = {}
        self._layer_pages: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}
        self._host_targets: dict[tuple[torch.dtype, int, int, int], tuple[HostRows, ...]] = {}

    def _pages(self, word: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Each pool as ``word`` words ``[pool_pages, page_size, words]`` (cached per word)."""
        pages = self._layer_pages.get(word)
        if pages is None:
            pages = tuple(
                _page_view(pool, word, self.page_size, self.geometry) for pool in self._pools
            )
            self._layer_pages[word] = pages
        return pages

    def _host_rows(
        self, word: torch.dtype, start: int, writers: int, row: int, whole: bool
    ) -> tuple[HostRows, ...]:
        """Each pool's page rows of ``writers`` writers' heads from word ``start``, for
        NumPy (cached per geometry, which also decides ``whole``: building them costs more
        than a page's copy)."""
        key = (word, start, writers, row)
        rows = self._host_targets.get(key)
        if rows is None:
            rows = tuple(
                host_rows(_writer_rows(pages, start, writers, row, whole))
                for pages in self._pages(word)
            )
            self._host_targets[key] = rows
        return rows

    def fused(self, word: torch.dtype = torch.uint8) -> FusedPages | None:
        """The pools as page rows of one allocation, viewed as ``word`` (cached per word), or
        ``None`` when they are not one allocation."""
        if word not in self._fused:
            geometry = self.geometry
            self._fused[word] = fuse_pools(
                self._pools,
                pool_pages=geometry.pool_pages,
                page_size=self.page_size,
                page_bytes=self.page_size * geometry.num_heads * geometry.bytes_per_head_token,
                word=word,
            )
        return self._fused[word]

    def gather(
        self,
        page_indices: torch.Tensor,
        head_start: int,
        num_heads: int,
        out: torch.Tensor,
        *,
        stream: torch.cuda.Stream | None = None,
        backend: KernelBackend = KernelBackend.TORCH,
    ) -> int:
        """Copy heads ``[head_start, head_start + num_heads)`` of a chunk into staging bytes.

        Writes one writer's bytes to ``out[:n]``: K of every layer, then V of every layer,
        each ``[tokens, num_heads, head_dim]`` with tokens in ``page_indices`` order.

        **Side:** prefill. **Called by:** the transfer worker, before the bulk write.
        **Blocking:** on CPU until copied; on CUDA until enqueued (synchronize ``stream``
        before the engine reads ``out``).

        Args:
            page_indices: int64 1-D tensor of the chunk's pool pages, on the pools' device.
            head_start: first local head to send.
            num_heads: heads to send.
            out: contiguous 1-D ``uint8`` tensor on the pools' device, at least ``n`` bytes.
            stream: CUDA only: stream to enqueue on (it first waits on the current stream).
            backend: implementation to use.

        Returns:
            ``n``, the bytes written: ``tokens · num_heads · head_dim · element_size · 2 · L``.
            ``out`` stays owned by the caller.

        Raises:
            ValueError: invalid pages, head range or ``out``; a page index out of range
                (checked on CPU; on CUDA the device reports it); a stream with CPU tensors.
        """
        geometry = self.geometry
        page_size = self.page_size
        num_pages = _check_pages(page_indices, geometry)
        _check_head_range("head_start", head_start, num_heads, geometry.num_heads)
        _check_bytes_tensor("out", out, geometry.device)
        _check_backend(backend)
        bpht = geometry.bytes_per_head_token
        block = num_pages * page_size * num_heads * bpht
        total = block * 2 * geometry.num_layers
        if out.numel() < total:
            raise ValueError(f"out holds {out.numel()} bytes, the chunk needs {total}")
        word = _word_bytes(
            geometry.num_heads * bpht,
            head_start * bpht,
            num_heads * bpht,
            int(out.storage_offset()),
            *self._offsets,
        )
        dtype = _WORDS[word]
        strided = num_heads < geometry.num_heads
        # A head slice on a CPU rank: index token rows (below) rather than page rows.
        token_rows = strided and geometry.device.type == "cpu" and backend is KernelBackend.TORCH
        fused = self.fused(dtype)
        start = head_start * bpht // word
        count = num_heads * bpht // word
        with _on_stream(stream, geometry.device):
            if fused is not None:  # every layer at once: one index over all pools' rows
                sources = [fused.rows]
                index = fused.rows_of(page_indices)
            else:
                sources = list(self._pages(dtype))
                index = page_indices
            step = index.numel() * page_size * count
            if token_rows:
                index = _token_rows_of(index, page_size)
            for number, pages in enumerate(sources):
                source = _gather_source(pages, start, count, strided=strided, tokens=token_rows)
                target = out.view(dtype)[number * step : (number + 1) * step]
                torch.index_select(
                    source, 0, index, out=target.view(index.numel(), *source.shape[1:])
                )
        return total

    def scatter(
        self,
        region: torch.Tensor,
        page_indices: torch.Tensor,
        writers: Sequence[WriterPlacement],
        *,
        stream: torch.cuda.Stream | None = None,
        backend: KernelBackend = KernelBackend.TORCH,
    ) -> None:
        """Copy every writer's bytes of a chunk region into the pools.

        The inverse of :meth:`gather`: writer ``w`` at ``writers[w].byte_offset`` fills heads
        ``[dst_head_start, dst_head_start + num_heads)`` of the chunk's pages.
        ``layout.writer_placements`` builds ``writers`` for a decode rank.

        **Side:** decode. **Called by:** the arrival path once every writer of the chunk
        arrived. **Blocking:** on CPU until copied; on CUDA until enqueued (record an event on
        ``stream`` and free the region once it completes). **Thread-safety:** callers
        serialize scatters into the same pool pages.

        Args:
            region: contiguous 1-D ``uint8`` tensor (a slice of the ring) on the pools' device.
            page_indices: int64 1-D tensor of the chunk's pool pages, on the pools' device.
            writers: each writer's byte offset in ``region`` and destination heads.
            stream: CUDA only: stream to enqueue on (it first waits on the current stream).
            backend: implementation to use.

        Raises:
            ValueError: invalid pages, writers or region; a page index out of range (checked
                on CPU; on CUDA the device reports it); a stream with CPU tensors.
        """
        geometry = self.geometry
        page_size = self.page_size
        num_pages = _check_pages(page_indices, geometry)
        _check_bytes_tensor("region", region, geometry.device)
        _check_backend(backend)
        if not writers:
            raise ValueError("writers must name at least one writer")
        bpht = geometry.bytes_per_head_token
        layers = 2 * geometry.num_layers
        quantities = [geometry.num_heads * bpht]
        for index, writer in enumerate(writers):
            _check_head_range(
                f"writers[{index}].dst_head_start",
                writer.dst_head_start,
                writer.num_heads,
                geometry.num_heads,
            )
            size = num_pages * page_size * writer.num_heads * bpht * layers
            if writer.byte_offset < 0 or writer.byte_offset + size > region.numel():
                raise ValueError(
                    f"writers[{index}] needs bytes [{writer.byte_offset}, "
                    f"{writer.byte_offset + size}) but region holds {region.numel()} bytes"
                )
            quantities += [
                writer.dst_head_start * bpht,
                writer.num_heads * bpht,
                int(region.storage_offset()) + writer.byte_offset,
            ]
        word = _word_bytes(*quantities, *self._offsets)
        dtype = _WORDS[word]
        words = region.view(dtype)
        fused = self.fused(dtype)
        on_host = (
            geometry.device.type == "cpu"
            and backend is KernelBackend.TORCH
            and torch.get_num_threads() == 1
        )
        # Ops: (pages [pools, rows, page_size, words], first pool, index of the chunk's rows).
        if fused is not None and on_host and len(fused.runs) <= _MAX_HOST_RUNS:
            # Few runs of evenly spaced pools: one indexed copy per pool of each run.
            ops = [(fused.run_pages(run), run.first_pool, page_indices) for run in fused.runs]
        elif fused is not None:  # every layer at once: layers and pages are one dimension
            ops = [(fused.rows[None], 0, fused.rows_of(page_indices))]
        elif on_host:  # layer by layer, NumPy rows into cached views (below)
            ops = []
        else:  # layer by layer
            ops = [
                (pages[None], layer, page_indices) for layer, pages in enumerate(self._pages(dtype))
            ]
        token_words = geometry.num_heads * bpht // word
        with _on_stream(stream, geometry.device):
            for group in _writer_groups(writers, num_pages * page_size * bpht * layers):
                row = group.heads_per_writer * bpht // word
                start = group.dst_head_start * bpht // word
                whole = _whole_rows(token_words, start, group.num_writers, row)
                source = _WriterSource(
                    words,
                    num_pages * page_size * row,
                    int(words.storage_offset()) + group.byte_offset // word,
                    (page_size, group.num_writers, row),
                    group.stride // word,
                    whole,
                )
                if fused is None and on_host:
                    targets = self._host_rows(dtype, start, group.num_writers, row, whole)
                    put_each(targets, page_indices, source.pools(0, layers, num_pages))
                    continue
                for pages, first_pool, chunk_rows in ops:
                    target = _writer_rows(pages, start, group.num_writers, row, whole)
                    chunk = source.pools(first_pool, len(pages), chunk_rows.numel())
                    _put_pages(target, chunk_rows, chunk, on_host=on_host)


def gather_chunk(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: torch.Tensor,
    page_size: int,
    head_start: int,
    num_heads: int,
    out: torch.Tensor,
    *,
    stream: torch.cuda.Stream | None = None,
    backend: KernelBackend = KernelBackend.TORCH,
) -> int:
    """:meth:`PagedKVPools.gather` on pools checked for this call only.

    For one-off use and tests; the transfer path builds :class:`PagedKVPools` once.

    Args:
        k_buffers: K pool per layer, contiguous ``[pool_tokens, heads, head_dim]``.
        v_buffers: V pool per layer, same geometry.
        page_indices: int64 1-D tensor of the chunk's pool pages, on the pools' device.
        page_size: tokens per page.
        head_start: first local head to send.
        num_heads: heads to send.
        out: contiguous 1-D ``uint8`` tensor on the pools' device.
        stream: CUDA only: stream to enqueue on.
        backend: implementation to use.

    Returns:
        The bytes written.

    Raises:
        ValueError: invalid pools, or as :meth:`PagedKVPools.gather`.
    """
    return PagedKVPools(k_buffers, v_buffers, page_size).gather(
        page_indices, head_start, num_heads, out, stream=stream, backend=backend
    )


def scatter_chunk(
    region: torch.Tensor,
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: torch.Tensor,
    page_size: int,
    writers: Sequence[WriterPlacement],
    *,
    stream: torch.cuda.Stream | None = None,
    backend: KernelBackend = KernelBackend.TORCH,
) -> None:
    """:meth:`PagedKVPools.scatter` on pools checked for this call only.

    For one-off use and tests; the transfer path builds :class:`PagedKVPools` once.

    Args:
        region: contiguous 1-D ``uint8`` tensor on the pools' device.
        k_buffers: K pool per layer, contiguous ``[pool_tokens, heads, head_dim]``.
        v_buffers: V pool per layer, same geometry.
        page_indices: int64 1-D tensor of the chunk's pool pages, on the pools' device.
        page_size: tokens per page.
        writers: each writer's byte offset in ``region`` and destination heads.
        stream: CUDA only: stream to enqueue on.
        backend: implementation to use.

    Raises:
        ValueError: invalid pools, or as :meth:`PagedKVPools.scatter`.
    """
    PagedKVPools(k_buffers, v_buffers, page_size).scatter(
        region, page_indices, writers, stream=stream, backend=backend
    )


# --------------------------------------------------------------------------- helpers


def _page_view(
    pool: torch.Tensor, dtype: torch.dtype, page_size: int, geometry: PoolGeometry
) -> torch.Tensor:
    """``pool`` as ``dtype`` words ``[pool_pages, page_size, words]``, one token row per
    ``[page, token]``."""
    words = pool.view(pool.shape[0], -1).view(torch.uint8).view(dtype)
    return words[: geometry.pool_pages * page_size].view(geometry.pool_pages, page_size, -1)


def _gather_source(
    pages: torch.Tensor, start: int, count: int, *, strided: bool, tokens: bool
) -> torch.Tensor:
    """What a gather indexes in ``pages`` ``[rows, page_size, words]``: words ``[start,
    start + count)`` of each token row.

    Every head (not ``strided``): one flat row per page, which ``index_select`` copies with
    one memcpy. A head slice: page rows ``[rows, page_size, count]`` (one kernel on CUDA),
    or with ``tokens`` token rows ``[rows · page_size, count]``: each row's words are
    contiguous, so torch's CPU ``index_select`` copies each with one memcpy, however far
    apart the rows are, where it copies a strided page row element by element through a
    copy kernel per page.
    """
    if not strided:
        return pages.reshape(pages.shape[0], -1)
    if tokens:
        return pages.flatten(0, 1)[:, start : start + count]
    return pages[:, :, start : start + count]


def _token_rows_of(page_rows: torch.Tensor, page_size: int) -> torch.Tensor:
    """The token rows of ``page_rows``, page by page: ``[pages · page_size]`` int64."""
    first = page_rows[:, None] * page_size
    return (first + torch.arange(page_size, device=page_rows.device)).reshape(-1)


def _writer_rows(
    pages: torch.Tensor, start: int, writers: int, row: int, whole: bool
) -> torch.Tensor:
    """``pages[..., rows, page_size, words]`` cut to ``writers`` writers' words from
    ``start``: ``[..., rows, page_size, writers, row]``, or ``[..., rows, page_size · row]``
    for ``whole`` rows (:func:`_whole_rows`)."""
    if whole:
        return pages.flatten(-2)
    cut = pages[..., start : start + writers * row]
    return cut.view(*cut.shape[:-1], writers, row)


def _whole_rows(token_words: int, start: int, writers: int, row: int) -> bool:
    """Does one writer fill all ``token_words`` words of each token row? Then a page is one
    contiguous row on both sides, which the index ops copy with one memcpy."""
    return writers == 1 and start == 0 and row == token_words


class _WriterSource(NamedTuple):
    """A writer group's bytes in a region, for any run of pools.

    Writer ``c`` of the group holds pool ``l``'s ``[pages, page_size, row]`` block at
    ``first + c · writer_stride + l · block``: one strided view reads them all, so each
    destination token row is written whole. The pools' blocks follow each other, so pools
    and pages may also merge into one dimension.
    """

    words: torch.Tensor
    """The region as words."""
    block: int
    """Words of one pool's block of one writer."""
    first: int
    """Storage offset (in words) of the group's first writer."""
    page: tuple[int, int, int]
    """``(page_size, writers, row)``: one page of the group."""
    writer_stride: int
    """Words from one writer's bytes to the next one's."""
    whole: bool
    """Pages are whole contiguous rows (:func:`_whole_rows`): read flat."""

    def pools(self, first_pool: int, count: int, pages: int) -> torch.Tensor:
        """``[count, pages, page_size, writers, row]`` from pool ``first_pool`` on (or
        ``[count, pages, page_size · row]`` for whole rows)."""
        page_size, _, row = self.page
        view = self.words.as_strided(
            (count, pages, *self.page),
            (self.block, page_size * row, row, self.writer_stride, 1),
            self.first + first_pool * self.block,
        )
        return view.flatten(-3) if self.whole else view


def _put_pages(
    target: torch.Tensor, index: torch.Tensor, source: torch.Tensor, *, on_host: bool
) -> None:
    """``target[:, index[i]] = source[:, i]``: NumPy copies ``on_host``, else ``index_copy_``."""
    if not on_host:
        target.index_copy_(1, index, source)
    elif len(target) == 1:
        put_rows(target[0], index, source[0])
    else:
        put_pages(target, index, source)


class _WriterGroup(NamedTuple):
    """Writers whose destination heads follow each other and whose bytes are evenly spaced."""

    byte_offset: int
    """Region offset of the first writer's bytes."""
    stride: int
    """Bytes from one writer's start to the next one's (> 0)."""
    num_writers: int
    """Writers in the group."""
    dst_head_start: int
    """First destination head of the first writer."""
    heads_per_writer: int
    """Heads each writer sends."""


def _writer_groups(writers: Sequence[WriterPlacement], bytes_per_head: int) -> list[_WriterGroup]:
    """Merge consecutive writers that can be scattered as one, so whole token rows are
    written at once (P > D: a decode rank's heads come from several writers, side by side).

    ``bytes_per_head`` is what one head of one writer occupies in the region.
    """
    groups: list[_WriterGroup] = []
    for writer in writers:
        if groups:
            last = groups[-1]
            # Bytes from the group's last writer to this one.
            step = writer.byte_offset - (last.byte_offset + (last.num_writers - 1) * last.stride)
            if (
                writer.num_heads == last.heads_per_writer
                and writer.dst_head_start
                == last.dst_head_start + last.num_writers * last.heads_per_writer
                and step > 0
                and (last.num_writers == 1 or step == last.stride)
            ):
                groups[-1] = last._replace(stride=step, num_writers=last.num_writers + 1)
                continue
        groups.append(
            _WriterGroup(
                writer.byte_offset,
                writer.num_heads * bytes_per_head,
                1,
                writer.dst_head_start,
                writer.num_heads,
            )
        )
    return groups


def _check_pages(page_indices: torch.Tensor, geometry: PoolGeometry) -> int:
    if page_indices.dtype != torch.int64 or page_indices.dim() != 1:
        raise ValueError(
            f"page_indices must be a 1-D int64 tensor, got {page_indices.dim()}-D "
            f"{page_indices.dtype}"
        )
    if page_indices.device != geometry.device:
        raise ValueError(
            f"page_indices is on {page_indices.device}, the pools on {geometry.device}"
        )
    num_pages = page_indices.numel()
    if num_pages < 1:
        raise ValueError("page_indices is empty: a chunk holds at least one page")
    if page_indices.device.type == "cpu":
        low, high = torch.aminmax(page_indices)
        if int(low) < 0 or int(high) >= geometry.pool_pages:
            raise ValueError(
                f"page_indices range over [{int(low)}, {int(high)}], the pools hold pages "
                f"[0, {geometry.pool_pages - 1}]"
            )
    return num_pages


def _check_head_range(name: str, start: int, count: int, heads: int) -> None:
    if count < 1:
        raise ValueError(f"num_heads={count!r} must be >= 1 (for {name})")
    if start < 0 or start + count > heads:
        raise ValueError(
            f"{name}={start!r} with num_heads={count} does not fit the pools' {heads} heads"
        )


def _check_bytes_tensor(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous 1-D uint8 tensor, got {tensor.dim()}-D {tensor.dtype}"
            + ("" if tensor.is_contiguous() else " (not contiguous)")
        )
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, the pools on {device}")


def _check_backend(backend: KernelBackend) -> None:
    if not isinstance(backend, KernelBackend):
        raise ValueError(f"backend must be a KernelBackend, got {backend!r}")


def _pool_offsets(
    k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], element_size: int
) -> list[int]:
    return [int(pool.storage_offset()) * element_size for pool in (*k_buffers, *v_buffers)]


def _word_bytes(*byte_quantities: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides every byte quantity."""
    return math.gcd(8, *byte_quantities)


def _on_stream(
    stream: torch.cuda.Stream | None, device: torch.device
) -> contextlib.AbstractContextManager[object]:
    if device.type != "cuda":
        if stream is not None:
            raise ValueError(f"stream is for CUDA tensors only, the pools are on {device}")
        return contextlib.nullcontext()
    if stream is None:
        return contextlib.nullcontext()
    stream.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(stream)
