"""The KV layout the transfer anchors send: one prefill rank's share to one decode rank.

Plain data, no I/O: the benchmark process, its anchor children and the tests all build the
same :class:`AnchorGeometry`, so it lives apart from the modules that run the anchors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from .._run.workload import TransferConfig, rank_heads, require_positive

__all__ = ["BENCH_GEOMETRY", "AnchorGeometry"]


@dataclass(frozen=True, slots=True)
class AnchorGeometry:
    """The KV layout of one prefill rank sending to one decode rank of another TP size.

    Each pool is one tensor ``[pool_tokens, heads, head_dim]`` per layer for K and for V.
    With fewer heads per prefill rank than per decode rank (P > D), a transfer carries all
    of the prefill row into a head offset of the decode row; with more (P < D), a head
    offset of the prefill row into all of the decode row.

    Raises:
        ValueError: a size is not positive, or the larger head count is not a multiple of
            the smaller.
    """

    layers: int
    """Layers held by both ranks (one K and one V pool tensor each)."""
    heads_per_prefill_rank: int
    """KV heads in a prefill pool row (total heads / prefill TP size)."""
    heads_per_decode_rank: int
    """KV heads in a decode pool row (total heads / decode TP size)."""
    head_dim: int
    """Elements per head."""
    element_size: int
    """Bytes per element (2 for bf16)."""
    tokens: int
    """Tokens of the whole request (a measurement may send a subset)."""
    page_size: int = 16
    """Tokens per page of the pools (pages are placed at random, as a paged pool does)."""

    def __post_init__(self) -> None:
        require_positive(self)
        small, large = sorted((self.heads_per_prefill_rank, self.heads_per_decode_rank))
        if large % small:
            raise ValueError(
                f"heads_per_prefill_rank={self.heads_per_prefill_rank} and"
                f" heads_per_decode_rank={self.heads_per_decode_rank}: the larger must be a"
                " multiple of the smaller"
            )

    @property
    def heads_sent(self) -> int:
        """Heads in one per-token transfer (the smaller of the two head counts)."""
        return min(self.heads_per_prefill_rank, self.heads_per_decode_rank)

    @property
    def slice_bytes(self) -> int:
        """Bytes of one per-token transfer."""
        return self.heads_sent * self.head_dim * self.element_size

    @property
    def prefill_row_bytes(self) -> int:
        """Bytes of one token row of a prefill pool tensor."""
        return self.heads_per_prefill_rank * self.head_dim * self.element_size

    @property
    def decode_row_bytes(self) -> int:
        """Bytes of one token row of a decode pool tensor."""
        return self.heads_per_decode_rank * self.head_dim * self.element_size

    @property
    def head_offsets_bytes(self) -> tuple[int, int]:
        """``(source, destination)`` byte offset of the slice within its row.

        The measured prefill rank is the last one feeding its decode rank (P > D), or the
        decode rank is the last one fed by its prefill rank (P < D), so that the offset is
        not zero whenever the head counts differ.
        """
        head = self.head_dim * self.element_size
        prefill, decode = self.heads_per_prefill_rank, self.heads_per_decode_rank
        if prefill <= decode:
            return 0, (decode - prefill) * head
        return (prefill - decode) * head, 0

    @classmethod
    def of(cls, config: TransferConfig) -> AnchorGeometry:
        """The layout of ``config``'s request, one prefill rank to one decode rank."""
        return cls(
            config.layers,
            len(rank_heads(config.kv_heads, config.prefill_tp, 0)),
            len(rank_heads(config.kv_heads, config.decode_tp, 0)),
            config.head_dim,
            config.element_size,
            config.tokens,
            config.page_size,
        )

    def share_bytes(self, tokens: int | None = None) -> int:
        """Bytes of K and V that one prefill rank sends one decode rank for ``tokens``."""
        count = self.tokens if tokens is None else tokens
        return 2 * self.layers * count * self.slice_bytes


BENCH_GEOMETRY: Final = AnchorGeometry.of(TransferConfig(layers=32, tokens=4096))
"""The benchmark's request: 32 layers, 8 KV heads of 128, bf16, 4096 tokens, P=4 -> D=2."""
