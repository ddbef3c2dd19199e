"""The main job: a verified heterogeneous-TP staged transfer across real processes.

``staging-contracts demo`` fills each prefill rank's KV pool with seeded data, runs the
requests through the staging path with the chosen engine, and verifies that every decode
rank's pages hold exactly the expected heads. It prints a progress bar while it runs and a
summary table at the end; the exit status is 0 only when every page verified.

**Two machines** (``--host``, ``--ranks``, ``--bootstrap``; the cluster secret on both
sides): docs/security.md, "The demo on two machines".
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TextIO

import torch

from .._control.security import SecurityError, check_insecure_bind, load_cluster_secret
from .._run import exit_status, stop_on_signals
from .._run._codec import RankEvent
from .._run.workload import DTYPES, TransferConfig
from ..config import MAX_ROOMS_PER_PEER
from ._messages import RankMemory, RequestDone
from ._options import add_backend_argument, add_typed_options
from .bootstrap import BootstrapServer
from .metrics_relay import serving
from .preflight import check_device
from .runner import ClusterResult, RankSet, run_cluster
from .summary_json import demo_summary, write_summary

_BAR_WIDTH = 30
DEFAULT_TIMEOUT_S: Final = 300.0
"""How long a demo side runs before its ranks still running are told to stop."""
_ENDPOINT: Final = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):([0-9]{1,5})")
"""A bootstrap endpoint: ``tcp://`` host or ``[IPv6]``, a port."""


