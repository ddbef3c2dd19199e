"""Head-slice and staging-region math for heterogeneous attention TP (pure integers).

Prefill runs attention TP ``P``, decode runs ``D``; the model has ``total_kv_heads`` KV heads.
A rank of either side holds ``hpr(tp) = max(1, total_kv_heads // tp)`` heads: a contiguous
slice when ``tp <= total_kv_heads``, one replicated head otherwise (GQA replication).

* ``P > D`` (fan-in): decode rank ``d`` is fed by the ``k = P // D`` prefill ranks
  ``[d·k, (d+1)·k)``; each sends all its local heads, writer index ``p % k``.
* ``P <= D`` (fan-out): decode rank ``d`` is fed by prefill rank ``d // (D // P)``, which sends
  the slice of its heads that decode rank holds; one writer per chunk.

A chunk's staging region holds its writers back to back; inside a writer, K of layer
``0 .. L-1`` then V of layer ``0 .. L-1``, each block row-major ``[tokens, heads, head_dim]``
(SPEC §3). Both sides derive the region from :func:`compute_staging_layout`, so they cannot
disagree. ``total_kv_heads`` is always given, never guessed from a per-rank head count.

Every function is pure and thread-safe.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "HeadSlice",
    "StagingLayout",
    "WriterPlacement",
    "compute_head_slice_params",
    "compute_staging_layout",
    "decode_ranks_for_prefill",
    "heads_per_rank",
    "rank_heads",
    "num_writers",
    "prefill_ranks_for_decode",
    "validate_tp_pair",
    "writer_index",
    "writer_placements",
]


class HeadSlice(NamedTuple):
    """Which heads one prefill rank sends to one decode rank."""

    src_head_start: int
    """First head to read, in the prefill rank's local head numbering."""
    num_heads: int
    """Heads sent (contiguous on both sides)."""
    dst_head_start: int
    """First head to write, in the decode rank's local head numbering."""


class StagingLayout(NamedTuple):
    """The staging region of one chunk for one decode rank: its writers back to back."""

    num_writers: int
    """Prefill ranks writing into the region (``P // D`` when ``P > D``, else 1)."""
    writer_bytes: tuple[int, ...]
    """Bytes of each writer, in writer-index order."""
    total_bytes: int
    """Sum of ``writer_bytes``: the region size."""
    writer_offsets: tuple[int, ...]
    """Byte offset of each writer from the start of the region."""


class WriterPlacement(NamedTuple):
    """Where one writer's bytes sit in a region and which decode heads they fill (decode side)."""

    byte_offset: int
    """Offset of the writer's bytes from the start of the region."""
    dst_head_start: int
    """First destination head in the decode rank's local numbering."""
    num_heads: int
    """Heads the writer carries."""


def heads_per_rank(total_kv_heads: int, tp: int) -> int:
    """KV heads a rank holds at TP size ``tp``: ``max(1, total_kv_heads // tp)``.

    Args:
        total_kv_heads: KV heads of the whole model.
        tp: attention TP size of the side.

    Returns:
        The per-rank head count (1 under GQA replication).

    Raises:
        ValueError: a non-positive size, or ``tp`` and ``total_kv_heads`` do not divide one
            another.
    """
    _check_heads(total_kv_heads, tp, "tp")
    return max(1, total_kv_heads // tp)


def rank_heads(total_heads: int, tp: int, rank: int) -> list[int]:
    """Global KV heads held by ``rank`` of a side with TP size ``tp``.

    With at least as many heads as ranks, each rank holds a contiguous share; with fewer,
    heads are replicated (GQA): consecutive ranks share one head.
    """
    if total_heads >= tp:
        per = heads_per_rank(total_heads, tp)
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // total_heads)]


def validate_tp_pair(prefill_tp: int, decode_tp: int, total_kv_heads: int | None = None) -> None:
    """Check that a prefill/decode TP pair (and, if given, the head count) is supported.

    Args:
        prefill_tp: attention TP size of prefill (``P``).
        decode_tp: attention TP size of decode (``D``).
        total_kv_heads: KV heads of the whole model, checked against both sizes when given.

    Raises:
        ValueError: a non-positive size, TP sizes that do not divide one another, or a head
            count that does not divide (or is not divided by) a TP size. The message names the
            values.
    """
    for name, value in (("prefill_tp", prefill_tp), ("decode_tp", decode_tp)):
        if value < 1:
            raise ValueError(f"{name}={value!r} must be >= 1")
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp) != 0:
        raise ValueError(
            f"prefill_tp={prefill_tp} and decode_tp={decode_tp} must divide one another"
        )
    if total_kv_heads is not None:
        _check_heads(total_kv_heads, prefill_tp, "prefill_tp")
        _check_heads(total_kv_heads, decode_tp, "decode_tp")


