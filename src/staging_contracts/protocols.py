"""The domain types of the staging path: what a host must provide, and the records it holds.

The central piece is :class:`StagingHost`, the contract between
:class:`~staging_contracts.mixin.StagingManagerMixin` and every transfer backend that mixes it
in. Its members, each with the type the backend must declare:

========================  ===========================================================  ========
member                    type                                                         required
========================  ===========================================================  ========
``_staging_handler``      ``StagingHandler | None`` (``None`` until attached)          yes
``_staging_ctx``          ``DecodeStagingContext | PrefillStagingContext | None``      yes
``kv_args``               ``KVArgs``                                                   yes
``attn_tp_size``          ``int``                                                      yes
``arrival``               ``ArrivalMode`` (a property: the backend's staging capability)  yes
``kv_buffer_tensors``     ``KVBufferTensors | None``                                   optional
========================  ===========================================================  ========

``arrival`` is what makes a backend a staging backend: how its prefill writers tell decode
that a write landed, which only a backend that stages can say (``CommonKVManager`` does not,
so a Mori-like backend given the mixin is rejected for lacking it). ``_staging_handler`` and
``kv_buffer_tensors`` are set after construction (the handler is attached, the pool handed
over at start-up): the contract marks them ``set_later``, so every assignment is checked.

A Protocol cannot mark a member optional, so the required part is its own Protocol,
:class:`StagingHostCore`, which the mixin's methods use as their self-type and which bounds the
witness a backend states (``__contract: ClassVar[StagingHostCheck[MyKVManager]]``, see
:class:`~staging_contracts.mixin.StagingHostCheck`). Its members are read-only properties, so
that a type checker accepts exactly what the class check accepts (a narrower declared type, an
``__init__`` assignment); a backend declares them as plain attributes or properties.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, TypeAlias, runtime_checkable

from .stats import StagingCounters

if TYPE_CHECKING:
    import torch

__all__ = [
    "Allocation",
    "ArrivalMode",
    "ArrivalOutcome",
    "DecodeStagingContext",
    "KVArgs",
    "KVArgsRecord",
    "KVBufferTensors",
    "Notification",
    "PrefillStagingContext",
    "RegionAnswer",
    "RegionBook",
    "StagingHandler",
    "StagingHost",
    "StagingHostCore",
    "StagingReqOutcome",
    "StagingRing",
    "Transfer",
    "TransferEngine",
    "TransferError",
    "Watermark",
    "WatermarkBook",
]


# --------------------------------------------------------------------------- KV arguments

ArrivalMode: TypeAlias = Literal["notification", "zmq"]
"""How a prefill writer tells decode that its write landed: ``"notification"``, the
``CHUNK_READY`` fields as the bulk write's notification payload (the engine must support
notifications); ``"zmq"``, a ``CHUNK_READY`` message to decode's listener after the write
completed."""


@runtime_checkable
class KVArgs(Protocol):
    """What the staging path reads from a backend's KV arguments.

    Read-only, so that a frozen record (:class:`KVArgsRecord`) or a serving stack's own
    mutable ``KVArgs`` object both satisfy it.
    """

    @property
    def page_size(self) -> int:
        """Tokens per KV page (>= 1)."""
        ...

    @property
    def kv_item_lens(self) -> Sequence[int]:
        """Bytes of one page of each registered KV buffer (K buffers, then V buffers)."""
        ...

    @property
    def engine_rank(self) -> int:
        """This rank's index among the attention TP ranks of its side."""
        ...

    @property
    def device(self) -> str:
        """Device of the KV pool and the staging ring, e.g. ``"cpu"`` or ``"cuda:0"``."""
        ...

    @property
    def total_kv_head_num(self) -> int:
        """KV heads of the whole model (never guessed from a per-rank count)."""
        ...

    @property
    def kv_head_num(self) -> int:
        """KV heads held by this rank."""
        ...

    @property
    def kv_layer_ids(self) -> Sequence[int]:
        """Layer ids held by this rank (its pipeline stage)."""
        ...

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline-parallel stage."""
        ...


@dataclass(frozen=True, slots=True)
class KVArgsRecord:
    """A concrete, validated :class:`KVArgs`.

    Raises:
        ValueError: a size is not positive, a rank is negative, or the per-rank head count
            exceeds the model's.
    """

    page_size: int
    kv_item_lens: tuple[int, ...]
    engine_rank: int
    device: str
    total_kv_head_num: int
    kv_head_num: int
    kv_layer_ids: tuple[int, ...]
    pp_rank: int = 0

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in ("page_size", "total_kv_head_num", "kv_head_num"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)!r} must be >= 1")
        for name in ("engine_rank", "pp_rank"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)!r} must be >= 0")
        if any(length < 1 for length in self.kv_item_lens):
            problems.append(f"kv_item_lens={self.kv_item_lens!r} must all be >= 1")
        if self.kv_head_num > self.total_kv_head_num:
            problems.append(
                f"kv_head_num={self.kv_head_num} exceeds total_kv_head_num={self.total_kv_head_num}"
            )
        if problems:
            raise ValueError("invalid KVArgsRecord: " + "; ".join(problems))


@dataclass(frozen=True, slots=True)
class KVBufferTensors:
    """The paged KV pool of one rank: one tensor per layer for K and for V.

    Each tensor is ``[pool_tokens, heads, head_dim]`` (page ``p`` holds tokens
    ``p * page_size .. (p + 1) * page_size - 1``). Ownership stays with the backend; the
    staging path reads (prefill) or writes (decode) them in place.
    """

    k_buffers: tuple[torch.Tensor, ...]
    v_buffers: tuple[torch.Tensor, ...]
    page_size: int

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size={self.page_size!r} must be >= 1")
        if len(self.k_buffers) != len(self.v_buffers):
            raise ValueError(f"{len(self.k_buffers)} K buffers but {len(self.v_buffers)} V buffers")
        if not self.k_buffers:
            raise ValueError("KVBufferTensors needs at least one layer")

    @property
    def num_layers(self) -> int:
        """Layers held (length of ``k_buffers``)."""
        return len(self.k_buffers)


# --------------------------------------------------------------------------- ring records


class Watermark(NamedTuple):
    """How far decode has freed its staging ring: everything before ``tail`` in ``round``."""

    round: int
    tail: int


class Allocation(NamedTuple):
    """One region of the staging ring: ``[offset, end)`` in ring round ``round``."""

    alloc_id: int
    offset: int
    round: int
    end: int


class StagingRing(Protocol):
    """The decode ring allocator as the handler uses it (``allocator.StagingAllocator``)."""

    @property
    def total_size(self) -> int:
        """Ring size in bytes."""
        ...

    @property
    def base_ptr(self) -> int:
        """Address of the ring buffer (registered with the transfer engine)."""
        ...

    @property
    def live_count(self) -> int:
        """Allocations assigned and not yet freed."""
        ...

    def assign(self, size: int) -> Allocation | None:
        """Take a region of ``size`` bytes; ``None`` if it can never fit."""
        ...

    def free(self, alloc_id: int) -> None:
        """Release a region (unknown ids are ignored)."""
        ...

    def get_watermark(self) -> Watermark:
        """The current watermark."""
        ...


class WatermarkBook(Protocol):
    """Prefill side: the latest watermark seen from each decode session."""

    def observe(self, session_id: str, watermark: Watermark) -> bool:
        """Record a watermark; returns ``True`` if it moved the session's watermark forward."""
        ...

    def latest(self, session_id: str) -> Watermark:
        """The newest watermark of a session (``Watermark(0, 0)`` before any)."""
        ...

    def is_ready(self, session_id: str, alloc_round: int, alloc_end: int) -> bool:
        """May a region of ``alloc_round`` ending at ``alloc_end`` be written now?"""
        ...


