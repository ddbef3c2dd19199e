"""The two sides of an engine-anchor measurement: buffers, transfer plans, child entry points.

:mod:`~staging_contracts.bench._anchor_runner` starts :func:`receiver_main` and
:func:`writer_main` in two ``spawn`` child processes (or, for the ``"local"`` engine, calls
:func:`prepare_receiver`, :func:`time_writes` and :func:`check_target` in its own process).

* The **receiver** builds its engine, registers a zeroed target buffer and sends
  ``(session_id, metadata, address)`` to the writer; then it drives its engine
  (``poll_notifications``, which NIXL needs while a peer writes to it) until the writer
  sends ``"stop"``, checks the bytes if asked, and reports ``{"verified": ...}``.
* The **writer** builds its engine, registers a source buffer, waits for the receiver's
  address, builds the plan (:func:`plan_writes`: a list of write calls, each a list of
  transfers), times ``warmup + repeats`` passes over the plan, tells the receiver to stop and
  reports the samples.

Each side closes its engine and returns, so the process exits 0; any failure is reported to
the parent as ``("error", traceback)`` and re-raised, so the process exits 1. Every wait is
bounded by the job's ``timeout_s``.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal

import torch

from ..engines import load_engine_class
from ..protocols import Transfer, TransferEngine
from .anchor_geometry import AnchorGeometry

__all__ = [
    "AnchorJob",
    "check_target",
    "expected_target",
    "make_engine",
    "make_source",
    "plan_writes",
    "prepare_receiver",
    "receiver_main",
    "source_size",
    "target_size",
    "time_writes",
    "writer_main",
    "writer_report",
]

logger = logging.getLogger(__name__)

_SEED = 20240611
_POLL_S = 0.0005
"""How long the receiver sleeps in ``Connection.poll`` between two progress calls."""
_IDLE_POLL_S = 0.05
"""The same where the engine needs no progress from the receiver (Mooncake)."""


@dataclass(frozen=True, slots=True)
class AnchorJob:
    """One measurement, as both child processes see it (pickled to them)."""

    engine: str
    """Registry name of the engine."""
    kind: Literal["raw", "per-token"]
    """``raw``: one bulk write of ``nbytes``; ``per-token``: per-token slices of a KV share."""
    repeats: int
    """Timed passes over the plan (the median is reported)."""
    warmup: int = 1
    """Untimed passes first (connection set-up, first touch of the pages)."""
    nbytes: int = 0
    """``raw`` only: bytes of the bulk write."""
    max_transfer_bytes: int = 0
    """``raw`` only: split the write into transfers of at most this many bytes (0: one)."""
    geometry: AnchorGeometry | None = None
    """``per-token`` only: the KV layout."""
    tokens: int = 0
    """``per-token`` only: tokens transferred (a subset of ``geometry.tokens`` is fine)."""
    transfers_per_write: int = 0
    """``per-token`` only: transfers per ``write`` call (0: every transfer in one call)."""
    verify: bool = False
    """Fill the source with seeded random bytes and check every byte the receiver holds."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Engine constructor options."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment set in each child before the engine is loaded (e.g. ``UCX_MODULES``)."""
    timeout_s: float = 300.0
    """Bound on everything a child waits for."""


# --------------------------------------------------------------------------- layouts


def _geometry(job: AnchorJob) -> AnchorGeometry:
    if job.geometry is None:
        raise ValueError("a per-token job needs a geometry")
    return job.geometry


def _rows(job: AnchorJob) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Pool rows per layer, and the pool row of each token on the prefill and decode side.

    Tokens fill pages of ``page_size`` rows; the pages are a seeded random permutation of
    the pool's, different on each side, as a paged allocator hands them out.
    """
    page = _geometry(job).page_size
    pages = -(-job.tokens // page)
    token = torch.arange(job.tokens)
    rows: list[torch.Tensor] = []
    for seed in (_SEED + 1, _SEED + 2):
        order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
        rows.append(order[token // page] * page + token % page)
    return pages * page, rows[0], rows[1]


def source_size(job: AnchorJob) -> int:
    """Bytes of the writer's buffer: the raw bytes, or the prefill rank's K/V pool."""
    if job.kind == "raw":
        return job.nbytes
    geometry = _geometry(job)
    return 2 * geometry.layers * _rows(job)[0] * geometry.prefill_row_bytes


def target_size(job: AnchorJob) -> int:
    """Bytes of the receiver's buffer: the raw bytes, or the decode rank's K/V pool."""
    if job.kind == "raw":
        return job.nbytes
    geometry = _geometry(job)
    return 2 * geometry.layers * _rows(job)[0] * geometry.decode_row_bytes


def make_source(job: AnchorJob) -> torch.Tensor:
    """The writer's buffer: seeded random bytes with ``verify``, else a constant pattern."""
    size = source_size(job)
    if job.verify:
        generator = torch.Generator().manual_seed(_SEED)
        return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
    return torch.full((size,), 0x5A, dtype=torch.uint8)


def plan_writes(job: AnchorJob, local: int, remote: int) -> list[list[Transfer]]:
    """The write calls of one pass, each a list of transfers, from ``local`` to ``remote``.

    ``raw``: one call, split into transfers of at most ``max_transfer_bytes``.
    ``per-token``: for each of K and V, each layer and each token, one transfer of the
    prefill row's ``heads_sent`` heads into the decode row at this prefill rank's head
    offset; ordered by (K/V, layer, token) and cut into calls of ``transfers_per_write``
    (``tokens``: one call per layer's K or V; 0: one call for everything).
    """
    if job.kind == "raw":
        step = job.max_transfer_bytes or job.nbytes
        return [
            [
                Transfer(local + offset, remote + offset, min(step, job.nbytes - offset))
                for offset in range(0, job.nbytes, step)
            ]
        ]
    geometry = _geometry(job)
    pool_rows, src_rows, dst_rows = _rows(job)
    src_row, dst_row = geometry.prefill_row_bytes, geometry.decode_row_bytes
    src_off, dst_off = geometry.head_offsets_bytes
    length = geometry.slice_bytes
    transfers: list[Transfer] = []
    for buffer in range(2 * geometry.layers):  # K of every layer, then V of every layer
        src_base = local + buffer * pool_rows * src_row + src_off
        dst_base = remote + buffer * pool_rows * dst_row + dst_off
        transfers.extend(
            Transfer(src_base + s * src_row, dst_base + d * dst_row, length)
            for s, d in zip(src_rows.tolist(), dst_rows.tolist(), strict=True)
        )
    step = job.transfers_per_write or len(transfers)
    return [transfers[start : start + step] for start in range(0, len(transfers), step)]


def expected_target(job: AnchorJob) -> torch.Tensor:
    """What the receiver's buffer holds after a pass of a ``verify`` job."""
    source = make_source(job)
    if job.kind == "raw":
        return source
    geometry = _geometry(job)
    pool_rows, src_rows, dst_rows = _rows(job)
    head_bytes = geometry.head_dim * geometry.element_size
    buffers = 2 * geometry.layers
    src = source.view(buffers, pool_rows, geometry.heads_per_prefill_rank, head_bytes)
    dst = torch.zeros(
        buffers, pool_rows, geometry.heads_per_decode_rank, head_bytes, dtype=torch.uint8
    )
    src_head, dst_head = (offset // head_bytes for offset in geometry.head_offsets_bytes)
    sent = geometry.heads_sent
    dst[:, dst_rows, dst_head : dst_head + sent] = src[:, src_rows, src_head : src_head + sent]
    return dst.view(-1)


def check_target(job: AnchorJob, target: torch.Tensor) -> bool:
    """Does ``target`` hold exactly what a pass of ``job`` writes (every other byte zero)?"""
    expected = expected_target(job)
    if torch.equal(target, expected):
        return True
    wrong = int((target != expected).sum())
    logger.warning("%s anchor over %s: %d bytes differ", job.kind, job.engine, wrong)
    return False


# --------------------------------------------------------------------------- both sides


def make_engine(job: AnchorJob) -> TransferEngine:
    """Set the job's environment, then build its engine with its options.

    NIXL always gets ``UCX_MODULES=^ib`` and ``load_ib_modules=False`` unless the job says
    otherwise: a process that loaded UCX's InfiniBand modules may crash at exit here.
    """
    os.environ.update(job.env)
    options = dict(job.options)
    if job.engine == "nixl":
        os.environ.setdefault("UCX_MODULES", "^ib")
        options.setdefault("load_ib_modules", False)
    engine: TransferEngine = load_engine_class(job.engine)(**options)
    logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL installs an INFO handler
    return engine


def prepare_receiver(job: AnchorJob, engine: TransferEngine) -> torch.Tensor:
    """A zeroed target buffer, registered with ``engine``."""
    target = torch.zeros(target_size(job), dtype=torch.uint8)
    engine.register(target.data_ptr(), target.numel())
    return target


def time_writes(
    job: AnchorJob,
    engine: TransferEngine,
    peer: str,
    writes: Sequence[Sequence[Transfer]],
    deadline: float,
) -> list[float]:
    """Seconds of each timed pass: every write call of the plan, one after the other.

    **Blocking:** for ``warmup + repeats`` passes; each ``write`` blocks until its bytes
    landed.

    Raises:
        TimeoutError: the passes ran past ``deadline`` (``time.monotonic``).
        TransferError: the engine failed a write.
    """
    samples: list[float] = []
    for index in range(job.warmup + job.repeats):
        start = time.perf_counter()
        for transfers in writes:
            engine.write(peer, transfers)
        if index >= job.warmup:
            samples.append(time.perf_counter() - start)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{job.kind} writes over {job.engine} ran past the {job.timeout_s} s timeout"
                f" after {index + 1} passes"
            )
    return samples


def writer_report(samples: list[float], writes: Sequence[Sequence[Transfer]]) -> dict[str, Any]:
    """What the writer reports: the samples, and the bytes, calls and transfers of a pass."""
    return {
        "samples": samples,
        "nbytes": sum(t.length for transfers in writes for t in transfers),
        "writes": len(writes),
        "transfers": sum(len(transfers) for transfers in writes),
    }


def _recv(conn: Connection, deadline: float, engine: TransferEngine | None) -> Any:
    """Receive one message, driving ``engine`` while waiting if it has notifications (NIXL)."""
    driven = engine is not None and engine.supports_notifications
    while not conn.poll(_POLL_S if driven else _IDLE_POLL_S):
        if driven and engine is not None:
            engine.poll_notifications()
        if time.monotonic() > deadline:
            raise TimeoutError("the peer process sent nothing in time")
    return conn.recv()


def receiver_main(job: AnchorJob, peer: Connection, report: Connection) -> None:
    """Child entry point: hold the target buffer and drive the engine until told to stop."""
    deadline = time.monotonic() + job.timeout_s
    engine: TransferEngine | None = None
    try:
        engine = make_engine(job)
        target = prepare_receiver(job, engine)
        peer.send((engine.session_id, engine.metadata(), target.data_ptr()))
        message = _recv(peer, deadline, engine)
        if message != "stop":
            raise RuntimeError(f"unexpected message from the writer: {message!r}")
        verified = check_target(job, target) if job.verify else None
        report.send(("ok", {"verified": verified}))
    except BaseException:
        report.send(("error", traceback.format_exc()))
        raise
    finally:
        if engine is not None:
            engine.close()


def writer_main(job: AnchorJob, peer: Connection, report: Connection) -> None:
    """Child entry point: write the plan ``warmup + repeats`` times and report the times."""
    deadline = time.monotonic() + job.timeout_s
    engine: TransferEngine | None = None
    try:
        engine = make_engine(job)
        source = make_source(job)
        engine.register(source.data_ptr(), source.numel())
        session, metadata, remote = _recv(peer, deadline, None)
        engine.add_peer(session, metadata)
        writes = plan_writes(job, source.data_ptr(), remote)
        samples = time_writes(job, engine, session, writes, deadline)
        peer.send("stop")
        report.send(("ok", writer_report(samples, writes)))
    except BaseException:
        report.send(("error", traceback.format_exc()))
        raise
    finally:
        if engine is not None:
            engine.close()
