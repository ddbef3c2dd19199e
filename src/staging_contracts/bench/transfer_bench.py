"""Group ``transfer``: the staged transfer end to end, per engine, against two anchors.

For each engine that can be imported, three measurements with the same rank processes
(P=4 prefill -> D=2 decode, every rank its own process), the same request (32 layers, 8 KV
heads of 128, bf16, 4096 tokens, pages fully shuffled) and the same clock, each run through
:func:`~staging_contracts.cluster.runner.run_cluster` with one
:attr:`~staging_contracts.cluster.workload.TransferConfig.mode`:

* ``staged``: the library's path, through the decode staging rings; pages verified;
* ``raw``: each prefill rank writes the bytes of its share (what it would stage) in one bulk
  write per decode rank it feeds; every byte checked on decode;
* ``per-token``: the path staging replaces: each prefill rank writes its head slices
  straight into the decode ranks' KV pools, one transfer per (K/V, layer, token), batched
  as the reference does (Mooncake one write per layer buffer split at 1024 transfers, NIXL
  one write per request and decode rank); pages verified. Over Mooncake (about 25 µs a
  transfer here) it sends :data:`PER_TOKEN_TOKENS` tokens of the request, with the same
  writers, and is compared in GB/s.

Rows: ``transfer.<engine>.vs-raw`` (staged / raw, goal >= 0.5) and
``transfer.<engine>.vs-per-token`` (staged / per-token, goal >= 8), in GB/s; each row's note
states the writer and receiver counts, bytes, tokens, warm-up, and the peak RSS and ring use
of the run. Every run does the same number of untimed warm-up requests first
(:data:`WARMUP_REQUESTS`), so ours and the anchors are warmed alike.

Throughput is payload bytes (what the prefill ranks wrote) over the transfer phase: from the
first prefill rank starting its requests (every rank up, peers known, decode's rooms
registered) to the last decode rank seeing its last request complete (staged: every chunk
scattered; the anchors: every writer's ``PLAIN_DONE`` in). Process start-up, data
generation, planning and verification are outside it. Each rank's KV pool is one allocation
cut into per-layer views (the workload's default), 1024-token chunks, a ring of two chunks.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Final

from ..backends import resolve_backend
from ..backends.common import CommonKVManager, Role
from ..cluster.runner import ClusterResult, run_cluster
from ..cluster.workload import Mode, TransferConfig
from ..engines import ENGINES as ENGINE_SPECS
from ..engines import engine_available
from . import BenchOptions, BenchRow, ratio_row
from .anchor_geometry import BENCH_GEOMETRY

__all__ = ["PER_TOKEN_TOKENS", "WARMUP_REQUESTS", "Measurement", "run", "staged_config"]

logger = logging.getLogger(__name__)

ENGINES = ("mooncake", "nixl")

WARMUP_REQUESTS: Final = 1
"""Untimed requests every run of the group does first, in every mode."""

PER_TOKEN_TOKENS: Final[Mapping[str, int]] = MappingProxyType({"mooncake": 512})
"""Tokens of the per-token anchor's request where the whole one takes too long: on a 2-core
host Mooncake TCP takes about 25 µs a transfer, so 4096 tokens (262,144 transfers per
writer) take about 28 s a request; 512 tokens take about 3 s. The cost is linear in tokens,
and the anchor is compared in GB/s. Other engines send the whole request."""


def staged_config(
    engine: str, *, quick: bool = False, device: str = "cpu", mode: Mode = "staged"
) -> TransferConfig:
    """The benchmark's request for ``engine`` (a backend name or spec; a small one when
    ``quick``), in ``mode``, on ``device``, with :data:`WARMUP_REQUESTS` warm-up requests."""
    return TransferConfig(
        backend=engine,
        prefill_tp=4,
        decode_tp=2,
        kv_heads=8,
        layers=4 if quick else BENCH_GEOMETRY.layers,
        head_dim=BENCH_GEOMETRY.head_dim,
        tokens=512 if quick else BENCH_GEOMETRY.tokens,
        page_size=BENCH_GEOMETRY.page_size,
        requests=1,
        dtype="bf16",
        chunk_tokens=256 if quick else 1024,
        ring_chunks=2,
        mode=mode,
        warmup_requests=WARMUP_REQUESTS,
        device="cuda" if device == "cuda" else "cpu",
    )


@dataclass(frozen=True, slots=True)
class Measurement:
    """The median of repeated runs of one configuration."""

    config: TransferConfig
    gbps: float
    """Median payload GB/s (10^9 bytes per second) of the runs."""
    nbytes: int
    """Payload bytes of one run (what the prefill ranks wrote)."""
    last: ClusterResult
    """The last run (for its peak RSS and ring use)."""

    def describe(self) -> str:
        """Bytes, tokens and memory of the run, in words (the processes are in :func:`_note`)."""
        config, last = self.config, self.last
        rss = [*last.peak_rss_bytes("prefill").values(), *last.peak_rss_bytes("decode").values()]
        ring = max(last.ring_peaks().values(), default=None)
        ring_text = (
            f", ring peak {ring[0] / 2**20:.0f} of {ring[1] / 2**20:.0f} MiB" if ring else ""
        )
        return (
            f"{config.mode}: {self.nbytes / 2**20:.0f} MiB ({config.tokens} tokens x"
            f" {config.layers} layers), peak RSS <= {max(rss, default=0) / 2**20:.0f} MiB"
            f"{ring_text}"
        )


def _note(ours: Measurement, anchor: Measurement) -> str:
    """What a reader needs to judge one row: processes, warm-up, bytes and memory of each."""
    config = ours.config
    note = (
        f"both: {config.prefill_tp} writer -> {config.decode_tp} receiver processes,"
        f" {config.warmup_requests} warm-up request first; {ours.describe()};"
        f" {anchor.describe()}"
    )
    if anchor.nbytes != ours.nbytes:
        note += " (fewer tokens, same writers: compared in GB/s)"
    return note


def _measure(config: TransferConfig, repeats: int) -> Measurement:
    samples = []
    result = None
    for _ in range(repeats):
        result = run_cluster(config)
        if not result.verified:
            errors = [r.fields.get("error") for r in result.reports if not r.ok]
            problems = [p for r in result.ranks("decode") for p in r.fields.get("problems", [])]
            raise RuntimeError(
                f"{config.mode} transfer over {config.backend} did not verify: "
                f"{errors or problems[:3]}"
            )
        samples.append(result.gbps)
    if result is None:
        raise ValueError("repeats must be >= 1")
    return Measurement(config, statistics.median(samples), result.bytes_moved, result)


def _anchor_engine(backend: str) -> str | None:
    """The in-tree engine a backend spec moves bytes with (its anchors' engine), or ``None``.

    An in-tree engine name is itself; any other spec is resolved and one decode manager is
    built (and closed) to see which engine it holds.
    """
    if backend in ENGINES:
        return backend
    factory = resolve_backend(backend)
    config = staged_config(backend, quick=True)
    manager = factory(config.kv_args(config.decode_tp, 0), role=Role.DECODE, attn_tp_size=1)
    module = type(manager.engine).__module__
    if isinstance(manager, CommonKVManager):  # every backend is one; close its listener
        manager.close()
    return next((name for name, spec in ENGINE_SPECS.items() if spec.module == module), None)


def run(options: BenchOptions) -> list[BenchRow]:
    """Run the group for each backend of ``options.backends`` (names or specs), else for
    every importable in-tree engine; ``options.quick`` uses a small request (one run each)
    and ``options.device`` places every rank's pools, buffers and ring.

    **Blocking:** for 9 cluster runs per engine (minutes; seconds each when quick).

    Raises:
        RuntimeError: a run did not verify.
    """
    quick = options.quick
    repeats = 1 if quick else 3
    rows: list[BenchRow] = []
    for backend in options.backends or ENGINES:
        if backend in ENGINES:
            available, reason = engine_available(backend)
            if not available:
                logger.warning("transfer bench: skipping %s (%s)", backend, reason)
                continue
        engine = _anchor_engine(backend)
        if engine is None or engine == "local":
            logger.warning("transfer bench: skipping %s (no cross-process engine)", backend)
            continue
        config = staged_config(backend, quick=quick, device=options.device)
        staged = _measure(config, repeats)
        raw = _measure(replace(config, mode="raw"), repeats)
        tokens = config.tokens if quick else PER_TOKEN_TOKENS.get(engine, config.tokens)
        per_token = _measure(replace(config, mode="per-token", tokens=tokens), repeats)
        for name, anchor, goal in (("vs-raw", raw, ">= 0.5"), ("vs-per-token", per_token, ">= 8")):
            rows.append(
                ratio_row(
                    f"transfer.{backend}.{name}",
                    staged.gbps,
                    anchor.gbps,
                    "GB/s",
                    goal,
                    note=_note(staged, anchor),
                )
            )
    return rows
