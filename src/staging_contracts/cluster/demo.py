"""The main job: a verified heterogeneous-TP staged transfer across real processes.

``staging-contracts demo`` fills each prefill rank's KV pool with seeded data, runs the
requests through the staging path with the chosen engine, and verifies that every decode
rank's pages hold exactly the expected heads. It prints a progress bar while it runs and a
summary table at the end; the exit status is 0 only when every page verified.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from .runner import ClusterResult, run_cluster
from .workload import DTYPES, TransferConfig

__all__ = ["add_demo_arguments", "config_from_args", "format_summary", "run_demo"]

_BAR_WIDTH = 30


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options (defaults finish well under a minute here)."""
    default = TransferConfig()
    parser.add_argument(
        "--backend",
        choices=["nixl", "mooncake"],
        default=default.backend,
        help="transfer engine (default: nixl, which needs no system libraries)",
    )
    parser.add_argument("--prefill-tp", type=int, default=default.prefill_tp, metavar="P")
    parser.add_argument("--decode-tp", type=int, default=default.decode_tp, metavar="D")
    parser.add_argument("--kv-heads", type=int, default=default.kv_heads, metavar="H")
    parser.add_argument("--layers", type=int, default=default.layers, metavar="L")
    parser.add_argument("--head-dim", type=int, default=default.head_dim, metavar="E")
    parser.add_argument("--tokens", type=int, default=default.tokens, metavar="T")
    parser.add_argument("--page-size", type=int, default=default.page_size, metavar="S")
    parser.add_argument("--requests", type=int, default=default.requests, metavar="R")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=default.dtype)
    parser.add_argument("--seed", type=int, default=default.seed, metavar="N")
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=default.chunk_tokens,
        metavar="C",
        help="chunked-prefill size in tokens",
    )
    parser.add_argument(
        "--separate-layers",
        action="store_true",
        help="allocate each layer's K and V pool on its own instead of one KV cache buffer",
    )


def config_from_args(args: argparse.Namespace) -> TransferConfig:
    """Build the run's configuration from parsed options.

    Raises:
        ValueError: a size is not positive.
    """
    return TransferConfig(
        backend=args.backend,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        kv_heads=args.kv_heads,
        layers=args.layers,
        head_dim=args.head_dim,
        tokens=args.tokens,
        page_size=args.page_size,
        requests=args.requests,
        dtype=args.dtype,
        seed=args.seed,
        chunk_tokens=args.chunk_tokens,
        separate_layers=args.separate_layers,
    )


class _ProgressBar:
    """Rooms finished on decode ranks, redrawn in place on a terminal, line by line otherwise."""

    def __init__(self, total: int, out: TextIO) -> None:
        self._total = total
        self._done = 0
        self._failed = 0
        self._ready = 0
        self._out = out
        self._tty = out.isatty()

    def __call__(self, kind: str, event: dict[str, Any]) -> None:
        if kind == "ready":
            self._ready += 1
            return
        if kind != "room" or event.get("role") != "decode":
            return
        self._done += 1
        self._failed += 0 if event.get("ok") else 1
        filled = _BAR_WIDTH * self._done // max(1, self._total)
        bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
        failed = f", {self._failed} failed" if self._failed else ""
        line = f"[{bar}] {self._done}/{self._total} rooms done{failed}"
        if self._tty:
            end = "\n" if self._done == self._total else ""
            self._out.write(f"\r{line}{end}")
        else:
            self._out.write(line + "\n")
        self._out.flush()


def format_summary(result: ClusterResult) -> str:
    """The summary table of a run."""
    config = result.config
    decode = result.ranks("decode")
    peaks = [(int(r.fields.get("ring_peak", 0)), int(r.fields.get("ring_size", 1))) for r in decode]
    peak = max(peaks, default=(0, 1), key=lambda p: p[0] / p[1])
    problems = [line for r in decode for line in r.fields.get("problems", [])]
    errors = [f"{r.role} {r.rank}: {r.fields.get('error')}" for r in result.reports if not r.ok]
    if result.verified:
        verdict = (
            f"PASS: every page of {config.requests} requests on {config.decode_tp} decode ranks"
        )
    else:
        verdict = "FAIL: " + "; ".join((errors + problems)[:3] or ["see the rank reports"])
    rows = [
        ("backend", config.backend),
        ("prefill TP -> decode TP", f"{config.prefill_tp} -> {config.decode_tp}"),
        (
            "model",
            f"{config.kv_heads} KV heads, {config.layers} layers, head_dim "
            f"{config.head_dim}, {config.dtype}",
        ),
        (
            "requests",
            f"{config.requests} x {config.tokens} tokens, page_size {config.page_size}, "
            f"chunks of {config.chunk_pages} pages",
        ),
        ("bytes moved", f"{result.bytes_moved / 2**20:.1f} MiB"),
        ("transfer time", f"{result.elapsed_s:.3f} s"),
        ("throughput", f"{result.gbps:.2f} GB/s"),
        ("chunks staged", str(result.total("decode", "chunks"))),
        (
            "control messages",
            str(
                result.total("decode", "control_messages")
                + result.total("prefill", "control_messages")
            ),
        ),
        (
            "ring peak use",
            f"{peak[0] / 2**20:.1f} MiB assigned at once, ring of {peak[1] / 2**20:.1f} MiB"
            + (
                f" ({peak[0] / peak[1]:.1f}x: later rounds wait for the watermark)"
                if peak[0] > peak[1]
                else ""
            ),
        ),
        ("failed requests", ", ".join(map(str, sorted(result.failed_requests))) or "none"),
        ("verification", verdict),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


def run_demo(config: TransferConfig, *, out: TextIO | None = None) -> int:
    """Run the demo and print progress and the summary; return the exit status.

    Returns:
        0 when every decode page verified, 1 otherwise.
    """
    stream = out if out is not None else sys.stdout
    stream.write(
        f"staging {config.requests} requests of {config.tokens} tokens over {config.backend}: "
        f"{config.prefill_tp} prefill ranks -> {config.decode_tp} decode ranks\n"
    )
    stream.flush()
    bar = _ProgressBar(config.requests * config.decode_tp, stream)
    result = run_cluster(config, progress=bar)
    stream.write(format_summary(result) + "\n")
    return 0 if result.verified else 1
