"""Group ``transfer``: the staged transfer end to end, per engine, against two anchors.

For each engine that can be imported, three measurements with the same rank processes
(P=4 prefill -> D=2 decode, every rank its own process), the same request (32 layers, 8 KV
heads of 128, bf16, 4096 tokens, pages fully shuffled) and the same clock, each run through
:func:`~staging_contracts._cluster.runner.run_cluster` with one
:attr:`~staging_contracts._run.workload.TransferConfig.mode`:

* ``staged``: the library's path, through the decode staging rings; pages verified;
* ``raw``: each prefill rank writes the bytes of its share (what it would stage) in one bulk
  write per decode rank it feeds; every byte checked on decode;
* ``per-token``: the path staging replaces: each prefill rank writes its head slices
  straight into the decode ranks' KV pools, one transfer per (K/V, layer, token), batched
  as the reference does (Mooncake one write per layer buffer split at 1024 transfers, NIXL
  one write per request and decode rank); pages verified. Over Mooncake (about 25 µs a
  transfer here) it sends :data:`PER_TOKEN_TOKENS` tokens of the request, with the same
  writers, and is compared in GB/s.

The anchors run through the same backend spec as ours, in the same rank processes; which
in-tree engine a spec uses is told from its class
(:func:`~staging_contracts._cluster.preflight.backend_engine`), without building a manager.
A spec whose class does not tell (one that builds its own engine) is measured all the same,
the per-token anchor with the whole request; for such a spec the preflight check that its
engine crosses processes builds one probe manager in the bench process and closes it
(``BackendFactory.process_local_reason``).

**Rounds.** The modes are measured in turns: every round runs each mode once, the order
reversed every other round (staged, raw, per-token; then per-token, raw, staged; ...), for
:data:`ROUNDS` rounds (one when quick), so that no mode always runs first or after the same
neighbour and all share the machine's conditions. A row's figures are the medians of the
rounds' GB/s, its ratio their quotient; its note gives the ratio of each round's pair
(lowest to highest) and says **inconclusive** when some rounds meet the goal and others do not.

Rows: ``transfer.<engine>.vs-raw`` (staged / raw, goal >= 0.5) and
``transfer.<engine>.vs-per-token`` (staged / per-token, goal >= 8), in GB/s; each row's note
states the writer and receiver counts, bytes, tokens, warm-up, rounds and the spread of the
ratio, and what the ranks of each role held as the transfer phase ended (the most over the
ranks of the role and the rounds: peak RSS from the timed requests' start to the ``done``
barrier, before verification; on CUDA the allocator's peak) and the rings' reserved peak.
On CUDA every rank uses its current device, the same GPU: the transfers are within one GPU,
and the note says so. Every run does the same number of untimed warm-up requests first
(:data:`WARMUP_REQUESTS`), so ours and the anchors are warmed alike. In quick mode the rows
have no goal (``goal`` empty) and their notes start with ``quick: smoke only``.

**What is skipped, what fails.** An engine that cannot be imported, or that cannot run the
request here (:func:`~staging_contracts._cluster.preflight.preflight`: Mooncake on CUDA where
its wheel moves host memory only, more memory than there is, an in-process engine) is skipped
with a logged warning and gets no rows. An engine whose run fails or does not verify is
logged as an error, and its two rows are kept, marked failed: figures 0, no goal, and a note
that starts with ``FAILED:`` and says why; the other engines are still measured.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Final

from .._cluster.preflight import backend_engine, preflight
from .._cluster.runner import ClusterResult, run_cluster
from .._run.workload import Mode, TransferConfig
from ..engines import engine_available
from . import BenchOptions, BenchRow, ratio_row
from .anchor_geometry import BENCH_GEOMETRY

__all__ = [
    "PER_TOKEN_TOKENS",
    "ROUNDS",
    "WARMUP_REQUESTS",
    "Measurement",
    "RunFailed",
    "run",
    "spread_note",
    "staged_config",
]

logger = logging.getLogger(__name__)

ENGINES = ("mooncake", "nixl")

WARMUP_REQUESTS: Final = 1
"""Untimed requests every run of the group does first, in every mode."""

ROUNDS: Final = 5
"""Rounds of the full group; each runs every mode once (quick: one round)."""

MODES: Final[tuple[Mode, ...]] = ("staged", "raw", "per-token")
"""The order of a round (reversed every other round)."""

QUICK_NOTE: Final = "quick: smoke only"
"""How a quick row's note starts (its figures are not for judging, and it has no goal)."""

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
        peaks = {role: self._most(role, "rss") for role in ("prefill", "decode")}
        if all(value is not None for value in peaks.values()):
            origins = {
                memory.peak_rss_from
                for result in self.results
                for role in ("prefill", "decode")
                for memory in result.transfer_memory(role).values()
            }
            since = " (since the process started)" if "process start" in origins else ""
            parts.append(
                f"peak RSS to done: prefill <= {_mib(peaks['prefill'])}, decode <="
                f" {_mib(peaks['decode'])} MiB{since}"
            )
        cuda = {role: self._most(role, "cuda") for role in ("prefill", "decode")}
        if all(value is not None for value in cuda.values()):
            parts.append(
                f"CUDA peak allocated: prefill <= {_mib(cuda['prefill'])}, decode <="
                f" {_mib(cuda['decode'])} MiB"
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


def _run_once(config: TransferConfig) -> ClusterResult:
    """One verified run.

    Raises:
        RunFailed: it did not verify (the ranks' first errors or problems say why).
    """
    result = run_cluster(config)
    if not result.verified:
        why = result.errors() or result.problems()[:3] or ["no decode rank verified"]
        timed = " (timed out)" if result.timed_out else ""
        raise RunFailed(f"{config.mode} transfer did not verify{timed}: {why}")
    return result


def _measure_rounds(configs: Mapping[Mode, TransferConfig], rounds: int) -> dict[Mode, Measurement]:
    """Every mode once a round, the order reversed every other round.

    Raises:
        RunFailed: a run failed or did not verify.
    """
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    results: dict[Mode, list[ClusterResult]] = {mode: [] for mode in configs}
    for index in range(rounds):
        order = list(configs)
        if index % 2:
            order.reverse()
        for mode in order:
            results[mode].append(_run_once(configs[mode]))
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


def _failed_rows(backend: str, why: str) -> list[BenchRow]:
    note = f"FAILED: {why}"
    return [
        BenchRow(f"transfer.{backend}.{name}", 0.0, 0.0, "GB/s", 0.0, "", note)
        for name, _, _ in _GOALS
    ]


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
            rows.extend(_failed_rows(backend, why))
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