def num_writers(prefill_tp: int, decode_tp: int) -> int:
    """Prefill ranks that write into each chunk region of a decode rank.

    Args:
        prefill_tp: attention TP size of prefill (``P``).
        decode_tp: attention TP size of decode (``D``).

    Returns:
        ``P // D`` when ``P > D``, else 1.

    Raises:
        ValueError: invalid TP sizes (see :func:`validate_tp_pair`).
    """
    validate_tp_pair(prefill_tp, decode_tp)
    return prefill_tp // decode_tp if prefill_tp > decode_tp else 1


def prefill_ranks_for_decode(prefill_tp: int, decode_tp: int, decode_rank: int) -> range:
    """The prefill ranks that feed a decode rank, in writer-index order.

    Args:
        prefill_tp: attention TP size of prefill (``P``).
        decode_tp: attention TP size of decode (``D``).
        decode_rank: the decode rank, ``0 <= decode_rank < D``.

    Returns:
        ``range(d·k, (d+1)·k)`` with ``k = P // D`` when ``P > D``; otherwise the single
        prefill rank ``d // (D // P)``.

    Raises:
        ValueError: invalid TP sizes or a rank out of range.
    """
    validate_tp_pair(prefill_tp, decode_tp)
    _check_rank("decode_rank", decode_rank, decode_tp)
    if prefill_tp > decode_tp:
        k = prefill_tp // decode_tp
        return range(decode_rank * k, (decode_rank + 1) * k)
    source = decode_rank // (decode_tp // prefill_tp)
    return range(source, source + 1)


def decode_ranks_for_prefill(prefill_tp: int, decode_tp: int, prefill_rank: int) -> range:
    """The decode ranks a prefill rank writes to.

    Args:
        prefill_tp: attention TP size of prefill (``P``).
        decode_tp: attention TP size of decode (``D``).
        prefill_rank: the prefill rank, ``0 <= prefill_rank < P``.

    Returns:
        The single decode rank ``p // (P // D)`` when ``P > D``; otherwise the ``D // P``
        decode ranks ``[p·m, (p+1)·m)`` it fans out to.

    Raises:
        ValueError: invalid TP sizes or a rank out of range.
    """
    validate_tp_pair(prefill_tp, decode_tp)
    _check_rank("prefill_rank", prefill_rank, prefill_tp)
    if prefill_tp > decode_tp:
        target = prefill_rank // (prefill_tp // decode_tp)
        return range(target, target + 1)
    m = decode_tp // prefill_tp
    return range(prefill_rank * m, (prefill_rank + 1) * m)


