"""What a multi-process run needs, checked before any process starts.

A run that the layout, the engines or the machine cannot serve would start every rank
process and fail a minute later. :func:`preflight` refuses it at once, in one line that
names the options and the rule: the ``STAGING_CONTRACTS_*`` variables
(:func:`check_environment`), the TP pair and head count, the backend spec
(:func:`check_backend`), the device (:func:`check_device`) and the memory every rank will
take in the run's mode (:func:`memory_need`) against the host's ``MemAvailable`` and, on
CUDA, the free memory of the one GPU all ranks share.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from .. import config as settings
from .._run.workload import TransferConfig
from .._staging.layout import (
    compute_head_slice_params,
    compute_staging_layout,
    decode_ranks_for_prefill,
    heads_per_rank,
    validate_tp_pair,
)
from ..backends import BACKENDS, resolve_backend
from ..backends._registry import in_tree_name
from .plain_paths import raw_request_bytes

PROCESS_OVERHEAD_BYTES: Final = 300 << 20
"""Memory a rank process takes before its first tensor (Python, torch, ZMQ, an engine), about
what one takes here."""

_GIB: Final = float(1 << 30)


@dataclass(frozen=True, slots=True)
class MemoryNeed:
    """What the ranks of a run will allocate, in bytes: host memory, and on CUDA the memory
    of the GPU every rank uses (its current device: all ranks share one)."""

    prefill_rank: int
    """One prefill rank's host memory: on the CPU its KV pool and staging buffer (staged),
    its pool (per-token) or its raw source and the concatenation that builds it (raw); on
    CUDA only the raw source's concatenation (built on the host, then copied)."""
    decode_rank: int
    """One decode rank's host memory: on the CPU its KV pool and staging ring (staged), its
    pool (per-token) or its raw buffer and one writer's share as verification builds it
    (raw); on CUDA only that share."""
    processes: int
    """Rank processes, each with :data:`PROCESS_OVERHEAD_BYTES` of host memory on top."""
    total: int
    """Every rank's host memory, on this machine."""
    device_prefill_rank: int = 0
    """On CUDA, one prefill rank's GPU memory (what ``prefill_rank`` has on the CPU)."""
    device_decode_rank: int = 0
    """On CUDA, one decode rank's GPU memory."""
    device_total: int = 0
    """On CUDA, every rank's GPU memory, on the one GPU they share (0 on the CPU)."""


def memory_need(config: TransferConfig) -> MemoryNeed:
    """The memory the run's ranks allocate in ``config.mode`` on ``config.device``: pools,
    rings and staging buffers (staged), pools (per-token), raw sources and buffers with the
    temporaries that build and check them (raw), and the processes themselves."""
    per_head_token = config.head_dim * config.element_size
    pool_tokens = config.pool_pages * config.page_size
    chunk_tokens = config.chunk_pages * config.page_size

    def per_token(tp: int) -> int:
        return heads_per_rank(config.kv_heads, tp) * per_head_token * 2 * config.layers

    prefill_pool = pool_tokens * per_token(config.prefill_tp)
    decode_pool = pool_tokens * per_token(config.decode_tp)
    # (bytes that live where the pools do, bytes that are host temporaries) of each rank
    if config.mode == "staged":
        staging_buffer = chunk_tokens * per_token(config.prefill_tp)
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
        prefill = (prefill_pool + staging_buffer, 0)
        decode = (decode_pool + region * config.ring_chunks, 0)
    elif config.mode == "per-token":
        prefill, decode = (prefill_pool, 0), (decode_pool, 0)
    else:
        source = max(_raw_source_bytes(config, rank) for rank in range(config.prefill_tp))
        buffer = max(
            config.requests * raw_request_bytes(config, rank) for rank in range(config.decode_tp)
        )
        share = max(
            _raw_share_bytes(config, p, d)
            for p in range(config.prefill_tp)
            for d in decode_ranks_for_prefill(config.prefill_tp, config.decode_tp, p)
        )
        # the shares, and their concatenation, on the host; then the source where pools live
        prefill = (source, 2 * source) if config.device == "cuda" else (0, 2 * source)
        decode = (buffer + share, share) if config.device == "cuda" else (buffer + share, 0)
    processes = config.prefill_tp + config.decode_tp
    if config.device == "cuda":
        device_prefill, device_decode = prefill[0], decode[0]
        host_prefill, host_decode = prefill[1], decode[1]
    else:
        device_prefill = device_decode = 0
        host_prefill, host_decode = prefill[0] + prefill[1], decode[0] + decode[1]
    total = (
        config.prefill_tp * host_prefill
        + config.decode_tp * host_decode
        + processes * PROCESS_OVERHEAD_BYTES
    )
    return MemoryNeed(
        host_prefill,
        host_decode,
        processes,
        total,
        device_prefill,
        device_decode,
        config.prefill_tp * device_prefill + config.decode_tp * device_decode,
    )