@dataclass(frozen=True, slots=True)
class DemoPlacement:
    """Which ranks of the run start here, and where they meet the other side's."""

    ranks: RankSet = "all"
    """``"all"``, or one side's ranks (the other side runs elsewhere)."""
    bootstrap: str | None = None
    """The bootstrap server to join; ``None`` starts one here, on the run's ``host``."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """When to tell this side's ranks still running to stop (:data:`DEFAULT_TIMEOUT_S`)."""


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options (defaults finish well under a minute here)."""
    default = TransferConfig()
    add_backend_argument(parser, default.backend)
    geometry = (
        ("--prefill-tp", int, "P", "prefill TP size: one process per rank (default: %(default)s)"),
        ("--decode-tp", int, "D", "decode TP size (default: %(default)s)"),
        ("--kv-heads", int, "H", "KV heads of the model, over all ranks (default: %(default)s)"),
        ("--layers", int, "L", "layers (default: %(default)s)"),
        ("--head-dim", int, "E", "elements per head (default: %(default)s)"),
        ("--tokens", int, "T", "tokens per request (default: %(default)s)"),
        ("--page-size", int, "S", "tokens per KV page (default: %(default)s)"),
        ("--requests", int, "R", "requests, each its own room (default: %(default)s)"),
    )
    add_typed_options(parser, default, geometry)
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=default.dtype,
        help="KV element type (default: %(default)s)",
    )
    seeds = (
        ("--seed", int, "N", "seed of the pages and KV data (default: %(default)s)"),
        ("--chunk-tokens", int, "C", "chunked-prefill size in tokens (default: %(default)s)"),
    )
    add_typed_options(parser, default, seeds)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=default.device,
        help="where every rank's KV pool, staging buffer and ring live (default: cpu)",
    )
    parser.add_argument(
        "--separate-layers",
        action="store_true",
        help="allocate each layer's K and V pool on its own instead of one KV cache buffer",
    )
    place = parser.add_argument_group(
        "placement",
        "Run one side on each of two machines: start one side (it prints its bootstrap "
        "endpoint), then the other with --bootstrap. A non-loopback --host needs the cluster "
        "secret (STAGING_CONTRACTS_SECRET or STAGING_CONTRACTS_SECRET_FILE) on both sides.",
    )
    place.add_argument(
        "--host",
        default=default.host,
        metavar="ADDR",
        help="address this side's ranks and bootstrap server bind and advertise "
        f"(default: {default.host})",
    )
    place.add_argument(
        "--ranks",
        choices=["all", "prefill", "decode"],
        default="all",
        help="start every rank here (default), or one side's only",
    )
    place.add_argument(
        "--bootstrap",
        metavar="tcp://ADDR:PORT",
        help="join the other side's bootstrap server instead of starting one here",
    )
    place.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help="stop this side's ranks after S seconds (default: %(default)s)",
    )


def config_from_args(args: argparse.Namespace) -> TransferConfig:
    """Build the run's configuration from parsed options.

    Raises:
        ValueError: a size is not positive, ``--device cuda`` with a backend whose engine moves
            host memory only (Mooncake's wheel here; :func:`~.preflight.check_device`),
            ``--device cuda`` without a CUDA device, or (where decode ranks run) more requests
            than a decode rank registers at once for one prefill instance (every room of the
            demo is registered before the first is sent).
    """
    check_device(args.backend, args.device)
    most = MAX_ROOMS_PER_PEER.value()
    if args.requests > most and args.ranks != "prefill":  # else the decode side's bound
        raise ValueError(
            f"--requests {args.requests}: the demo registers every request's room on decode "
            f"at once, and a decode rank holds at most {most} per prefill instance "
            f"({MAX_ROOMS_PER_PEER.name})"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here (torch.cuda.is_available() is false)")
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
        host=args.host,
        device=args.device,
    )


def placement_from_args(args: argparse.Namespace) -> DemoPlacement:
    """Where the run's ranks start, from parsed options.

    Raises:
        ValueError: a malformed ``--bootstrap``, a timeout that is not positive, or a
            non-loopback ``--host`` without a usable cluster secret in the environment.
    """
    if args.bootstrap is not None and _ENDPOINT.fullmatch(args.bootstrap) is None:
        raise ValueError(f"--bootstrap {args.bootstrap!r} is not tcp://ADDR:PORT")
    if not args.timeout > 0:
        raise ValueError(f"--timeout {args.timeout} must be > 0")
    try:
        if load_cluster_secret() is None:
            check_insecure_bind(args.host, allow_insecure=False)
    except SecurityError as exc:
        raise ValueError(str(exc)) from None
    return DemoPlacement(args.ranks, args.bootstrap, args.timeout)


class _ProgressBar:
    """Rooms finished on one side's ranks (decode's, unless only prefill runs here), redrawn
    in place on a terminal, line by line otherwise."""

    def __init__(self, total: int, out: TextIO, role: str = "decode") -> None:
        self._role = role
        self._total = total
        self._done = 0
        self._failed = 0
        self._out = out
        self._tty = out.isatty()

    def __call__(self, got: RankEvent) -> None:
        event = got.message
        if not isinstance(event, RequestDone) or got.role != self._role:
            return
        self._done += 1
        self._failed += 0 if event.ok else 1
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
    """The summary table of a run: its figures, what each rank held as the transfer ended
    (:func:`_memory_rows`) and each decode ring's reserved peak (:func:`_ring_peaks`); a
    rank that reported none of these (it died) shows ``?``."""
    config = result.config
    problems, errors = result.problems(), result.errors()
    prefill_here = result.side != "decode"
    decode_here = result.side != "prefill"
    elsewhere = "(on the prefill side)" if decode_here else "(on the decode side)"
    if result.verified and result.side == "prefill":
        verdict = (
            f"PASS: every one of {config.requests} requests sent by {config.prefill_tp} "
            "prefill ranks (the decode side verifies the pages)"
        )
    elif result.verified:
        verdict = (
            f"PASS: every page of {config.requests} requests on {config.decode_tp} decode ranks"
        )
    else:
        verdict = "FAIL: " + "; ".join((errors + problems)[:3] or ["see the rank reports"])
    rows = [
        ("backend", config.backend),
        (
            "device",
            "cuda (every rank on its current GPU, the same one: transfers within one GPU)"
            if config.device == "cuda"
            else config.device,
        ),
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
        *([("ranks here", f"{result.side} on {config.host}")] if result.side != "all" else []),
        ("bytes moved", f"{result.bytes_moved / 2**20:.1f} MiB" if prefill_here else elsewhere),
        (
            "transfer time",
            f"{result.elapsed_s:.3f} s" + (" (this side's clock)" if result.side != "all" else ""),
        ),
        ("throughput", f"{result.gbps:.2f} GB/s" if prefill_here else elsewhere),
        ("chunks staged", str(result.chunks) if decode_here else elsewhere),
        ("control messages", str(result.control_messages)),
        ("ring reserved peak", _ring_peaks(result) if decode_here else elsewhere),
        *_memory_rows(result),
        ("failed requests", ", ".join(map(str, sorted(result.failed_requests))) or "none"),
        ("verification", verdict),
    ]
    width = max(len(name) for name, _ in rows)
    table = "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)
    death = result.first_death
    if death is not None and result.interrupted is None:
        table = f"first failure: {death.role} rank {death.rank} {death.reason}\n{table}"
    if result.interrupted is not None:
        table = (
            f"PARTIAL: interrupted by {result.interrupted}; the figures are what the ranks "
            f"had measured when they were stopped\n{table}"
        )
    return table


def _ring_peaks(result: ClusterResult) -> str:
    """Each decode rank's reserved peak against its ring size (``ClusterResult.ring_peaks``);
    above the ring, the factor and why that is no overflow."""
    peaks = result.ring_peaks()
    parts = []
    over = False
    for rank in range(result.config.decode_tp):
        if rank not in peaks:
            parts.append(f"decode {rank}: ?")
            continue
        peak, size = peaks[rank]
        times = f" ({peak / size:.1f}x)" if peak > size else ""
        over |= peak > size
        parts.append(f"decode {rank}: {peak / 2**20:.1f} of {size / 2**20:.1f} MiB{times}")
    note = (
        "; above the ring: next-round regions reserved ahead, written once the watermark"
        " frees them (never more in use than the ring)"
        if over
        else ""
    )
    return "; ".join(parts) + note


def _memory_rows(result: ClusterResult) -> list[tuple[str, str]]:
    """Rows of what each rank held as the transfer ended (this side's ranks only in a split
    run), MiB by side and rank: peak RSS to the ``done`` barrier, RSS then, and the CUDA
    allocator's peak on CUDA."""
    sides = [
        (role, tp, result.transfer_memory(role))
        for role, tp in (
            ("prefill", result.config.prefill_tp),
            ("decode", result.config.decode_tp),
        )
        if result.side in ("all", role)
    ]

    def figures(pick: Callable[[RankMemory], int | None]) -> str:
        parts = []
        for role, tp, memory in sides:
            values = []
            for rank in range(tp):
                value = pick(memory[rank]) if rank in memory else None
                values.append("?" if value is None else f"{value / 2**20:.0f}")
            parts.append(f"{role} {', '.join(values)} MiB")
        return "; ".join(parts)

    origins = {m.peak_rss_from for _, _, memory in sides for m in memory.values()}
    since = (
        "since the process started"
        if "process start" in origins
        else "from the timed requests' start"
    )
    rows = [
        (
            "peak RSS to done",
            f"{figures(lambda m: m.peak_rss_before_verify_bytes)} (by rank; {since} to the"
            " done barrier, before verification)",
        ),
        ("RSS at done", f"{figures(lambda m: m.rss_at_done_bytes)} (by rank)"),
    ]
    if result.config.device == "cuda":
        rows.append(
            (
                "CUDA peak allocated",
                f"{figures(lambda m: m.cuda_max_allocated_bytes)} (by rank, timed requests;"
                " every rank on the same GPU)",
            )
        )
    return rows