def writer_index(prefill_tp: int, decode_tp: int, prefill_rank: int) -> int:
    """The position of a prefill rank's bytes among the writers of its decode rank's regions.

    Args:
        prefill_tp: attention TP size of prefill (``P``).
        decode_tp: attention TP size of decode (``D``).
        prefill_rank: the prefill rank, ``0 <= prefill_rank < P``.

    Returns:
        ``p % (P // D)`` when ``P > D``, else 0.

    Raises:
        ValueError: invalid TP sizes or a rank out of range.
    """
    validate_tp_pair(prefill_tp, decode_tp)
    _check_rank("prefill_rank", prefill_rank, prefill_tp)
    return prefill_rank % (prefill_tp // decode_tp) if prefill_tp > decode_tp else 0


def compute_head_slice_params(
    src_tp: int, dst_tp: int, src_rank: int, dst_rank: int, total_kv_heads: int
) -> HeadSlice:
    """Which heads prefill rank ``src_rank`` sends to decode rank ``dst_rank`` (SPEC §3).

    Args:
        src_tp: attention TP size of prefill (``P``).
        dst_tp: attention TP size of decode (``D``).
        src_rank: the prefill rank.
        dst_rank: the decode rank.
        total_kv_heads: KV heads of the whole model (never a per-rank count).

    Returns:
        The source head start (prefill-local), head count and destination head start
        (decode-local).

    Raises:
        ValueError: invalid sizes, a rank out of range, or a prefill rank that does not feed
            the decode rank.
    """
    validate_tp_pair(src_tp, dst_tp, total_kv_heads)
    feeders = prefill_ranks_for_decode(src_tp, dst_tp, dst_rank)
    _check_rank("src_rank", src_rank, src_tp)
    if src_rank not in feeders:
        raise ValueError(
            f"prefill rank src_rank={src_rank} does not feed decode rank dst_rank={dst_rank} "
            f"at src_tp={src_tp}, dst_tp={dst_tp} (its feeders are "
            f"{feeders.start}..{feeders.stop - 1})"
        )
    src_hpr = heads_per_rank(total_kv_heads, src_tp)
    dst_hpr = heads_per_rank(total_kv_heads, dst_tp)
    if src_tp > dst_tp:
        rep = max(1, src_tp // total_kv_heads)
        return HeadSlice(0, src_hpr, ((src_rank % src_tp) // rep * src_hpr) % dst_hpr)
    rep = max(1, dst_tp // total_kv_heads)
    return HeadSlice(((dst_rank % dst_tp) // rep * dst_hpr) % src_hpr, dst_hpr, 0)


def compute_staging_layout(
    src_tp: int,
    dst_tp: int,
    dst_rank: int,
    total_kv_heads: int,
    num_tokens: int,
    bytes_per_head_token: int,
    num_layers: int,
) -> StagingLayout:
    """The staging region of one chunk for decode rank ``dst_rank`` (SPEC §3).

    Writer ``w`` holds ``num_tokens · n(w) · bytes_per_head_token · num_layers · 2`` bytes
    (K and V), writers back to back in writer-index order.

    Args:
        src_tp: attention TP size of prefill (``P``).
        dst_tp: attention TP size of decode (``D``).
        dst_rank: the decode rank.
        total_kv_heads: KV heads of the whole model (never a per-rank count).
        num_tokens: tokens in the chunk (whole pages).
        bytes_per_head_token: ``head_dim · element size`` of the KV dtype.
        num_layers: layers carried (this pipeline stage's).

    Returns:
        Writer count, per-writer sizes and offsets, and the total size in bytes.

    Raises:
        ValueError: a non-positive size, invalid TP sizes or head count, or a rank out of
            range.
    """
    for name, value in (
        ("num_tokens", num_tokens),
        ("bytes_per_head_token", bytes_per_head_token),
        ("num_layers", num_layers),
    ):
        if value < 1:
            raise ValueError(f"{name}={value!r} must be >= 1")
    validate_tp_pair(src_tp, dst_tp, total_kv_heads)
    feeders = prefill_ranks_for_decode(src_tp, dst_tp, dst_rank)
    per_head = num_tokens * bytes_per_head_token * num_layers * 2
    sizes = tuple(
        compute_head_slice_params(src_tp, dst_tp, p, dst_rank, total_kv_heads).num_heads * per_head
        for p in feeders
    )
    offsets: list[int] = []
    position = 0
    for size in sizes:
        offsets.append(position)
        position += size
    return StagingLayout(len(sizes), sizes, position, tuple(offsets))


def writer_placements(
    src_tp: int,
    dst_tp: int,
    dst_rank: int,
    total_kv_heads: int,
    num_tokens: int,
    bytes_per_head_token: int,
    num_layers: int,
) -> tuple[WriterPlacement, ...]:
    """The placement of every writer in a chunk region of decode rank ``dst_rank``.

    **Side:** decode, to hand to ``kernels.scatter_chunk``.

    Args:
        src_tp: attention TP size of prefill (``P``).
        dst_tp: attention TP size of decode (``D``).
        dst_rank: the decode rank.
        total_kv_heads: KV heads of the whole model.
        num_tokens: tokens in the chunk (whole pages).
        bytes_per_head_token: ``head_dim · element size`` of the KV dtype.
        num_layers: layers carried.

    Returns:
        One placement per writer, in writer-index order.

    Raises:
        ValueError: as :func:`compute_staging_layout`.
    """
    layout = compute_staging_layout(
        src_tp, dst_tp, dst_rank, total_kv_heads, num_tokens, bytes_per_head_token, num_layers
    )
    feeders = prefill_ranks_for_decode(src_tp, dst_tp, dst_rank)
    placements = []
    for offset, p in zip(layout.writer_offsets, feeders, strict=True):
        head_slice = compute_head_slice_params(src_tp, dst_tp, p, dst_rank, total_kv_heads)
        placements.append(WriterPlacement(offset, head_slice.dst_head_start, head_slice.num_heads))
    return tuple(placements)


def _check_heads(total_kv_heads: int, tp: int, tp_name: str) -> None:
    if total_kv_heads < 1:
        raise ValueError(f"total_kv_heads={total_kv_heads!r} must be >= 1")
    if tp < 1:
        raise ValueError(f"{tp_name}={tp!r} must be >= 1")
    if total_kv_heads % tp != 0 and tp % total_kv_heads != 0:
        raise ValueError(
            f"total_kv_heads={total_kv_heads} and {tp_name}={tp} must divide one another"
        )


def _check_rank(name: str, rank: int, tp: int) -> None:
    if not 0 <= rank < tp:
        raise ValueError(f"{name}={rank!r} is out of range for TP size {tp}")