class RegionAnswer(NamedTuple):
    """Decode's answer to a STAGING_REQ: the region ``[offset, end)`` of ring round ``round``.

    ``offset == -2`` (``ALLOC_OVERSIZED``, with ``round == 0`` and ``end == -1``) means the
    chunk can never fit the ring, or decode refused it: the room fails.
    """

    offset: int
    round: int
    end: int

    @property
    def refused(self) -> bool:
        """True for the failure answer (offset -2)."""
        return self.offset < 0


class RegionBook(Protocol):
    """Prefill side: the regions decode announced, per (room, chunk, decode session)."""

    def record(self, room: int, chunk_idx: int, session_id: str, answer: RegionAnswer) -> None:
        """Store an answer (the latest wins) and wake any waiter."""
        ...

    def get(self, room: int, chunk_idx: int, session_id: str) -> RegionAnswer | None:
        """The answer for a chunk, or ``None`` before one arrived."""
        ...


# --------------------------------------------------------------------------- contexts


@dataclass(frozen=True, slots=True)
class DecodeStagingContext:
    """Decode-side staging state a host holds in ``_staging_ctx``.

    **Side:** decode. **Thread-safety:** the allocator and the counters are thread-safe; the
    record itself is frozen.
    """

    allocator: StagingRing
    """The ring the prefill ranks write into."""
    counters: StagingCounters = field(default_factory=StagingCounters)
    """What the mixin's message handling counted."""


