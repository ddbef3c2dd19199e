"""Group ``transfer``: the staged transfer end to end, per engine, against two anchors.

For each engine (or ``--backend`` spec), three :func:`~staging_contracts._cluster.runner.
run_cluster` runs of the same request by the same rank processes (P=4 prefill -> D=2 decode,
each its own process) and the same clock, differing only in
:attr:`~staging_contracts._run.workload.TransferConfig.mode`: ``staged`` (ours, through the
decode staging rings), ``raw`` (each prefill rank's share in one bulk write per decode rank)
and ``per-token`` (the path staging replaces; over Mooncake only :data:`PER_TOKEN_TOKENS`
tokens, compared in GB/s). Which in-tree engine a spec uses is told from its class
(:func:`~staging_contracts._cluster.preflight.backend_engine`).

The modes run in turns for :data:`ROUNDS` rounds (one when quick), the order reversed every
other round; a row's figures are the medians of the rounds' GB/s, and its note gives the
spread of the ratio over the rounds (:func:`spread_note`) and what the ranks held. Rows:
``transfer.<engine>.vs-raw`` (goal >= 0.5) and ``transfer.<engine>.vs-per-token`` (goal
>= 8); the docs' benchmarks page describes them.

An engine that cannot run here (:func:`~staging_contracts._cluster.preflight.preflight`) is
skipped with a logged warning and gets no rows; one whose run fails or does not verify is
logged as an error and its two rows are marked failed (figures 0, no goal, a note that starts
with ``FAILED:``), and the other engines are still measured.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Final

from .._cluster.preflight import backend_engine, preflight
from .._cluster.runner import ClusterResult, run_cluster
from .._run.workload import Mode, TransferConfig
from ..engines import engine_available
from . import ENGINES, QUICK_NOTE, BenchOptions, BenchRow, ratio_row
from .timing import in_turns

logger = logging.getLogger(__name__)

WARMUP_REQUESTS: Final = 1
"""Untimed requests every run of the group does first, in every mode."""

ROUNDS: Final = 5
"""Rounds of the full group; each runs every mode once (quick: one round)."""

PER_TOKEN_TOKENS: Final[Mapping[str, int]] = MappingProxyType({"mooncake": 512})
"""Tokens of the per-token anchor's request where the whole one takes too long (Mooncake over
TCP: one transfer per K/V, layer and token; the docs' benchmarks page gives its cost per
transfer). The cost is linear in tokens, and the anchor is compared in GB/s. Other engines
send the whole request."""

_GOALS: Final[tuple[tuple[str, Mode, str], ...]] = (
    ("vs-raw", "raw", ">= 0.5"),
    ("vs-per-token", "per-token", ">= 8"),
)
"""Row suffix, anchor mode, goal on staged / anchor."""


class RunFailed(RuntimeError):
    """A run of the group failed or did not verify (the engine's rows are marked failed)."""


def staged_config(engine: str, *, quick: bool = False, device: str = "cpu") -> TransferConfig:
    """The benchmark's staged request for ``engine`` (a backend name or spec; a small one
    when ``quick``) on ``device``, with :data:`WARMUP_REQUESTS` warm-up requests."""
    return TransferConfig(
        backend=engine,
        prefill_tp=4,
        decode_tp=2,
        kv_heads=8,
        layers=4 if quick else 32,
        head_dim=128,
        tokens=512 if quick else 4096,
        page_size=16,
        requests=1,
        dtype="bf16",
        chunk_tokens=256 if quick else 1024,
        ring_chunks=2,
        warmup_requests=WARMUP_REQUESTS,
        device="cuda" if device == "cuda" else "cpu",
    )


@dataclass(frozen=True, slots=True)
class Measurement:
    """Every round's run of one configuration."""

    config: TransferConfig
    samples: tuple[float, ...]
    """Payload GB/s (10^9 bytes per second) of each round, in round order."""
    nbytes: int
    """Payload bytes of one run (what the prefill ranks wrote)."""
    results: tuple[ClusterResult, ...]
    """Each round's run (for the memory the ranks held and the rings' reserved peak)."""

    @property
    def gbps(self) -> float:
        """Median GB/s of the rounds."""
        return statistics.median(self.samples)

    def describe(self) -> str:
        """Bytes, tokens and memory of the runs, in words (the processes are in the note):
        per role, the most any of its ranks held in any round."""
        config = self.config
        parts = [
            f"{config.mode}: {self.nbytes / 2**20:.0f} MiB ({config.tokens} tokens x"
            f" {config.layers} layers)"
        ]
        memory = [
            memory
            for result in self.results
            for role in ("prefill", "decode")
            for memory in result.transfer_memory(role).values()
        ]
        since = ""
        if "process start" in {held.peak_rss_from for held in memory}:
            since = " (since the process started)"
        for what, label, after in (
            ("rss", "peak RSS to done", since),
            ("cuda", "CUDA peak allocated", ""),
        ):
            most = {role: self._most(role, what) for role in ("prefill", "decode")}
            if None not in most.values():
                parts.append(
                    f"{label}: prefill <= {_mib(most['prefill'])}, decode <="
                    f" {_mib(most['decode'])} MiB{after}"
                )
        rings = [ring for result in self.results for ring in result.ring_peaks().values()]
        if rings:
            peak, size = max(rings)
            ahead = " (next-round regions reserved ahead, never more in use)" if peak > size else ""
            parts.append(f"ring reserved peak {_mib(peak)} of {_mib(size)} MiB{ahead}")
        return ", ".join(parts)

    def _most(self, role: str, what: str) -> int | None:
        values = [
            memory.peak_rss_before_verify_bytes
            if what == "rss"
            else memory.cuda_max_allocated_bytes
            for result in self.results
            for memory in result.transfer_memory(role).values()
        ]
        known = [value for value in values if value is not None]
        return max(known) if known and len(known) == len(values) else None


def _mib(value: int | None) -> str:
    return "?" if value is None else f"{value / 2**20:.0f}"


def spread_note(ratios: Sequence[float], goal: str) -> str:
    """The spread of a row's ratio over the rounds, in words: ``ratio per round LOW to HIGH
    (N rounds)``, and ``: inconclusive against GOAL`` when some rounds meet ``goal`` and
    others do not (``goal`` empty: no verdict)."""
    if not ratios:
        return "no rounds"
    text = f"ratio per round {min(ratios):.3g} to {max(ratios):.3g} ({len(ratios)} rounds)"
    if goal:
        verdicts = {BenchRow("", 0.0, 0.0, "", ratio, goal).goal_met for ratio in ratios}
        if len(verdicts) > 1:
            text += f": inconclusive against {goal}"
    return text


def _note(ours: Measurement, anchor: Measurement, goal: str, quick: bool) -> str:
    """What a reader needs to judge one row: processes, warm-up, rounds, the spread of the
    ratio, bytes and memory of each side, and where CUDA memory was."""
    config = ours.config
    rounds = len(ours.samples)
    order = (
        f"{rounds} rounds, the modes in turns (order reversed every other round)"
        if rounds > 1
        else "1 round"
    )
    ratios = [
        o / a if a else float("inf") for o, a in zip(ours.samples, anchor.samples, strict=True)
    ]
    note = (
        f"both: {config.prefill_tp} writer -> {config.decode_tp} receiver processes,"
        f" {config.warmup_requests} warm-up request first, {order};"
        f" {spread_note(ratios, '' if quick else goal)}; {ours.describe()};"
        f" {anchor.describe()}"
    )
    if anchor.nbytes != ours.nbytes:
        note += " (fewer tokens, same writers: compared in GB/s)"
    if config.device == "cuda":
        note += (
            "; CUDA: every rank on its current device, the same GPU: transfers within one"
            " GPU, not across GPUs"
        )
    return f"{QUICK_NOTE}; {note}" if quick else note


def _measure_rounds(configs: Mapping[Mode, TransferConfig], rounds: int) -> dict[Mode, Measurement]:
    """Every mode once a round, :func:`~staging_contracts._bench.timing.in_turns`.

    Raises:
        RunFailed: a run did not verify (the ranks' first errors or problems say why).
    """
    results: dict[Mode, list[ClusterResult]] = {mode: [] for mode in configs}
    for mode in in_turns(list(configs), rounds):
        result = run_cluster(configs[mode])
        if not result.verified:
            why = result.errors() or result.problems()[:3] or ["no decode rank verified"]
            timed = " (timed out)" if result.timed_out else ""
            raise RunFailed(f"{mode} transfer did not verify{timed}: {why}")
        results[mode].append(result)
    return {
        mode: Measurement(
            configs[mode],
            tuple(r.gbps for r in runs),
            runs[-1].bytes_moved,
            tuple(runs),
        )
        for mode, runs in results.items()
    }


def _configs(backend: str, options: BenchOptions) -> dict[Mode, TransferConfig]:
    """The three runs of one backend: the same request, the per-token one over Mooncake
    with :data:`PER_TOKEN_TOKENS` tokens (the engine told from the spec's class)."""
    config = staged_config(backend, quick=options.quick, device=options.device)
    engine = backend_engine(backend)
    tokens = config.tokens
    if not options.quick and engine is not None:
        tokens = PER_TOKEN_TOKENS.get(engine, config.tokens)
    return {
        "staged": config,
        "raw": replace(config, mode="raw"),
        "per-token": replace(config, mode="per-token", tokens=tokens),
    }


def _skip_reason(backend: str, configs: Mapping[Mode, TransferConfig]) -> str | None:
    """Why ``backend`` cannot run the group here, or ``None``."""
    if backend in ENGINES:
        available, reason = engine_available(backend)
        if not available:
            return reason
    if backend_engine(backend) == "local":
        return "no cross-process engine"
    for config in configs.values():
        try:
            preflight(config)
        except ValueError as exc:
            return str(exc)
    return None


def run(options: BenchOptions) -> list[BenchRow]:
    """Run the group for each backend of ``options.backends`` (names or specs), else for
    every importable in-tree engine; ``options.quick`` uses a small request and one round,
    ``options.device`` places every rank's pools, buffers and ring.

    An engine that cannot run here is skipped (logged, no rows); one whose run fails or
    does not verify is logged as an error and its rows are marked failed (see the module
    docstring); the other engines are measured either way.

    **Blocking:** for 3 cluster runs per round and engine (minutes; seconds each when
    quick).
    """
    quick = options.quick
    rounds = 1 if quick else ROUNDS
    rows: list[BenchRow] = []
    for backend in options.backends or ENGINES:
        configs = _configs(backend, options)
        reason = _skip_reason(backend, configs)
        if reason is not None:
            logger.warning("transfer bench: skipping %s (%s)", backend, reason)
            continue
        try:
            measured = _measure_rounds(configs, rounds)
        except (RunFailed, ImportError, OSError, RuntimeError, ValueError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            logger.error("transfer bench: %s failed, its rows are marked failed: %s", backend, why)
            rows.extend(
                BenchRow(f"transfer.{backend}.{name}", 0.0, 0.0, "GB/s", 0.0, "", f"FAILED: {why}")
                for name, _, _ in _GOALS
            )
            continue
        staged = measured["staged"]
        for name, mode, goal in _GOALS:
            anchor = measured[mode]
            rows.append(
                ratio_row(
                    f"transfer.{backend}.{name}",
                    staged.gbps,
                    anchor.gbps,
                    "GB/s",
                    "" if quick else goal,
                    note=_note(staged, anchor, goal, quick),
                )
            )
    return rows
