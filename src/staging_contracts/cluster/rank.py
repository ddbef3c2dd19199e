"""One prefill or decode rank of a staged-transfer run, as an OS process of its own.

Started by :func:`staging_contracts.cluster.runner.run_cluster` (``multiprocessing`` spawn). The
rank builds its KV pool and backend, meets its peers through the bootstrap server, runs every
request of the :class:`~staging_contracts.cluster.workload.TransferConfig` through the per-request
API, verifies (decode) and reports to the driver as JSON over ZMQ: ``ready``, one ``room``
event per finished request, and a final ``report``; every event carries the rank's ``pid``.

The rank binds and advertises ``config.host``: its control listener and its transfer
engine (the NIXL backend confines UCX to the interface holding it); Mooncake listens on
every interface whatever it is told, and says so at start-up (see
:mod:`staging_contracts.engines.mooncake`).

``SIGTERM`` (the driver's "stop": another rank died, or the run timed out) raises
:class:`RankStopped` in the rank's main thread: the rank closes its backend and sends a
final report with ``stopped: true``, the ``phase`` it was in and the ``rooms`` it finished.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import time
import traceback
from dataclasses import replace
from types import FrameType
from typing import Any

import torch
import zmq

from ..backends import load_backend
from ..backends.common import CommonKVManager, Role
from ..backends.kv_requests import DecodeTransfers, KVPoll, KVReceiver, KVSender, PrefillTransfers
from ..backends.staging_setup import StagingBackend, enable_decode_staging, enable_prefill_staging
from ..prefill.writer import DecodeTarget, PrefillTimeouts
from ..staging.layout import compute_staging_layout
from .bootstrap import RankInfo, arrive, query_ranks, register_rank, wait_barrier
from .workload import TransferConfig, fill_prefill_pool, request_plans, verify_decode_pool

__all__ = ["RankStopped", "rank_main"]

logger = logging.getLogger(__name__)

ROOM_TIMEOUT_S = 120.0
RENDEZVOUS_TIMEOUT_S = 120.0
"""How long a rank waits for the other side's ranks to register or reach a barrier: when
the two sides are started by hand on two machines, one may start well after the other."""
_FAULT_OFFSET = 1 << 40


class RankStopped(BaseException):
    """The driver told this rank to stop (``SIGTERM``).

    A ``BaseException``, like ``KeyboardInterrupt``, so that no handler for ordinary errors
    on the way keeps the rank running.
    """


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    del frame
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: let the rank close and report
    raise RankStopped(f"stopped by the driver ({signal.Signals(signum).name})")


def rank_main(role: str, rank: int, config: TransferConfig, bootstrap: str, report_to: str) -> None:
    """Process entry point: run one rank; report the outcome; never raise.

    **Blocking:** until every request of the run finished on this rank, or ``SIGTERM``.
    """
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    logging.basicConfig(
        level=logging.WARNING, format=f"[{role}{rank}] %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's C++ info and warning logs
    torch.set_num_threads(1)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    reporter = ctx.socket(zmq.PUSH)
    reporter.setsockopt(zmq.LINGER, 5000)
    reporter.connect(report_to)

    seen: dict[str, Any] = {"phase": "starting", "rooms": {}}
    """What the rank did so far, for a report that ends the run early."""

    def report(kind: str, **fields: Any) -> None:
        if kind == "ready":
            seen["phase"] = "running requests"
        elif kind == "room":
            seen["rooms"][str(fields.get("index"))] = bool(fields.get("ok"))
        event = {"kind": kind, "role": role, "rank": rank, "pid": os.getpid(), **fields}
        reporter.send(json.dumps(event).encode())

    try:
        summary = (
            _run_decode(rank, config, bootstrap, report)
            if role == "decode"
            else _run_prefill(rank, config, bootstrap, report)
        )
        seen["phase"] = "done"
        report("report", ok=True, **summary)
    except BaseException as exc:  # noqa: BLE001 - a rank reports every failure, then exits
        report(
            "report",
            ok=False,
            stopped=isinstance(exc, RankStopped),
            error=f"{type(exc).__name__}: {exc}",
            trace=traceback.format_exc(),
            **seen,
        )
    finally:
        reporter.close()


def _make_manager(config: TransferConfig, role: Role, rank: int) -> StagingBackend:
    backend = load_backend(config.backend)
    logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL installs an INFO handler
    tp = config.prefill_tp if role is Role.PREFILL else config.decode_tp
    manager: StagingBackend = backend(
        config.kv_args(tp, rank), role=role, attn_tp_size=tp, host=config.host
    )
    return manager


def _ring_bytes(config: TransferConfig) -> int:
    layouts = [
        compute_staging_layout(
            config.prefill_tp,
            config.decode_tp,
            d,
            config.kv_heads,
            config.chunk_pages * config.page_size,
            config.head_dim * config.element_size,
            config.layers,
        ).total_bytes
        for d in range(config.decode_tp)
    ]
    return max(layouts) * config.ring_chunks


def _run_decode(rank: int, config: TransferConfig, bootstrap: str, report: Any) -> dict[str, Any]:
    pool = config.empty_pool(config.decode_tp, rank)
    manager = _make_manager(config, Role.DECODE, rank)
    common: CommonKVManager = manager  # type: ignore[assignment]  # every backend is one
    try:
        handler = enable_decode_staging(manager, kv_buffers=pool, ring_bytes=_ring_bytes(config))
        common.start()
        engine = manager.engine
        allocator = handler.allocator
        register_rank(
            bootstrap,
            RankInfo(
                "decode",
                rank,
                common.endpoint,
                engine.session_id,
                engine.metadata(),
                allocator.base_ptr,
                allocator.total_size,
                _key_text(common.curve_key),
            ),
        )
        prefill = query_ranks(bootstrap, "prefill", config.prefill_tp, RENDEZVOUS_TIMEOUT_S)
        _trust(common, prefill)
        transfers = DecodeTransfers(common, handler, [info.endpoint for info in prefill])
        _freeze_heap()
        report("ready")
        receivers: dict[int, KVReceiver] = {}
        for plan in request_plans(config):
            receiver = KVReceiver(transfers, plan.room)
            receiver.init(plan.decode_pages, chunk_pages=config.chunk_pages)
            receiver.send_metadata()
            receivers[plan.index] = receiver
        arrive(bootstrap, "rooms", f"decode-{rank}")
        start = time.monotonic()
        outcome = _wait_all(receivers, report)
        end = time.monotonic()
        arrive(bootstrap, "done", f"decode-{rank}")
        succeeded = {i for i, state in outcome.items() if state is KVPoll.Success}
        problems = verify_decode_pool(pool, config, rank, succeeded)
        failures = {i: receivers[i].failure() for i in outcome if i not in succeeded}
        for receiver in receivers.values():
            receiver.release()
        stats = manager.staging_stats()
        return {
            "start": start,
            "end": end,
            "verified": not problems,
            "problems": problems[:10],
            "succeeded": sorted(succeeded),
            "failed": {str(i): reason for i, reason in failures.items()},
            "ring_peak": allocator.peak_bytes,
            "ring_size": allocator.total_size,
            "ring_live_after": allocator.live_count,
            "control_messages": stats.received,
            "malformed": stats.malformed,
            "chunks": stats.allocated,
            "registered_after": _release_staging(manager, allocator.base_ptr),
        }
    finally:
        common.close()


def _run_prefill(rank: int, config: TransferConfig, bootstrap: str, report: Any) -> dict[str, Any]:
    pool = config.empty_pool(config.prefill_tp, rank)
    fill_prefill_pool(pool, config, rank)
    manager = _make_manager(config, Role.PREFILL, rank)
    common: CommonKVManager = manager  # type: ignore[assignment]  # every backend is one
    try:
        writer = enable_prefill_staging(
            manager,
            kv_buffers=pool,
            max_chunk_pages=config.chunk_pages,
            timeouts=PrefillTimeouts(answer_s=0.5, ready_s=0.5, deadline_s=60.0),
        )
        transfers = PrefillTransfers(common, writer)
        common.start()
        engine = manager.engine
        decode = query_ranks(bootstrap, "decode", config.decode_tp, RENDEZVOUS_TIMEOUT_S)
        _trust(common, decode)
        for info in decode:
            engine.add_peer(info.session_id, info.metadata)
        targets = [
            DecodeTarget(i.tp_rank, i.session_id, i.endpoint, i.ring_base, i.ring_size)
            for i in decode
        ]
        register_rank(
            bootstrap,
            RankInfo(
                "prefill",
                rank,
                common.endpoint,
                engine.session_id,
                engine.metadata(),
                curve_key=_key_text(common.curve_key),
            ),
        )
        _freeze_heap()
        report("ready")
        # Start once decode has registered every room, as a serving decode does before
        # prefill computes: the clock then measures the transfer, not the bootstrap.
        wait_barrier(bootstrap, "rooms", config.decode_tp, RENDEZVOUS_TIMEOUT_S)
        start = time.monotonic()
        senders: dict[int, KVSender] = {}
        for plan in request_plans(config):
            sender = KVSender(transfers, plan.room)
            faulty = rank == 0 and plan.index in config.fail_rooms
            sender.init(
                config.num_pages,
                [replace(t, ring_base=t.ring_base + _FAULT_OFFSET) for t in targets]
                if faulty
                else targets,
            )
            chunks = list(config.chunks())
            for number, (page_start, count) in enumerate(chunks):
                sender.send(
                    plan.prefill_pages[page_start : page_start + count],
                    last=number == len(chunks) - 1,
                )
            senders[plan.index] = sender
        outcome = _wait_all(senders, report)
        end = time.monotonic()
        # Stay up until every decode rank is done, as a serving prefill does: tearing four
        # processes down would take the CPU from the decode ranks' last scatters.
        wait_barrier(bootstrap, "done", config.decode_tp, timeout=ROOM_TIMEOUT_S)
        failures = {
            str(i): senders[i].failure()
            for i, state in outcome.items()
            if state is not KVPoll.Success
        }
        for sender in senders.values():
            sender.release()
        transfers.close()
        writer.close()
        stats = manager.staging_stats()
        return {
            "start": start,
            "end": end,
            "bytes_written": writer.bytes_written,
            "requests_sent": writer.requests_sent,
            "succeeded": sorted(i for i, s in outcome.items() if s is KVPoll.Success),
            "failed": failures,
            "control_messages": stats.received + writer.requests_sent,
            "registered_after": _registered(manager),
        }
    finally:
        common.close()


def _key_text(key: bytes | None) -> str:
    """A CURVE public key as published at bootstrap (empty without a cluster secret)."""
    return "" if key is None else key.decode("ascii")


def _trust(manager: CommonKVManager, peers: list[RankInfo]) -> None:
    """Trust each peer's listener by the key it published (a no-op without a secret)."""
    for info in peers:
        manager.trust_peer(info.endpoint, info.curve_key.encode("ascii") or None)


