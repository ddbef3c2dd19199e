"""A seeded, reproducible transfer workload: requests, their pages, their KV data.

Every rank process derives the same requests from a :class:`TransferConfig` alone: which
pool pages each request occupies on prefill and on decode, and the KV data of every
(request, layer, K/V, global head). A prefill rank fills its pool with its heads; a decode
rank checks, after the transfer, that each of its pages holds exactly its heads — computed
from which global heads a rank holds (:func:`~staging_contracts._staging.layout.rank_heads`),
not from the staging layout's chunk offsets.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Final, Literal

import torch

from .._staging.layout import compute_staging_layout, rank_heads
from ..protocols import KVArgsRecord, KVBufferTensors

__all__ = [
    "ring_bytes",
    "DTYPES",
    "MODES",
    "Device",
    "Mode",
    "RequestPlan",
    "TransferConfig",
    "fill_prefill_pool",
    "rank_heads",
    "request_plans",
    "token_rows",
    "verify_decode_pool",
    "chunks_landed",
    "stray_pages",
    "as_bits",
    "require_positive",
    "warmup_plans",
    "zero_pool",
]

DTYPES: Final[dict[str, torch.dtype]] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
_BITS: Final[dict[int, torch.dtype]] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}
_MASK64: Final = (1 << 64) - 1


def require_positive(owner: object, label: str = "", *, but: Iterable[str] = ()) -> None:
    """Refuse a size below 1 among the ``int`` fields of the dataclass ``owner`` (except
    ``but``): ``ValueError("{label}{name}=... must be >= 1")``."""
    for item in fields(owner):  # type: ignore[arg-type]  # a dataclass instance
        value = getattr(owner, item.name)
        if item.type == "int" and item.name not in but and value < 1:
            raise ValueError(f"{label}{item.name}={value!r} must be >= 1")


Mode = Literal["staged", "per-token", "raw"]
MODES: Final[tuple[Mode, ...]] = ("staged", "per-token", "raw")
"""How the ranks move a request (see :attr:`TransferConfig.mode`)."""
Device = Literal["cpu", "cuda"]


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """One run of the staged transfer: model geometry, TP sizes, requests.

    Raises:
        ValueError: a size is not positive, the dtype is unknown or ``host`` is empty.
    """

    backend: str = "nixl"
    prefill_tp: int = 4
    decode_tp: int = 2
    kv_heads: int = 8
    layers: int = 8
    head_dim: int = 128
    tokens: int = 2048
    page_size: int = 16
    requests: int = 4
    dtype: Literal["bf16", "fp16", "fp32"] | torch.dtype = "bf16"
    """A name of :data:`DTYPES` or any torch dtype (the test harness's)."""
    seed: int = 0
    chunk_tokens: int = 512
    """Chunked-prefill size: chunks are ``max(1, chunk_tokens // page_size)`` pages."""
    ring_chunks: int = 4
    """Ring size, in regions of the largest chunk (small values make the ring wrap)."""
    fail_rooms: tuple[int, ...] = ()
    """Requests (by index) whose writes prefill rank 0 aims outside the decode ring: a fault
    injection to show that an engine error fails that request only."""
    separate_layers: bool = False
    """Allocate each layer's K and V pool on its own (as SGLang does) instead of as views of
    one KV cache allocation (as vLLM and TensorRT-LLM do); the kernels then go layer by
    layer instead of moving every layer at once."""
    host: str = "127.0.0.1"
    """Address the ranks bind and advertise: their control listeners and transfer engines
    (and a bootstrap server started for the run). Loopback for one machine; a non-loopback
    address needs the cluster secret (``STAGING_CONTRACTS_SECRET``)."""
    mode: Mode = "staged"
    """How the same rank processes move each request (the benchmark's anchors run here so
    that they use the same writers, receivers and bytes as the staged path):

    * ``"staged"``: through the decode staging rings (the library's path);
    * ``"per-token"``: the non-staging path staging replaces: each decode rank registers its
      KV pool with the engine and publishes the pool tensors' addresses at bootstrap; each
      prefill rank writes its heads straight into the decode pools, one transfer per (K/V,
      layer, token) at the decode rank's head offset, in write calls batched as
      :func:`~staging_contracts._cluster.plain_paths.per_token_batch` says; pages are
      verified bit for bit as in ``"staged"``;
    * ``"raw"``: each prefill rank writes the bytes of its share of a request (what it would
      stage) as one bulk write per decode rank it feeds into a registered buffer of that
      rank; decode checks every byte it received against the seeded data.

    In the two plain modes a prefill rank tells each decode rank it fed that its writes of a
    request landed with one ``PLAIN_DONE`` control message
    (:mod:`~staging_contracts._cluster.plain_paths`)."""
    warmup_requests: int = 0
    """Untimed requests run first, in every mode, each a copy of a timed request (same size,
    same pages, its own room); decode zeroes its pool (or raw buffer) after them, so the
    timed requests are verified on their own bytes."""
    device: Device = "cpu"
    """Where every rank's KV pool, staging buffer and ring live (``"cuda"``: the current
    CUDA device of each rank process, the same GPU for every rank of a host unless
    ``CUDA_VISIBLE_DEVICES`` differs between them, so a one-host run moves bytes within one
    GPU, not across GPUs); verification runs there too."""

    pool_size: int | None = None
    """Pages of every rank's KV pool (``None``: every request at once plus a spare page)."""
    ring_size: int | None = None
    """Bytes of a decode rank's staging ring (``None``: ``ring_chunks`` regions of the
    largest chunk)."""

    def __post_init__(self) -> None:
        require_positive(self, but=("seed", "warmup_requests"))
        for name in ("pool_size", "ring_size"):
            if (getattr(self, name) or 1) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 1")
        if not self.host.strip("[]"):
            raise ValueError("host must name an address")
        if not isinstance(self.dtype, torch.dtype) and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {', '.join(MODES)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is not 'cpu' or 'cuda'")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests={self.warmup_requests!r} must be >= 0")
        if self.fail_rooms and self.mode != "staged":
            raise ValueError("fail_rooms injects faults into staged writes only (mode='staged')")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The KV dtype."""
        return self.dtype if isinstance(self.dtype, torch.dtype) else DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        """Where this process's pools live: the CPU, or the current CUDA device *with its
        index*, so that an engine registers the memory of the GPU the tensors are on (NIXL:
        VRAM of that device; see ``engines.nixl.memory_kind``). Initialises CUDA when
        ``device`` is ``"cuda"``."""
        if self.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def element_size(self) -> int:
        """Bytes per KV element."""
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def num_pages(self) -> int:
        """Pages per request (the last one may be partly used)."""
        return -(-self.tokens // self.page_size)

    @property
    def chunk_pages(self) -> int:
        """Pages per chunk on the chunked-prefill grid."""
        return max(1, self.chunk_tokens // self.page_size)

    @property
    def pool_pages(self) -> int:
        """Pages of every rank's KV pool (:attr:`pool_size`)."""
        return self.pool_size or self.requests * self.num_pages + 1

    @property
    def request_bytes(self) -> int:
        """KV bytes of one request over all heads (the payload a transfer delivers)."""
        tokens = self.num_pages * self.page_size
        return tokens * self.kv_heads * self.head_dim * self.element_size * 2 * self.layers

    def room(self, index: int) -> int:
        """The room id of request ``index`` (warm-up request ``w`` is ``requests + w``)."""
        return 1000 + index

    def chunks(self) -> Iterator[tuple[int, int]]:
        """``(page_start, num_pages)`` of each chunk of a request."""
        for start in range(0, self.num_pages, self.chunk_pages):
            yield start, min(self.chunk_pages, self.num_pages - start)

    def kv_args(self, tp: int, rank: int) -> KVArgsRecord:
        """KV arguments of a rank of a side with TP size ``tp``."""
        heads = len(rank_heads(self.kv_heads, tp, rank))
        item = self.page_size * heads * self.head_dim * self.element_size
        return KVArgsRecord(
            page_size=self.page_size,
            kv_item_lens=(item,) * (2 * self.layers),
            engine_rank=rank,
            device=str(self.torch_device),
            total_kv_head_num=self.kv_heads,
            kv_head_num=heads,
            kv_layer_ids=tuple(range(self.layers)),
        )

    def empty_pool(self, tp: int, rank: int) -> KVBufferTensors:
        """A zeroed paged KV pool for a rank: views of one allocation ``[2, layers, tokens,
        heads, head_dim]``, or one allocation per pool with ``separate_layers``."""
        heads = len(rank_heads(self.kv_heads, tp, rank))
        shape = (self.pool_pages * self.page_size, heads, self.head_dim)
        dtype, device = self.torch_dtype, self.torch_device
        if self.separate_layers:
            return KVBufferTensors(
                tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.layers)),
                tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.layers)),
                self.page_size,
            )
        cache = torch.zeros((2, self.layers, *shape), dtype=dtype, device=device)
        return KVBufferTensors(tuple(cache[0].unbind()), tuple(cache[1].unbind()), self.page_size)


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """Where one request lives on each side."""

    index: int
    room: int
    prefill_pages: tuple[int, ...]
    decode_pages: tuple[int, ...]