def run_demo(
    config: TransferConfig,
    *,
    out: TextIO | None = None,
    placement: DemoPlacement | None = None,
    json_path: str | None = None,
    metrics_port: int | None = None,
) -> int:
    """Run the demo and print progress and the summary; return the exit status.

    With ``metrics_port``, every rank's Prometheus series are served at
    ``http://127.0.0.1:metrics_port/metrics`` while it runs (:mod:`.metrics_relay`).

    With one side's ranks only and no bootstrap to join, a bootstrap server is started here,
    on ``config.host``, and its endpoint printed for the other side's ``--bootstrap``.

    Returns:
        0 when every decode page verified (a prefill-only side: every request was sent),
        ``128 + N`` when signal ``N`` (``SIGTERM``, ``SIGINT``) stopped the run (the
        summary, marked partial, is printed still), 1 otherwise.

    With ``json_path``, the summary is also written there as JSON
    (:func:`~.summary_json.demo_summary`), a partial run's included.

    Raises:
        SecurityError: no cluster secret, and ``config.host`` is not loopback.
    """
    stream = out if out is not None else sys.stdout
    place = placement or DemoPlacement()
    stream.write(
        f"staging {config.requests} requests of {config.tokens} tokens over {config.backend}: "
        f"{config.prefill_tp} prefill ranks -> {config.decode_tp} decode ranks\n"
    )
    server: BootstrapServer | None = None
    bootstrap = place.bootstrap
    if place.ranks != "all":
        if bootstrap is None:
            server = BootstrapServer(config.host)
            server.start()
            bootstrap = server.endpoint
            stream.write(
                f"bootstrap server at {bootstrap}: start the other side with"
                f" --bootstrap {bootstrap}\n"
            )
        stream.write(f"this side: the {place.ranks} ranks, on {config.host}\n")
    stream.flush()
    role = "prefill" if place.ranks == "prefill" else "decode"
    tp = config.prefill_tp if role == "prefill" else config.decode_tp
    bar = _ProgressBar(config.requests * tp, stream, role)
    with stop_on_signals(raise_on_signal=False) as stop:
        try:
            with serving(metrics_port) as relay:
                if relay is not None:
                    stream.write(f"serving metrics at {relay.url}\n")
                    stream.flush()
                result = run_cluster(
                    config,
                    progress=bar,
                    timeout_s=place.timeout_s,
                    ranks=place.ranks,
                    bootstrap=bootstrap,
                    stop=stop,
                    metrics=relay,
                )
        finally:
            if server is not None:
                server.stop()
    stream.write(format_summary(result) + "\n")
    if json_path is not None:
        stream.write(f"wrote the summary to {write_summary(demo_summary(result), json_path)}\n")
    if result.interrupted is not None:
        return exit_status(result.interrupted)
    return 0 if result.verified else 1