def _raw_share_bytes(config: TransferConfig, prefill_rank: int, decode_rank: int) -> int:
    """Bytes of one request's share a prefill rank sends a decode rank (``raw_share``)."""
    head = compute_head_slice_params(
        config.prefill_tp, config.decode_tp, prefill_rank, decode_rank, config.kv_heads
    )
    tokens = config.num_pages * config.page_size
    return head.num_heads * tokens * config.head_dim * config.element_size * 2 * config.layers


def _raw_source_bytes(config: TransferConfig, prefill_rank: int) -> int:
    """A prefill rank's raw source: its share of every request for every decode rank it
    feeds."""
    fed = decode_ranks_for_prefill(config.prefill_tp, config.decode_tp, prefill_rank)
    return config.requests * sum(_raw_share_bytes(config, prefill_rank, d) for d in fed)


def proc_bytes(path: Path, names: Collection[str]) -> dict[str, int]:
    """The fields of ``names`` in a ``/proc`` file of ``NAME: N kB`` lines, in bytes: those
    it gives (none where it cannot be read)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    found: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields = value.split()
        if name in names and fields and fields[0].isdigit():
            found[name] = int(fields[0]) * 1024
    return found


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` of this machine in bytes (``None`` where the kernel does not say)."""
    return proc_bytes(meminfo, ("MemAvailable",)).get("MemAvailable")


def available_device_memory() -> int | None:
    """Free memory of the current CUDA device in bytes (``torch.cuda.mem_get_info``), or
    ``None`` without one. Creates a CUDA context in this process (the rank processes are
    spawned, so they are not affected)."""
    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    return int(free)