def warmup_plans(config: TransferConfig) -> list[RequestPlan]:
    """The warm-up requests: warm-up ``w`` repeats request ``w % requests`` (its index, pages
    and data) in room ``config.room(requests + w)``."""
    timed = request_plans(config)
    return [
        replace(timed[w % config.requests], room=config.room(config.requests + w))
        for w in range(config.warmup_requests)
    ]


def zero_pool(pool: KVBufferTensors) -> None:
    """Zero every K and V tensor of a pool (decode, between the warm-up and timed requests)."""
    for tensor in (*pool.k_buffers, *pool.v_buffers):
        tensor.zero_()


def request_plans(config: TransferConfig) -> list[RequestPlan]:
    """Every request's pages: disjoint, shuffled, the same on every rank of a side."""
    prefill = _permutation(config, "prefill")
    decode = _permutation(config, "decode")
    n = config.num_pages
    return [
        RequestPlan(
            i,
            config.room(i),
            tuple(prefill[i * n : (i + 1) * n]),
            tuple(decode[i * n : (i + 1) * n]),
        )
        for i in range(config.requests)
    ]


def _permutation(config: TransferConfig, side: str) -> list[int]:
    gen = torch.Generator().manual_seed(_mix(config.seed, 1 if side == "prefill" else 2))
    return [int(p) for p in torch.randperm(config.pool_pages, generator=gen)]


