"""What a multi-process run needs, checked before any process starts.

A run that the layout, the engines or the machine cannot serve used to start every rank
process and fail a minute later (a bootstrap timeout, or each rank failing to allocate its
pool). :func:`preflight` refuses it at once instead, with one line that names the options and
the rule: the TP pair and the head count (the same validation the ranks run), the backend
spec (a name, ``MODULE:CLASS`` or ``MODULE:CLASS=MODULE:FACTORY``: it resolves, its class
satisfies the contract, its engine's extra is installed, and its engine crosses processes as
far as can be known without building one), the device (``--device cuda`` with an engine
that moves host memory only: the installed Mooncake wheel), and the memory the pools, rings and
staging buffers of every rank will take against the memory available (``MemAvailable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ..backends import BACKENDS, resolve_backend
from ..staging.layout import compute_staging_layout, validate_tp_pair
from .workload import TransferConfig

__all__ = [
    "PROCESS_OVERHEAD_BYTES",
    "MemoryNeed",
    "available_memory",
    "backend_engine",
    "check_backend",
    "check_device",
    "memory_need",
    "preflight",
]

PROCESS_OVERHEAD_BYTES: Final = 300 << 20
"""Memory a rank process takes before its first tensor (Python, torch, ZMQ, an engine), about
what one takes here."""

_GIB: Final = float(1 << 30)


@dataclass(frozen=True, slots=True)
class MemoryNeed:
    """What the ranks of a run will allocate, in bytes."""

    prefill_rank: int
    """One prefill rank: its KV pool and its staging buffer."""
    decode_rank: int
    """One decode rank: its KV pool and its staging ring."""
    processes: int
    """Rank processes, each with :data:`PROCESS_OVERHEAD_BYTES` on top."""
    total: int
    """Everything, on this machine."""


def memory_need(config: TransferConfig) -> MemoryNeed:
    """The memory the run's ranks allocate (pools, rings, staging buffers, processes)."""
    per_head_token = config.head_dim * config.element_size
    pool_tokens = config.pool_pages * config.page_size
    chunk_tokens = config.chunk_pages * config.page_size

    def heads(tp: int) -> int:
        return max(1, config.kv_heads // tp)

    prefill_pool = pool_tokens * heads(config.prefill_tp) * per_head_token * 2 * config.layers
    staging_buffer = chunk_tokens * heads(config.prefill_tp) * per_head_token * 2 * config.layers
    decode_pool = pool_tokens * heads(config.decode_tp) * per_head_token * 2 * config.layers
    region = max(
        compute_staging_layout(
            config.prefill_tp,
            config.decode_tp,
            rank,
            config.kv_heads,
            chunk_tokens,
            per_head_token,
            config.layers,
        ).total_bytes
        for rank in range(config.decode_tp)
    )
    prefill_rank = prefill_pool + staging_buffer
    decode_rank = decode_pool + region * config.ring_chunks
    processes = config.prefill_tp + config.decode_tp
    total = (
        config.prefill_tp * prefill_rank
        + config.decode_tp * decode_rank
        + processes * PROCESS_OVERHEAD_BYTES
    )
    return MemoryNeed(prefill_rank, decode_rank, processes, total)


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` of this machine in bytes (``None`` where the kernel does not say)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            fields = value.split()
            if fields and fields[0].isdigit():
                return int(fields[0]) * 1024
    return None


def preflight(
    config: TransferConfig, *, ignore_memory: bool = False, available: int | None = None
) -> None:
    """Refuse a run that cannot work, before any process starts.

    Args:
        config: the run.
        ignore_memory: skip the memory check (for those who know better).
        available: the memory to compare with (default: :func:`available_memory`).

    Raises:
        ValueError: one line naming the options and the rule: TP sizes that do not divide
            one another or the head count, a backend spec that does not resolve (an unknown
            name, a module that cannot be imported, a missing class, a class that fails its
            contract, a factory that is not callable), an engine that cannot be imported (with
            the pip command that installs it) or that works within one process only, an engine
            that cannot move memory of ``config.device`` (:func:`check_device`), or more
            memory than is available.
    """
    try:
        validate_tp_pair(config.prefill_tp, config.decode_tp, config.kv_heads)
    except ValueError as exc:
        raise ValueError(
            f"--prefill-tp {config.prefill_tp} --decode-tp {config.decode_tp} "
            f"--kv-heads {config.kv_heads}: {exc}"
        ) from None
    have = available_memory() if available is None else available
    need = memory_need(config)
    if not ignore_memory and have is not None and need.total > have:
        raise ValueError(
            f"--tokens {config.tokens} --requests {config.requests} --layers {config.layers} "
            f"--kv-heads {config.kv_heads} --head-dim {config.head_dim} --dtype {config.dtype}: "
            f"the {need.processes} rank processes need {need.total / _GIB:.1f} GiB "
            f"({need.prefill_rank / _GIB:.2f} GiB per prefill rank, "
            f"{need.decode_rank / _GIB:.2f} GiB per decode rank), and {have / _GIB:.1f} GiB "
            "is available; use smaller options, or --ignore-memory to run anyway"
        )
    check_backend(config.backend)
    check_device(config.backend, config.device)


def backend_engine(spec: str) -> str | None:
    """The in-tree engine (``"nixl"``, ``"mooncake"``, ``"local"``) a backend spec moves bytes
    with, as far as its class tells without building a manager: the engine of the in-tree
    backend class it is or derives from; ``None`` for a spec that does not resolve or whose
    class is none of them (its engine is known only once a rank builds it).

    **Thread:** any; imports the spec's modules.
    """
    try:
        cls = resolve_backend(spec).backend_class
    except (ImportError, ValueError):
        return None
    for klass in cls.__mro__:
        for known in BACKENDS.values():
            if known.engine and (klass.__module__, klass.__name__) == (
                known.module,
                known.class_name,
            ):
                return known.engine
    return None


def check_device(spec: str, device: str, option: str = "--backend") -> None:
    """Refuse a backend whose engine cannot move memory of ``device``, in one line: on
    ``"cuda"``, a Mooncake build without CUDA (the wheel the ``mooncake`` extra installs here;
    see :func:`~staging_contracts.engines.mooncake.host_memory_only`). A spec whose engine
    cannot be told (:func:`backend_engine`) or imported passes (:func:`check_backend` refuses
    what cannot be imported).

    **Thread:** any; imports the spec's modules.

    Raises:
        ValueError: ``OPTION SPEC --device cuda: why``, on one line.
    """
    if device != "cuda" or backend_engine(spec) != "mooncake":
        return
    try:
        from ..engines.mooncake import host_memory_only  # noqa: PLC0415 - the SDK, on demand
    except ImportError:
        return
    reason = host_memory_only()
    if reason is not None:
        raise ValueError(
            f"{option} {spec} --device cuda: {reason}; use --device cpu, or --backend nixl"
        )


def check_backend(spec: str, option: str = "--backend") -> None:
    """Refuse a backend spec the rank processes cannot build, in one line.

    **Thread:** any; imports the spec's modules.

    Raises:
        ValueError: ``OPTION SPEC: why``, on one line (see :func:`preflight`).
    """
    try:
        factory = resolve_backend(spec)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"{option} {spec}: {_one_line(str(exc))}") from None
    if factory.process_local:
        raise ValueError(
            f"{option} {spec}: {factory.backend_class.__name__} moves bytes within one process "
            "only, and every rank runs in a process of its own; choose an engine that crosses "
            "processes (nixl, mooncake)"
        )


def _one_line(text: str) -> str:
    return " ".join(text.split())
