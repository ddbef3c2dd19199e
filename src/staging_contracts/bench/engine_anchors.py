"""Engine anchors between two processes: what one writer does without staging, measured live.

An informative standalone tool (and the engines' own micro-benchmark in the tests). The
``transfer`` benchmark group does **not** use it: it measures its anchors with the same rank
processes, bytes and warm-up as the staged path (``TransferConfig(mode="raw" | "per-token")``,
see :mod:`staging_contracts.cluster.plain_paths`), because a single writer process sending a
quarter of the bytes is not comparable with four staged writers.

Two anchors, each measured over a real engine between two processes (a writer and a
receiver, started with ``spawn``; the ``"local"`` engine runs in this process):

* :func:`raw_write_seconds` — the engine's raw bulk write: ``nbytes`` from one registered
  buffer into another, in one ``write`` call (the staged path must reach a fraction of it);
* :func:`per_token_seconds` — the path staging replaces: one prefill rank's share of the KV
  cache sent as per-token head slices, one :class:`~staging_contracts.protocols.Transfer`
  per (K/V, layer, token) from the prefill pool row into the decode pool row at this rank's
  head offset.

**Per-token batching** (:func:`per_token_batch`, the rule the rank processes' per-token
mode follows too, :func:`staging_contracts.cluster.plain_paths.per_token_batch`): Mooncake
one ``write`` call per layer's K or V buffer, split at
:data:`MOONCAKE_MAX_TRANSFERS_PER_WRITE`; NIXL every transfer of the pass in one ``write``
(one NIXL request), which is also NIXL's fastest batching (about twice the bandwidth of one
request per layer buffer).

The transfer lists are built before the clock starts, so the anchor is if anything
favoured; the engines' own per-transfer checks (under 1 µs a transfer) are timed, as they
are part of ``write``.

Timing covers the ``write`` calls only: not process start-up, registration or planning.
The benchmark process itself never creates a NIXL agent (NIXL stays in the children).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Final, Literal, NamedTuple

from ..cluster.plain_paths import MOONCAKE_MAX_TRANSFERS_PER_WRITE
from ..cluster.plain_paths import per_token_batch as _batch_rule
from ._anchor_peers import AnchorJob
from ._anchor_runner import run_local, run_pair
from .anchor_geometry import BENCH_GEOMETRY, AnchorGeometry

__all__ = [
    "ENGINE_ENV",
    "ENGINE_OPTIONS",
    "MOONCAKE_MAX_TRANSFERS_PER_WRITE",
    "PER_TOKEN_TOKENS",
    "AnchorJob",
    "AnchorMeasurement",
    "default_tokens",
    "measure_anchor",
    "per_token_batch",
    "per_token_seconds",
    "raw_write_seconds",
]

logger = logging.getLogger(__name__)

ENGINE_OPTIONS: Final[Mapping[str, Mapping[str, Any]]] = MappingProxyType(
    {
        "local": {},
        "mooncake": {"host": "127.0.0.1", "protocol": "tcp"},
        "nixl": {"load_ib_modules": False, "write_timeout_s": 120.0},
    }
)
"""Constructor options of each engine in the anchors (loopback, no RDMA NIC)."""

ENGINE_ENV: Final[Mapping[str, Mapping[str, str]]] = MappingProxyType(
    {"nixl": {"UCX_MODULES": "^ib"}, "mooncake": {"MC_LOG_LEVEL": "ERROR"}}
)
"""Environment each child sets before loading the engine (NIXL: no InfiniBand modules)."""

PER_TOKEN_TOKENS: Final[Mapping[str, int]] = MappingProxyType({"mooncake": 512})
"""Default tokens of :func:`per_token_seconds` where the whole request takes too long.

On a 2-core host, 4096 tokens (262,144 transfers) take about 0.8 s a pass over NIXL (one
measurement about 9 s: the whole request is measured) but about 6-9 s a pass over
Mooncake TCP (about 25 µs a transfer), so Mooncake sends 512 tokens (about 10 s a
measurement); the cost is about linear in tokens.
"""


class AnchorMeasurement(NamedTuple):
    """What one anchor measurement found."""

    seconds: float
    """Median seconds of one pass (every write call of the plan)."""
    nbytes: int
    """Bytes one pass moves."""
    samples: tuple[float, ...]
    """Seconds of each timed pass."""
    writes: int
    """``write`` calls per pass."""
    transfers: int
    """Transfers per pass."""
    verified: bool | None
    """Whether the receiver held the expected bytes (``None``: not checked)."""

    @property
    def gbps(self) -> float:
        """Bandwidth in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9


def raw_write_seconds(
    engine: str,
    nbytes: int,
    *,
    repeats: int = 5,
    warmup: int = 1,
    max_transfer_bytes: int = 0,
    verify: bool = False,
    options: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
) -> float:
    """Median seconds of one bulk write of ``nbytes`` over ``engine`` between two processes.

    Neither Mooncake (TCP) nor NIXL (UCX) needs a large write split (both were checked at
    512 MiB in one transfer); ``max_transfer_bytes`` splits it anyway into transfers of one
    ``write`` call.

    Args:
        engine: ``"mooncake"``, ``"nixl"`` or ``"local"`` (in this process).
        nbytes: Bytes of the write.
        repeats: Timed writes; the median is returned.
        warmup: Untimed writes first.
        max_transfer_bytes: Largest transfer (0: the whole write in one transfer).
        verify: Write seeded random bytes and check them in the receiver.
        options: Engine constructor options, over :data:`ENGINE_OPTIONS`.
        env: Child environment, over :data:`ENGINE_ENV`.
        timeout_s: Bound on each child's work (start-up has its own grace).

    Raises:
        ValueError: a bad size or count.
        RuntimeError: a child failed, timed out or did not exit cleanly (the text has its
            traceback), or the bytes did not verify.
    """
    if nbytes < 1 or max_transfer_bytes < 0:
        raise ValueError(
            f"nbytes={nbytes!r} must be >= 1 and max_transfer_bytes={max_transfer_bytes!r} >= 0"
        )
    job = _job(engine, "raw", repeats, warmup, verify, options, env, timeout_s)
    job = replace(job, nbytes=nbytes, max_transfer_bytes=max_transfer_bytes)
    return measure_anchor(job).seconds