def head_data(
    config: TransferConfig, request: int, layer: int, kind: int, head: int
) -> torch.Tensor:
    """KV data of one global head: ``[num_pages * page_size, head_dim]`` in the KV dtype."""
    gen = torch.Generator().manual_seed(_mix(config.seed, request, layer, kind, head))
    tokens = config.num_pages * config.page_size
    bits = _BITS[config.element_size]
    info = torch.iinfo(bits)
    raw = torch.randint(
        info.min, info.max, (tokens, config.head_dim), generator=gen, dtype=torch.int64
    )
    return raw.to(bits).view(config.torch_dtype)


def token_rows(pages: tuple[int, ...], page_size: int) -> torch.Tensor:
    """The pool row of each token of a request whose pages are ``pages`` (CPU ``int64``)."""
    base = torch.tensor(pages, dtype=torch.int64).unsqueeze(1) * page_size
    return (base + torch.arange(page_size)).reshape(-1)


def fill_prefill_pool(pool: KVBufferTensors, config: TransferConfig, rank: int) -> None:
    """Write every request's data for this prefill rank's heads into its pages."""
    heads = rank_heads(config.kv_heads, config.prefill_tp, rank)
    for plan in request_plans(config):
        rows = token_rows(plan.prefill_pages, config.page_size).to(pool.k_buffers[0].device)
        for layer in range(config.layers):
            for kind, buffers in enumerate((pool.k_buffers, pool.v_buffers)):
                for local, head in enumerate(heads):
                    data = head_data(config, plan.index, layer, kind, head)
                    buffers[layer][rows, local] = data.to(buffers[layer].device)