def _freeze_heap() -> None:
    """Collect once and move every object made during start-up out of the collector's reach,
    as serving engines do once they are up (``gc.freeze``).

    Otherwise the first full collection falls inside the transfer: with torch, NumPy and an
    engine loaded it walks every module object, about 80 ms of CPU per process here, and it
    came in four prefill processes at once.
    """
    gc.collect()
    gc.freeze()


def _wait_all(
    requests: dict[int, KVSender] | dict[int, KVReceiver], report: Any
) -> dict[int, KVPoll]:
    """Wait for every request in turn, reporting each as it ends.

    Blocking waits, not polls: six rank processes share two cores here, and polling main
    threads took CPU from the copying ones; the decode clock also stops when the last room
    ends, not at the next poll.
    """
    done: dict[int, KVPoll] = {}
    deadline = time.monotonic() + ROOM_TIMEOUT_S
    for index, request in requests.items():
        state = request.wait(max(0.0, deadline - time.monotonic()))
        if state not in (KVPoll.Success, KVPoll.Failed):
            raise TimeoutError(f"requests {sorted(set(requests) - set(done))} did not finish")
        done[index] = state
        report("room", index=index, ok=state is KVPoll.Success)
    return done


def _release_staging(manager: StagingBackend, ring_base: int) -> int:
    manager.engine.deregister(ring_base)
    return _registered(manager)


def _registered(manager: StagingBackend) -> int:
    count = getattr(manager.engine, "registered_regions", -1)
    return int(count) if isinstance(count, int) else -1