def default_tokens(engine: str, geometry: AnchorGeometry = BENCH_GEOMETRY) -> int:
    """Tokens :func:`per_token_seconds` sends by default: :data:`PER_TOKEN_TOKENS` or all."""
    return min(geometry.tokens, PER_TOKEN_TOKENS.get(engine, geometry.tokens))


def per_token_batch(engine: str, tokens: int) -> int:
    """Transfers per ``write`` call of the per-token anchor over ``engine`` (0: all in one).

    See the module docstring: Mooncake one call per layer buffer (at most
    :data:`MOONCAKE_MAX_TRANSFERS_PER_WRITE`), NIXL one call per pass, local one call per
    layer buffer.
    """
    return _batch_rule(engine, tokens)


def per_token_seconds(
    engine: str,
    geometry: AnchorGeometry = BENCH_GEOMETRY,
    *,
    tokens: int | None = None,
    repeats: int = 3,
    warmup: int = 1,
    transfers_per_write: int | None = None,
    verify: bool = False,
    options: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
) -> tuple[float, int]:
    """Median seconds and bytes of sending ``tokens`` tokens of one prefill rank's share.

    One transfer of ``geometry.slice_bytes`` per (K/V, layer, token), in ``write`` calls of
    :func:`per_token_batch` transfers unless ``transfers_per_write`` says otherwise.
    Bandwidth is ``bytes / seconds``; ``tokens`` may be a subset of ``geometry.tokens``
    (the cost is linear in tokens).

    Args:
        engine: ``"mooncake"``, ``"nixl"`` or ``"local"`` (in this process).
        geometry: The KV layout.
        tokens: Tokens sent (``None``: :func:`default_tokens`).
        repeats: Timed passes; the median is returned.
        warmup: Untimed passes first.
        transfers_per_write: Transfers per ``write`` call (0: all in one call; ``None``:
            :func:`per_token_batch`).
        verify: Send seeded random bytes and check the decode pool in the receiver.
        options: Engine constructor options, over :data:`ENGINE_OPTIONS`.
        env: Child environment, over :data:`ENGINE_ENV`.
        timeout_s: Bound on each child's work (start-up has its own grace).

    Returns:
        ``(seconds, bytes)``: the median seconds of a pass and the bytes one pass moves.

    Raises:
        ValueError: a bad count or an unknown engine.
        RuntimeError: a child failed, timed out or did not exit cleanly, or the bytes did not
            verify.
    """
    count = default_tokens(engine, geometry) if tokens is None else tokens
    batch = per_token_batch(engine, count) if transfers_per_write is None else transfers_per_write
    if count < 1 or batch < 0:
        raise ValueError(f"tokens={count!r} must be >= 1 and transfers_per_write={batch!r} >= 0")
    job = _job(engine, "per-token", repeats, warmup, verify, options, env, timeout_s)
    found = measure_anchor(replace(job, geometry=geometry, tokens=count, transfers_per_write=batch))
    return found.seconds, found.nbytes


def measure_anchor(job: AnchorJob) -> AnchorMeasurement:
    """Run ``job``: two child processes (``"local"``: this process) and their reports.

    **Blocking:** until both children reported and exited, at most ``job.timeout_s`` plus a
    start-up grace; a child still alive then is killed.

    Raises:
        RuntimeError: a child failed, timed out or did not exit cleanly, or the bytes did not
            verify.
    """
    if job.engine == "local":
        writer, receiver = run_local(job)
    else:
        writer, receiver = run_pair(job)
    if job.verify and receiver["verified"] is not True:
        raise RuntimeError(f"{job.kind} anchor over {job.engine}: the receiver's bytes differ")
    samples = tuple(float(s) for s in writer["samples"])
    found = AnchorMeasurement(
        statistics.median(samples),
        int(writer["nbytes"]),
        samples,
        int(writer["writes"]),
        int(writer["transfers"]),
        receiver["verified"],
    )
    logger.info(
        "%s anchor over %s: %d bytes in %d writes (%d transfers): %.3f GB/s",
        job.kind,
        job.engine,
        found.nbytes,
        found.writes,
        found.transfers,
        found.gbps,
    )
    return found


# --------------------------------------------------------------------------- internals


def _job(
    engine: str,
    kind: Literal["raw", "per-token"],
    repeats: int,
    warmup: int,
    verify: bool,
    options: Mapping[str, Any] | None,
    env: Mapping[str, str] | None,
    timeout_s: float,
) -> AnchorJob:
    if engine not in ENGINE_OPTIONS:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINE_OPTIONS)}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats!r} must be >= 1 and warmup={warmup!r} >= 0")
    return AnchorJob(
        engine,
        kind,
        repeats,
        warmup,
        verify=verify,
        options={**ENGINE_OPTIONS[engine], **(options or {})},
        env={**ENGINE_ENV.get(engine, {}), **(env or {})},
        timeout_s=timeout_s,
    )
