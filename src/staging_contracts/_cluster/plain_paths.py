"""The two paths the staged transfer is measured against, as the same rank processes run them.

``TransferConfig(mode="per-token")`` and ``mode="raw"`` (see
:attr:`~staging_contracts._run.workload.TransferConfig.mode`, and docs/benchmarks.md for what
each measures) run through the ranks of :mod:`~staging_contracts._cluster.rank`, with the same
writers, receivers and bytes as the staged path. This module holds what is particular to
them, and does no I/O of its own: the per-token path's plan (:func:`per_token_writes`,
:func:`per_token_batch`), the raw path's bytes (:func:`raw_share`, :func:`raw_offset`,
:func:`verify_raw`), and the :class:`PlainDone` message by which each writer tells a decode
rank that its writes of a request landed, counted by :class:`ArrivalBook`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Final

import torch

from .._control.wire import MalformedMessage
from .._run.workload import RequestPlan, TransferConfig, head_data, rank_heads, token_rows
from .._staging.layout import (
    StagingLayout,
    compute_head_slice_params,
    compute_staging_layout,
    prefill_ranks_for_decode,
)
from ..backends._kv_requests import KVPoll
from ..engines import ENGINES
from ..protocols import KVBufferTensors, Transfer, TransferEngine

logger = logging.getLogger(__name__)

MOONCAKE_MAX_TRANSFERS_PER_WRITE: Final = 1024
"""Largest Mooncake ``write`` of the per-token path: its TCP transport rejects a batch of
more than about 2048 transfers to one peer ("TCP lane queue-full"; not raised by
``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` or ``MC_TCP_LANES_PER_PEER``)."""


def engine_name(engine: TransferEngine) -> str | None:
    """The in-tree name of ``engine``'s class (``"nixl"``, ``"mooncake"``, ``"local"``), or
    ``None`` for an engine of another package."""
    module = type(engine).__module__
    return next((name for name, spec in ENGINES.items() if spec.module == module), None)


def per_token_batch(engine: str | None, tokens: int) -> int:
    """Transfers per ``write`` call of the per-token path (0: all of a pass in one call).

    As SGLang's non-staging heterogeneous-TP paths submit them: Mooncake one call per
    layer's K or V buffer, split at :data:`MOONCAKE_MAX_TRANSFERS_PER_WRITE`; NIXL every
    transfer of a pass (one request to one decode rank) in one call. Any other engine
    (``None`` included): one call per layer buffer.
    """
    if engine == "nixl":
        return 0
    if engine == "mooncake":
        return min(tokens, MOONCAKE_MAX_TRANSFERS_PER_WRITE)
    return tokens


def pool_pointers(pool: KVBufferTensors) -> tuple[int, ...]:
    """The address of each pool tensor: K of layers ``0..L-1``, then V."""
    return tuple(t.data_ptr() for t in (*pool.k_buffers, *pool.v_buffers))


def pool_regions(pool: KVBufferTensors) -> list[tuple[int, int]]:
    """``(address, bytes)`` of the memory a pool spans, adjacent tensors merged: one region
    for views of one KV cache allocation, one per tensor for pools allocated one by one."""
    spans = sorted(
        (t.data_ptr(), t.numel() * t.element_size()) for t in (*pool.k_buffers, *pool.v_buffers)
    )
    regions: list[tuple[int, int]] = []
    for ptr, size in spans:
        if regions and regions[-1][0] + regions[-1][1] == ptr:
            regions[-1] = (regions[-1][0], regions[-1][1] + size)
        else:
            regions.append((ptr, size))
    return regions


def _row_bytes(config: TransferConfig, tp: int, rank: int) -> int:
    return len(rank_heads(config.kv_heads, tp, rank)) * config.head_dim * config.element_size


def per_token_writes(
    config: TransferConfig,
    plan: RequestPlan,
    prefill_rank: int,
    prefill_pool: Sequence[int],
    decode_rank: int,
    decode_pool: Sequence[int],
    batch: int,
) -> list[list[Transfer]]:
    """The ``write`` calls that send one request's heads from a prefill rank's pool into a
    decode rank's pool, one transfer per (K/V, layer, token).

    Args:
        config: the run.
        plan: the request (its pages on both sides).
        prefill_rank: the writer; it must feed ``decode_rank``.
        prefill_pool: the writer's pool tensor addresses (:func:`pool_pointers`).
        decode_rank: the receiver.
        decode_pool: the receiver's pool tensor addresses, as it published them.
        batch: transfers per call within one layer's K or V buffer (:func:`per_token_batch`;
            0: every transfer in one call).

    Returns:
        The calls, in (K/V, layer, token) order; each a list of transfers.

    Raises:
        ValueError: the prefill rank does not feed the decode rank, or a pool has not
            ``2 * layers`` tensors.
    """
    if len(prefill_pool) != 2 * config.layers or len(decode_pool) != 2 * config.layers:
        raise ValueError(f"a pool needs {2 * config.layers} tensor addresses (K, then V)")
    head = compute_head_slice_params(
        config.prefill_tp, config.decode_tp, prefill_rank, decode_rank, config.kv_heads
    )
    head_bytes = config.head_dim * config.element_size
    src_row = _row_bytes(config, config.prefill_tp, prefill_rank)
    dst_row = _row_bytes(config, config.decode_tp, decode_rank)
    length = head.num_heads * head_bytes
    src_rows = (token_rows(plan.prefill_pages, config.page_size) * src_row).tolist()
    dst_rows = (token_rows(plan.decode_pages, config.page_size) * dst_row).tolist()
    buffers: list[list[Transfer]] = []  # one per K or V buffer of a layer
    for src_base, dst_base in zip(prefill_pool, decode_pool, strict=True):
        src = src_base + head.src_head_start * head_bytes
        dst = dst_base + head.dst_head_start * head_bytes
        buffers.append(
            [Transfer(src + s, dst + d, length) for s, d in zip(src_rows, dst_rows, strict=True)]
        )
    if batch == 0:
        return [[transfer for buffer in buffers for transfer in buffer]]
    return [buffer[i : i + batch] for buffer in buffers for i in range(0, len(buffer), batch)]


def raw_request_bytes(config: TransferConfig, decode_rank: int) -> int:
    """Bytes one request takes in a decode rank's raw buffer (every writer's share)."""
    return _whole_request_layout(config, decode_rank).total_bytes


def raw_offset(config: TransferConfig, index: int, prefill_rank: int, decode_rank: int) -> int:
    """Where a prefill rank's share of request ``index`` goes in a decode rank's raw buffer:
    requests back to back, writers back to back within one (as in a staging region)."""
    layout = _whole_request_layout(config, decode_rank)
    writers = list(prefill_ranks_for_decode(config.prefill_tp, config.decode_tp, decode_rank))
    return index * layout.total_bytes + layout.writer_offsets[writers.index(prefill_rank)]


def _whole_request_layout(config: TransferConfig, decode_rank: int) -> StagingLayout:
    return compute_staging_layout(
        config.prefill_tp,
        config.decode_tp,
        decode_rank,
        config.kv_heads,
        config.num_pages * config.page_size,
        config.head_dim * config.element_size,
        config.layers,
    )


def raw_share(
    config: TransferConfig, index: int, prefill_rank: int, decode_rank: int
) -> torch.Tensor:
    """The bytes a prefill rank sends a decode rank for request ``index`` in raw mode: its
    heads for that rank (the staged share), K of every layer then V, each head's tokens in
    order, as one CPU ``uint8`` tensor."""
    head = compute_head_slice_params(
        config.prefill_tp, config.decode_tp, prefill_rank, decode_rank, config.kv_heads
    )
    heads = rank_heads(config.kv_heads, config.prefill_tp, prefill_rank)
    sent = heads[head.src_head_start : head.src_head_start + head.num_heads]
    parts = [
        head_data(config, index, layer, kind, global_head).reshape(-1).view(torch.uint8)
        for kind in (0, 1)
        for layer in range(config.layers)
        for global_head in sent
    ]
    return torch.cat(parts)


def verify_raw(
    buffer: torch.Tensor, config: TransferConfig, decode_rank: int, requests: Iterable[int]
) -> list[str]:
    """Compare a decode rank's raw buffer with every writer's share of ``requests``, byte for
    byte.

    Returns:
        One line per mismatching (request, writer); empty when all match.
    """
    problems: list[str] = []
    for index in requests:
        for writer in prefill_ranks_for_decode(config.prefill_tp, config.decode_tp, decode_rank):
            want = raw_share(config, index, writer, decode_rank).to(buffer.device)
            start = raw_offset(config, index, writer, decode_rank)
            got = buffer[start : start + want.numel()]
            if not torch.equal(got, want):
                wrong = int((got != want).sum())
                problems.append(f"request {index} from prefill {writer}: {wrong} bytes differ")
    return problems


@dataclass(frozen=True, slots=True)
class PlainDone:
    """A prefill rank's writes of one request to one decode rank ended (prefill → decode).

    Frames: ``PLAIN_DONE``, room, prefill rank, ``1`` (every write returned) or ``0`` (a
    write failed; the room fails).
    """

    KIND: ClassVar[bytes] = b"PLAIN_DONE"

    room: int
    prefill_rank: int
    ok: bool

    def to_frames(self) -> list[bytes]:
        """Encode as multipart frames."""
        return [self.KIND, b"%d" % self.room, b"%d" % self.prefill_rank, b"1" if self.ok else b"0"]

    @classmethod
    def from_frames(cls, frames: Sequence[bytes]) -> PlainDone:
        """Decode, strictly.

        Raises:
            MalformedMessage: not four frames, another kind, a non-decimal number or a flag
                other than ``0``/``1``.
        """
        if len(frames) != 4 or bytes(frames[0]) != cls.KIND:
            raise MalformedMessage("PLAIN_DONE needs 4 frames: kind, room, prefill rank, ok")
        room, rank, ok = (bytes(f) for f in frames[1:])
        if not (room.isdigit() and rank.isdigit() and len(room) <= 18 and len(rank) <= 6):
            raise MalformedMessage("PLAIN_DONE: room and prefill rank must be decimal")
        if ok not in (b"0", b"1"):
            raise MalformedMessage("PLAIN_DONE: ok must be 0 or 1")
        return cls(int(room), int(rank), ok == b"1")


class ArrivalBook:
    """A decode rank's view of the plain paths' requests: which writers' writes landed.

    A room is complete when every prefill rank feeding this decode rank sent ``PLAIN_DONE``
    for it: SUCCESS when all said ok, FAILED when one did not. The moment the last one
    arrives is stamped (``time.monotonic()``) on the listener thread that delivered it.

    **Side:** decode. **Thread-safety:** :meth:`on_message` runs on the listener thread;
    :meth:`expect`, :meth:`wait`, :meth:`done_at` and :meth:`failure` on any other.

    Args:
        writers: the prefill ranks feeding this decode rank.
        endpoints: each prefill rank's control listener (for :meth:`authorize`), filled in
            once known.
    """

    def __init__(self, writers: Iterable[int], endpoints: Mapping[int, str] | None = None) -> None:
        self.writers = frozenset(writers)
        """The prefill ranks feeding this decode rank."""
        self._endpoints: dict[int, str] = dict(endpoints or {})
        self._cond = threading.Condition()
        self._rooms: dict[int, dict[int, bool]] = {}
        self._done: dict[int, tuple[KVPoll, float]] = {}
        self.malformed = 0
        """``PLAIN_DONE`` messages dropped as malformed, unexpected or duplicated."""

    def set_endpoints(self, endpoints: Mapping[int, str]) -> None:
        """The prefill ranks' control listeners, once known from the bootstrap."""
        with self._cond:
            self._endpoints = dict(endpoints)

    def expect(self, rooms: Iterable[int]) -> None:
        """Rooms whose writers will report (before the writers may start)."""
        with self._cond:
            for room in rooms:
                self._rooms[room] = {}
                self._done.pop(room, None)

    def authorize(self, frames: Sequence[bytes], sender: str) -> bool:
        """``PLAIN_DONE`` only from the listener of the prefill rank it names (every other
        message passes: this book decides about its own only)."""
        if not frames or bytes(frames[0]) != PlainDone.KIND:
            return True
        if len(frames) < 3 or not bytes(frames[2]).isdigit() or len(frames[2]) > 6:
            return True  # malformed: the codec counts it
        with self._cond:
            return self._endpoints.get(int(frames[2])) == sender

    def on_message(self, frames: list[bytes]) -> None:
        """A writer's ``PLAIN_DONE`` (listener thread).

        Raises:
            MalformedMessage: the frames do not decode, or name an unknown room or writer,
                or repeat a writer's report (counted in :attr:`malformed`).
        """
        now = time.monotonic()
        try:
            done = PlainDone.from_frames(frames)
        except MalformedMessage:
            with self._cond:
                self.malformed += 1
            raise
        with self._cond:
            arrived = self._rooms.get(done.room)
            if arrived is None or done.prefill_rank not in self.writers:
                self.malformed += 1
                raise MalformedMessage(f"PLAIN_DONE for unknown room {done.room} or writer")
            if done.prefill_rank in arrived or done.room in self._done:
                self.malformed += 1
                raise MalformedMessage(f"PLAIN_DONE repeated for room {done.room}")
            arrived[done.prefill_rank] = done.ok
            if set(arrived) == self.writers:
                state = KVPoll.Success if all(arrived.values()) else KVPoll.Failed
                self._done[done.room] = (state, now)
                self._cond.notify_all()

    def wait(self, room: int, timeout_s: float) -> KVPoll:
        """Block until every writer of ``room`` reported, or ``timeout_s`` passed; the room's
        state then (``Transferring`` while writers are missing)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while room not in self._done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return KVPoll.Transferring
                self._cond.wait(remaining)
            return self._done[room][0]

    def done_at(self, room: int) -> float | None:
        """When the room's last writer report arrived (``None``: not yet)."""
        with self._cond:
            found = self._done.get(room)
            return None if found is None else found[1]

    def failure(self, room: int) -> str | None:
        """Which writers failed the room, if any did."""
        with self._cond:
            failed = sorted(rank for rank, ok in self._rooms.get(room, {}).items() if not ok)
        return f"prefill ranks {failed} failed their writes" if failed else None


class RoomWaiter:
    """One room of an :class:`ArrivalBook`, waitable like a ``KVReceiver``."""

    def __init__(self, book: ArrivalBook, room: int) -> None:
        self._book = book
        self.room = room

    def wait(self, timeout_s: float) -> KVPoll:
        """Block until the room ended or ``timeout_s`` passed; its state."""
        return self._book.wait(self.room, timeout_s)

    def failure(self) -> str | None:
        """Which writers failed the room, if any did."""
        return self._book.failure(self.room)