@dataclass(frozen=True, slots=True)
class PrefillStagingContext:
    """Prefill-side staging state a host holds in ``_staging_ctx``.

    **Side:** prefill. **Thread-safety:** both books and the counters are thread-safe.
    """

    watermarks: WatermarkBook
    """Latest watermark per decode session, fed by ``WATERMARK`` messages."""
    regions: RegionBook
    """Regions announced by ``STAGING_RSP`` messages."""
    counters: StagingCounters = field(default_factory=StagingCounters)
    """What the mixin's message handling counted."""
    idle: Callable[[], object] | None = None
    """Periodic work of the writer (re-sends of ``CHUNK_READY``), run by the listener's
    idle hook (``staging_idle``) on the listener thread; ``None``: none."""


# --------------------------------------------------------------------------- handler


class StagingReqOutcome(enum.Enum):
    """What a decode handler did with one ``STAGING_REQ``."""

    ALLOCATED = "allocated"
    """A new region was assigned and announced."""
    SHARED = "shared"
    """The chunk already had a region (another writer of it asked first); re-announced."""
    OVERSIZED = "oversized"
    """The chunk can never fit the ring; answered with offset -2."""
    UNKNOWN_ROOM = "unknown-room"
    """The room is not registered; dropped."""
    REJECTED = "rejected"
    """Consumed chunk, chunk beyond the room, or a geometry mismatch; answered as a failure."""
    DEFERRED = "deferred"
    """The requester's prefill instance holds its share of the ring already: no region yet,
    not answered; its writers ask again and are answered once its own regions free."""


class ArrivalOutcome(enum.Enum):
    """What a decode handler did with one writer's arrival signal."""

    WAITING = "waiting"
    """Counted; other writers of the chunk are still outstanding."""
    COMPLETE = "complete"
    """Last writer arrived; the scatter was submitted."""
    DUPLICATE = "duplicate"
    """This writer had already arrived; ignored."""
    UNKNOWN = "unknown"
    """No such room or chunk region; dropped."""
    REJECTED = "rejected"
    """Geometry disagrees with the other writers, or the scatter failed; the room failed."""


@runtime_checkable
class StagingHandler(Protocol):
    """The decode-side handler the mixin hands decoded staging messages to.

    **Side:** decode. **Called by:** the host's listener thread, through the mixin's
    ``_handle_staging_req`` and ``_handle_chunk_ready``. **Thread-safety:** implementations
    must be safe to call from the listener thread while the scheduler thread registers and
    tears down rooms.
    """

    def handle_staging_req(
        self, room: int, chunk_idx: int, *, num_pages: int, session_id: str, pp_rank: int | None
    ) -> StagingReqOutcome:
        """Assign (or re-announce) the chunk's ring region and answer the room's prefill ranks."""
        ...

    def handle_chunk_arrival(
        self,
        room: int,
        chunk_idx: int,
        *,
        page_start: int,
        num_pages: int,
        session_id: str,
        writer_rank: int | None,
    ) -> ArrivalOutcome:
        """Count one writer's arrival; scatter and free the region when all have arrived."""
        ...


# --------------------------------------------------------------------------- engines


class TransferError(RuntimeError):
    """A transfer engine could not move the bytes (the request fails, never the thread)."""