def verify_decode_pool(
    pool: KVBufferTensors, config: TransferConfig, rank: int, requests: set[int] | None = None
) -> list[str]:
    """Compare this decode rank's pages with the expected heads, bit for bit.

    Args:
        pool: the decode rank's KV pool after the transfer.
        config: the run.
        rank: the decode rank.
        requests: indexes to check (default: all).

    Returns:
        One line per mismatching (request, layer, K/V, head); empty when all match.
    """
    return [
        f"request {plan.index} layer {layer} {'KV'[kind]} head {head}: {count} elements differ"
        for plan in request_plans(config)
        if requests is None or plan.index in requests
        for layer, kind, head, count in _mismatches(pool, config, rank, plan)
    ]


def chunks_landed(
    pool: KVBufferTensors, config: TransferConfig, rank: int, plan: RequestPlan
) -> list[bool]:
    """Per chunk of ``plan``: this decode rank's pages of it hold exactly its heads."""
    return [
        not any(_mismatches(pool, config, rank, plan, start, count))
        for start, count in config.chunks()
    ]


def _mismatches(
    pool: KVBufferTensors,
    config: TransferConfig,
    rank: int,
    plan: RequestPlan,
    start: int = 0,
    count: int | None = None,
) -> Iterator[tuple[int, int, int, int]]:
    """``(layer, K/V, head, elements that differ)`` of each mismatching head of the pages
    ``start .. start + count`` of ``plan`` (default: all of them) on a decode rank."""
    pages = plan.decode_pages[start : None if count is None else start + count]
    rows = token_rows(pages, config.page_size).to(pool.k_buffers[0].device)
    own = slice(start * config.page_size, (start + len(pages)) * config.page_size)
    for layer in range(config.layers):
        for kind, buffers in enumerate((pool.k_buffers, pool.v_buffers)):
            for local, head in enumerate(rank_heads(config.kv_heads, config.decode_tp, rank)):
                got = as_bits(buffers[layer][rows, local])
                want = as_bits(head_data(config, plan.index, layer, kind, head)[own])
                want = want.to(got.device)
                if not torch.equal(got, want):
                    yield layer, kind, head, int((got != want).sum())


def stray_pages(
    pool: KVBufferTensors, config: TransferConfig, plans: Sequence[RequestPlan]
) -> set[int]:
    """Pages of a decode pool outside every plan's that hold anything but zeros."""
    used = {page for plan in plans for page in plan.decode_pages}
    others = tuple(p for p in range(config.pool_pages) if p not in used)
    if not others:
        return set()
    rows = token_rows(others, config.page_size).to(pool.k_buffers[0].device)
    stray: set[int] = set()
    for tensor in (*pool.k_buffers, *pool.v_buffers):
        written = as_bits(tensor[rows]).reshape(len(others), -1).any(dim=1)
        stray.update(others[i] for i in torch.nonzero(written).flatten().tolist())
    return stray


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bits as integers of its element size (compared bit for bit)."""
    return tensor.contiguous().view(_BITS[tensor.element_size()])


def _mix(*values: int) -> int:
    """A stable 63-bit seed from integers (splitmix64 over the sequence)."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state & ((1 << 63) - 1)


def ring_bytes(config: TransferConfig) -> int:
    """Bytes of a decode rank's staging ring (:attr:`TransferConfig.ring_size`)."""
    if config.ring_size is not None:
        return config.ring_size
    largest = max(
        compute_staging_layout(
            config.prefill_tp,
            config.decode_tp,
            d,
            config.kv_heads,
            config.chunk_pages * config.page_size,
            config.head_dim * config.element_size,
            config.layers,
        ).total_bytes
        for d in range(config.decode_tp)
    )
    return largest * config.ring_chunks
