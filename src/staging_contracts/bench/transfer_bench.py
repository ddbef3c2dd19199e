"""Group ``transfer``: the staged transfer end to end, per engine, against two anchors.

For each engine that can be imported, measured in the same run:

* ``transfer.<engine>.vs-raw`` — end-to-end staged throughput of one request (32 layers,
  8 KV heads of 128, bf16, 4096 tokens, P=4 -> D=2, every rank its own process, pages
  verified) against that engine's raw bulk write of the same number of bytes between two
  processes (goal >= 0.5);
* ``transfer.<engine>.vs-per-token`` — the same staged throughput against transferring the
  request as per-token head slices over the same engine, the path staging replaces
  (goal >= 8).

Staged throughput counts the request's KV bytes over the transfer phase: from the prefill
ranks starting (all ranks up, peers known) to the last decode rank having scattered every
chunk. Process start-up, data generation and verification are outside it. Each rank's KV
pool is one allocation cut into per-layer views (the workload's default), 1024-token chunks,
a ring of two chunks, fully shuffled pages; ``TransferConfig(separate_layers=True)`` measures
pools allocated layer by layer.
"""

from __future__ import annotations

import logging
import statistics

from ..backends import resolve_backend
from ..backends.common import CommonKVManager, Role
from ..cluster.runner import run_cluster
from ..cluster.workload import TransferConfig
from ..engines import ENGINES as ENGINE_SPECS
from ..engines import engine_available
from . import BenchOptions, BenchRow, ratio_row
from .anchor_geometry import BENCH_GEOMETRY, AnchorGeometry
from .engine_anchors import per_token_seconds, raw_write_seconds

__all__ = ["run", "staged_config"]

logger = logging.getLogger(__name__)

ENGINES = ("mooncake", "nixl")


def staged_config(engine: str, *, quick: bool = False) -> TransferConfig:
    """The benchmark's request for ``engine`` (a backend name or spec; a small one when
    ``quick``)."""
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
    )


def _staged_gbps(config: TransferConfig, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        result = run_cluster(config)
        if not result.verified:
            errors = [r.fields.get("error") for r in result.reports if not r.ok]
            raise RuntimeError(f"staged transfer over {config.backend} did not verify: {errors}")
        samples.append(config.request_bytes / result.elapsed_s / 1e9)
    return statistics.median(samples)


def _geometry(config: TransferConfig) -> AnchorGeometry:
    return AnchorGeometry(
        layers=config.layers,
        heads_per_prefill_rank=config.kv_heads // config.prefill_tp,
        heads_per_decode_rank=config.kv_heads // config.decode_tp,
        head_dim=config.head_dim,
        element_size=config.element_size,
        tokens=config.tokens,
        page_size=config.page_size,
    )


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
    every importable in-tree engine; ``options.quick`` uses a small request."""
    quick = options.quick
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
        config = staged_config(backend, quick=quick)
        staged = _staged_gbps(config, 1 if quick else 3)
        raw_s = raw_write_seconds(engine, config.request_bytes, repeats=2 if quick else 5)
        raw = config.request_bytes / raw_s / 1e9
        per_token_s, per_token_bytes = per_token_seconds(
            engine, _geometry(config), tokens=64 if quick else None, repeats=1 if quick else 3
        )
        per_token = per_token_bytes / per_token_s / 1e9
        rows.append(ratio_row(f"transfer.{backend}.vs-raw", staged, raw, "GB/s", ">= 0.5"))
        rows.append(
            ratio_row(f"transfer.{backend}.vs-per-token", staged, per_token, "GB/s", ">= 8")
        )
    return rows