class Transfer(NamedTuple):
    """One contiguous copy of a bulk write: ``length`` bytes from ``local`` to ``remote``."""

    local: int
    """Address in memory this engine registered."""
    remote: int
    """Address in memory the peer registered."""
    length: int
    """Bytes to copy (>= 1)."""


class Notification(NamedTuple):
    """An arrival notification delivered by the engine after the data it follows."""

    peer: str
    """Session id of the engine that wrote."""
    payload: bytes
    """What the writer attached to its write."""


class TransferEngine(Protocol):
    """Moves bytes from registered local memory into a peer's registered memory.

    One instance per process side (a prefill or decode rank). Implementations:
    ``engines.local.LocalEngine`` (same process), ``engines.mooncake.MooncakeEngine``,
    ``engines.nixl.NixlEngine``.

    **Thread-safety:** ``write`` may be called from one worker thread while another thread
    polls notifications; registration happens before transfers start.
    """

    @property
    def session_id(self) -> str:
        """How peers name this engine (Mooncake ``host:port``, NIXL agent name)."""
        ...

    @property
    def supports_notifications(self) -> bool:
        """True when ``write(..., notify=...)`` delivers the payload to the peer (NIXL)."""
        ...

    def metadata(self) -> bytes:
        """What a peer passes to ``add_peer`` to reach this engine (exchanged at bootstrap)."""
        ...

    def add_peer(self, session_id: str, metadata: bytes) -> None:
        """Make a peer reachable for ``write`` (idempotent)."""
        ...

    def register(self, ptr: int, length: int) -> None:
        """Register ``length`` bytes at ``ptr`` for transfers (a tensor's ``data_ptr()``)."""
        ...

    def deregister(self, ptr: int) -> None:
        """Undo ``register`` (unknown addresses are ignored)."""
        ...

    def write(self, peer: str, transfers: Sequence[Transfer], notify: bytes | None = None) -> None:
        """Copy every transfer into the peer's memory; return once all bytes have landed.

        With ``notify`` (only when ``supports_notifications``), the peer receives
        ``Notification(self.session_id, notify)`` after the data.

        **Blocking:** yes, until the write completed; the source memory may be reused then.

        Raises:
            TransferError: the engine reported a failure; nothing is known about the bytes.
        """
        ...

    def poll_notifications(self) -> list[Notification]:
        """Notifications received since the last call (also drives progress where needed)."""
        ...

    def close(self) -> None:
        """Deregister everything and release the engine; safe to call twice."""
        ...


# --------------------------------------------------------------------------- the host


class StagingHostCore(Protocol):
    """The members every staging host must declare (the mixin's self-type).

    Every member is read-only here, so that what a host may declare is what the runtime check
    accepts: a narrower type (``kv_args: KVArgsRecord``, ``_staging_handler:
    DecodeStagingHandler | None``), a plain attribute, a property, or an ``__init__``
    assignment. (A writable Protocol attribute would have to be declared with exactly its
    type.) The library's own two writes, the handler (``attach_staging_handler``) and the
    context (``enable_*_staging``), assign by name.
    """

    @property
    def _staging_handler(self) -> StagingHandler | None:
        """Decode handler; ``None`` until ``attach_staging_handler`` (always ``None`` on
        prefill)."""
        ...

    @property
    def _staging_ctx(self) -> DecodeStagingContext | PrefillStagingContext | None:
        """Side-specific staging state; ``None`` while staging is disabled."""
        ...

    @property
    def kv_args(self) -> KVArgs:
        """The backend's KV arguments."""
        ...

    @property
    def attn_tp_size(self) -> int:
        """Attention tensor-parallel size of this side."""
        ...

    @property
    def arrival(self) -> ArrivalMode:
        """How this backend's prefill writers signal that a write landed, unless
        ``enable_prefill_staging(..., arrival=...)`` chooses otherwise (decode accepts both).
        A staging backend states it; a backend without staging support has none."""
        ...


class StagingHost(StagingHostCore, Protocol):
    """The full staging host contract: the core members plus the optional ``kv_buffer_tensors``."""

    @property
    def kv_buffer_tensors(self) -> KVBufferTensors | None:
        """The paged KV pool, when the backend exposes it (checked only when present)."""
        ...