def preflight(
    config: TransferConfig,
    *,
    ignore_memory: bool = False,
    available: int | None = None,
    device_available: int | None = None,
) -> None:
    """Refuse a run that cannot work, before any process starts.

    Args:
        config: the run.
        ignore_memory: skip the memory checks (for those who know better).
        available: the host memory to compare with (default: :func:`available_memory`).
        device_available: on CUDA, the GPU memory to compare with (default:
            :func:`available_device_memory`, which creates a CUDA context here).

    Raises:
        ConfigError: a variable of the settings table is unusable (:func:`check_environment`).
        ValueError: one line naming the options and the rule: TP sizes that do not divide
            one another or the head count, a backend spec that does not resolve (an unknown
            name, a module that cannot be imported, a missing class, a class that fails its
            contract, a factory that is not callable), an engine that cannot be imported (with
            the pip command that installs it) or that works within one process only, an engine
            that cannot move memory of ``config.device`` (:func:`check_device`), or more
            memory than is available (host, or on CUDA the GPU's), counted for
            ``config.mode`` and ``config.device`` (:func:`memory_need`).
    """
    check_environment()
    try:
        validate_tp_pair(config.prefill_tp, config.decode_tp, config.kv_heads)
    except ValueError as exc:
        raise ValueError(
            f"--prefill-tp {config.prefill_tp} --decode-tp {config.decode_tp} "
            f"--kv-heads {config.kv_heads}: {exc}"
        ) from None
    need = memory_need(config)
    options = (
        f"--tokens {config.tokens} --requests {config.requests} --layers {config.layers} "
        f"--kv-heads {config.kv_heads} --head-dim {config.head_dim} --dtype {config.dtype}"
    )
    mode = "" if config.mode == "staged" else f" ({config.mode} mode)"
    have = available_memory() if available is None else available
    if not ignore_memory and have is not None and need.total > have:
        raise ValueError(
            f"{options}: the {need.processes} rank processes{mode} need "
            f"{need.total / _GIB:.1f} GiB ({need.prefill_rank / _GIB:.2f} GiB per prefill "
            f"rank, {need.decode_rank / _GIB:.2f} GiB per decode rank), and "
            f"{have / _GIB:.1f} GiB is available; use smaller options, or --ignore-memory to "
            "run anyway"
        )
    if not ignore_memory and config.device == "cuda" and need.device_total:
        free = available_device_memory() if device_available is None else device_available
        if free is not None and need.device_total > free:
            raise ValueError(
                f"{options} --device cuda: the {need.processes} rank processes{mode} need "
                f"{need.device_total / _GIB:.1f} GiB of the one GPU they share "
                f"({need.device_prefill_rank / _GIB:.2f} GiB per prefill rank, "
                f"{need.device_decode_rank / _GIB:.2f} GiB per decode rank), and "
                f"{free / _GIB:.1f} GiB is free; use smaller options, or --ignore-memory to "
                "run anyway"
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
    names = (in_tree_name(klass) for klass in cls.__mro__)
    return next((BACKENDS[n].engine for n in names if n is not None and BACKENDS[n].engine), None)


def check_device(spec: str, device: str) -> None:
    """Refuse a backend whose engine cannot move memory of ``device``, in one line: on
    ``"cuda"``, a Mooncake build without CUDA (the wheel the ``mooncake`` extra installs here;
    see :func:`~staging_contracts.engines.mooncake.host_memory_only`). A spec whose engine
    cannot be told (:func:`backend_engine`) or imported passes (:func:`check_backend` refuses
    what cannot be imported).

    **Thread:** any; imports the spec's modules.

    Raises:
        ValueError: ``--backend SPEC --device cuda: why``, on one line.
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
            f"--backend {spec} --device cuda: {reason}; use --device cpu, or --backend nixl"
        )


def check_backend(spec: str) -> None:
    """Refuse a backend spec the rank processes cannot build, in one line.

    **Thread:** any; imports the spec's modules.

    Raises:
        ValueError: ``--backend SPEC: why``, on one line (see :func:`preflight`).
    """
    try:
        factory = resolve_backend(spec)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"--backend {spec}: {' '.join(str(exc).split())}") from None
    if factory.process_local:
        raise ValueError(
            f"--backend {spec}: {factory.backend_class.__name__} moves bytes within one process "
            "only, and every rank runs in a process of its own; choose an engine that crosses "
            "processes (nixl, mooncake)"
        )


def check_environment(
    liveness_timeout_s: float | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    timeout_source: str = "the command's",
) -> None:
    """Refuse, in the driver and before any rank process starts, a ``STAGING_CONTRACTS_*``
    variable of the settings table (:data:`~staging_contracts.config.SETTINGS`) that a rank
    would refuse: each is read as the rank's constructor reads it, and the liveness interval
    must stay below the liveness timeout (``liveness_timeout_s``: the command's, when it
    sets one, named in a message as ``timeout_source``; else the variable's or the default).

    **Called by:** ``demo`` (through :func:`preflight`) and ``soak``, at start.
    **Blocking:** no.

    Raises:
        ConfigError: a variable is unusable; the message names it and its value.
        ValueError: the liveness interval is not below the timeout; the message names the
            variable the interval came from.
    """
    for setting in settings.SETTINGS:
        setting.from_env(environ)
    interval = settings.LIVENESS_INTERVAL_S.value(environ=environ)
    timeout = settings.LIVENESS_TIMEOUT_S.value(liveness_timeout_s, environ)
    if not timeout > interval:
        shown_timeout = (
            f"{liveness_timeout_s:g} s, {timeout_source}"
            if liveness_timeout_s is not None
            else settings.LIVENESS_TIMEOUT_S.source(environ=environ)
        )
        raise ValueError(
            f"the liveness interval ({settings.LIVENESS_INTERVAL_S.source(environ=environ)}) "
            f"must be below the liveness timeout ({shown_timeout})"
        )


def ignored_variables(
    fixed: Mapping[settings.Setting[Any], str], environ: Mapping[str, str] | None = None
) -> list[str]:
    """One warning line per variable of ``fixed`` that is set, though the command fixes its
    value (``fixed``: setting -> what the command uses instead, and why).

    **Called by:** ``demo`` and ``soak``, at start, once each.
    """
    env = os.environ if environ is None else environ
    return [
        f"warning: {setting.name}={env[setting.name].strip()} is ignored here: {instead}"
        for setting, instead in fixed.items()
        if env.get(setting.name, "").strip()
    ]
