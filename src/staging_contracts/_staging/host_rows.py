"""CPU scatter copies on one thread: rows or pages of a target set from a source, by NumPy.

torch's CPU ``index_copy_`` moves one element per step of its loop, whatever the row looks
like. NumPy copies element by element too, but with a row's innermost dimension viewed as one
opaque ``np.void`` element of that many bytes each element is one ``memcpy``: indexed rows
(:func:`put_rows`) and strided copies pool by pool over evenly spaced pools
(:func:`put_pages`) beat ``index_copy_`` on one thread (figures in the docs' Design page). On
several threads ``index_copy_`` spreads and wins, so the kernels use these only when torch
runs one thread. Bytes are copied, never converted: every dtype round-trips bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["HostRows", "host_rows", "put_each", "put_pages", "put_rows"]

HostRows = npt.NDArray[Any]
"""A tensor's memory as NumPy, each innermost row one opaque element (from :func:`host_rows`)."""


def host_rows(tensor: torch.Tensor) -> HostRows:
    """``tensor`` (CPU, innermost dimension contiguous) as :data:`HostRows`, sharing memory:
    build once and keep, for :func:`put_each`."""
    return _as_void(tensor)


def put_rows(target: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
    """``target[index[i]] = source[i]`` for every ``i``, on CPU tensors.

    Args:
        target: CPU tensor of an integer word dtype whose innermost dimension is contiguous.
        index: 1-D int64 CPU tensor; no row may appear twice.
        source: CPU tensor of the same dtype, ``[len(index), *target.shape[1:]]``, innermost
            dimension contiguous.
    """
    _as_void(target)[index.numpy()] = _as_void(source)


def put_each(targets: Sequence[HostRows], index: torch.Tensor, source: torch.Tensor) -> None:
    """``targets[k][index[i]] = source[k, i]`` for every ``k`` and ``i``: :func:`put_rows`
    into many targets (the layers of pools allocated one by one) with one source view.

    Args:
        targets: from :func:`host_rows`, each ``[rows, ...]``.
        index: 1-D int64 CPU tensor of distinct rows.
        source: CPU tensor ``[len(targets), len(index), ...]``, innermost dimension contiguous.
    """
    rows = index.numpy()
    pieces = _as_void(source)
    for target, piece in zip(targets, pieces, strict=True):
        target[rows] = piece


def put_pages(target: torch.Tensor, pages: torch.Tensor, source: torch.Tensor) -> None:
    """``target[:, pages[j]] = source[:, j]`` for every ``j``, on CPU tensors: one indexed
    assignment per entry of the first dimension (a pool), each over every page.

    When the first dimension spans pools (layers) that are evenly spaced in memory, this
    needs neither one index over ``[pools · pages]`` rows (:func:`put_rows`) nor a copy per
    page; and pool by pool, each assignment reads its source block in order. One page per
    step across all pools, the former order, reads 64 blocks a page apart at once: on the
    staging bench's decode (4096 tokens, 32 layers, one torch thread) 0.60x of ``copy_``
    for whole page rows against 0.88x pool by pool, 0.69x against 0.77x for two writers'
    half rows, and no slower on the transfer bench's smaller chunks (0.89x against 0.92x).

    Args:
        target: CPU tensor ``[n, pool_pages, ...]`` of an integer word dtype, innermost
            dimension contiguous.
        pages: 1-D int64 CPU tensor of distinct indices into ``target``'s second dimension.
        source: CPU tensor ``[n, len(pages), ...]`` of the same dtype, innermost dimension
            contiguous.
    """
    into = _as_void(target)
    out_of = _as_void(source)
    index = pages.numpy()
    for pool, block in zip(into, out_of, strict=True):
        pool[index] = block


def _as_void(tensor: torch.Tensor) -> npt.NDArray[Any]:
    """``tensor``'s memory with each innermost row as one opaque element."""
    array = tensor.numpy()
    if array.ndim == 0 or (array.shape[-1] > 1 and array.strides[-1] != array.itemsize):
        raise ValueError(f"innermost dimension of a {tuple(tensor.shape)} view is not contiguous")
    element = np.dtype((np.void, array.shape[-1] * array.itemsize))
    if array.shape[-1] == 1:  # any stride will do for one element: make it the element's
        array = np.lib.stride_tricks.as_strided(
            array, array.shape, (*array.strides[:-1], array.itemsize)
        )
    return array.view(element)[..., 0]
