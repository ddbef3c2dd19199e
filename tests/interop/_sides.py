"""The reference's decode and prefill staging sides, driven from its own code, for real runs.

:class:`ReferenceDecodeRank` is its decode rank: a thread draining a ZMQ PULL socket, handing
``STAGING_REQ`` to its manager's ``_handle_staging_req`` (its mixin: ``handle_staging_req``,
its allocator, the watermark subscription) and ``CHUNK_READY`` to its
``CommonKVManager.handle_chunk_ready`` (its ``DecodeStagingHandler``: arrivals, its torch
scatter into the KV pool), and polling ``advance_scatter`` (its frees and ``WATERMARK``
broadcasts) as its scheduler does.

:class:`ReferencePrefillRank` is its prefill rank: ``prefetch_staging_reqs`` over its own ZMQ
sockets, a thread draining its bootstrap socket into ``handle_staging_rsp`` and
``handle_watermark_msg``, and for every chunk its Mooncake manager's ``_do_staging_transfer``
(``PrefillStagingStrategy.check_ready``, ``send_kvcache_staged`` with its gather, and
``send_chunk_ready``).

What its server would provide and a CPU test does not run is stood in for: the managers are
its classes created without their server start-up (``object.__new__``) and given the
attributes its staging code reads; the KV receivers, transfer infos and request table are
:mod:`._fakes`; the bulk write is one of our engines (its own agents need the GPU); the
allocator and the prefill staging buffer are on the CPU (see :mod:`._reference`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import zmq

from staging_contracts import KVArgsRecord, KVBufferTensors
from staging_contracts.protocols import Transfer, TransferEngine
from tests.interop._fakes import PrefillInfo, Receiver, TransferInfo, ZmqSocket
from tests.interop._reference import CpuStagingBuffer, CpuStream, Reference, cpu_staging_allocator

__all__ = ["ReferenceDecodeRank", "ReferencePrefillRank"]

logger = logging.getLogger(__name__)

_POLL_MS = 1


def _bind_pull(context: zmq.Context[zmq.Socket[bytes]]) -> tuple[zmq.Socket[bytes], str]:
    socket: zmq.Socket[bytes] = context.socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    return socket, f"tcp://127.0.0.1:{port}"


def _pool_dict(pool: KVBufferTensors) -> dict[str, Any]:
    """A pool as the reference's managers hold it (``kv_buffer_tensors``)."""
    return {
        "k_buffers": list(pool.k_buffers),
        "v_buffers": list(pool.v_buffers),
        "page_size": pool.page_size,
    }


class _Loop:
    """A thread running ``step`` until stopped, keeping the first errors it raises."""

    def __init__(self, name: str, step: Callable[[], None]) -> None:
        self.errors: list[BaseException] = []
        self._step = step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception as exc:  # kept for the test to assert on; the loop goes on
                logger.exception("%s failed a step", self._thread.name)
                if len(self.errors) < 10:
                    self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


class ReferenceDecodeRank:
    """One decode rank of the reference (its handler, allocator and scatter).

    Args:
        reference: the reference's modules.
        kv_args: this rank's KV arguments.
        decode_tp: attention TP size of decode.
        pool: this rank's KV pool (scattered into).
        ring_bytes: size of its staging ring.
        engine: our engine standing in for its transfer agent (the ring is registered).
        progress: called every loop turn (drives an engine that needs the receiver).
    """

    def __init__(
        self,
        reference: Reference,
        *,
        kv_args: KVArgsRecord,
        decode_tp: int,
        pool: KVBufferTensors,
        ring_bytes: int,
        engine: TransferEngine,
        progress: Callable[[], None] | None = None,
        max_tokens: int = 1024,
    ) -> None:
        self.reference = reference
        self.engine = engine
        self._progress = progress
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.socket, self.endpoint = _bind_pull(self._context)
        handler_module = reference.staging_handler
        self.allocator: Any = cpu_staging_allocator(reference, ring_bytes)
        # its first scatter would create a device stream (torch's CPU Stream takes no device)
        self.allocator._scatter_stream = CpuStream()
        engine.register(self.allocator.base_ptr, ring_bytes)
        manager: Any = object.__new__(reference.nixl_conn.NixlKVManager)
        manager.kv_args = kv_args
        manager.attn_tp_size = decode_tp
        manager.pp_size = 1
        manager.enable_staging = True
        manager.request_status = {}
        manager._staging_ctx = handler_module.DecodeStagingContext(allocator=self.allocator)
        # its handler's constructor insists on an indexed (accelerator) device: it is shown a
        # pool on "cpu:0", then given the real one
        manager.kv_buffer_tensors = {
            "k_buffers": [types.SimpleNamespace(device=torch.device("cpu", 0))]
        }
        self.req_to_token = torch.zeros((16, max_tokens), dtype=torch.int64)
        scheduler = types.SimpleNamespace(
            req_to_token_pool=types.SimpleNamespace(req_to_token=self.req_to_token)
        )
        self.handler: Any = handler_module.DecodeStagingHandler.create(
            manager, scheduler, kv_args.engine_rank
        )
        manager.kv_buffer_tensors = self.handler.kv_buffer_info = _pool_dict(pool)
        manager._staging_handler = self.handler
        self.manager = manager
        self.pool = pool
        self._requests: dict[int, Any] = {}
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._sockets: list[ZmqSocket] = []
        self.received: list[bytes] = []
        """Frame 0 of every message its listener took, in order."""
        self.ignored: list[list[bytes]] = []
        """Messages that are none of its staging messages (it logs and drops them)."""
        self._loop = _Loop(f"reference-decode-{kv_args.engine_rank}", self._step)
        self._loop.start()

    @property
    def errors(self) -> list[BaseException]:
        """What its code raised on the decode thread."""
        return self._loop.errors

    def _call(self, command: Callable[[], object], timeout: float = 10.0) -> None:
        """Run ``command`` on the decode thread and wait for it."""
        done = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                command()
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                failure.append(exc)
            finally:
                done.set()

        self._commands.put(run)
        if not done.wait(timeout):
            raise TimeoutError("the reference decode thread did not run the command")
        if failure:
            raise failure[0]

    def register_room(
        self,
        room: int,
        slot: int,
        decode_pages: Sequence[int],
        prefill: dict[int, str],
        prefill_tp: int,
    ) -> None:
        """Register a room as its decode does before prefill hears of it: the receiver with
        the prefill ranks to answer (rank -> control endpoint), the request's token table,
        the staging handler's request."""
        page_size = self.pool.page_size
        tokens = [p * page_size + t for p in decode_pages for t in range(page_size)]
        sockets = {rank: ZmqSocket(self._context, endpoint) for rank, endpoint in prefill.items()}
        self._sockets.extend(sockets.values())
        receiver = Receiver(
            [{"rank": rank, "pp_rank": 0} for rank in sorted(prefill)],
            dict(sockets),
            PrefillInfo(prefill_tp),
        )
        request = types.SimpleNamespace(
            req=types.SimpleNamespace(
                kv=types.SimpleNamespace(cache_protected_len=0, req_pool_idx=slot),
                bootstrap_room=room,
            ),
            kv_receiver=receiver,
        )

        def register() -> None:
            self.req_to_token[slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            self.manager.register_staging_room_bootstrap(room, receiver.bootstrap_infos, receiver)
            self.handler.register_decode_req(room, request)
            self.manager.request_status[room] = 0
            self._requests[room] = request

        self._call(register)

    def finish_room(self, room: int) -> None:
        """Tell its handler every prefill rank reported success (no more chunks)."""
        self._call(lambda: self.handler.submit_last_scatter_async(room))

    def wait_done(self, room: int, timeout: float = 20.0) -> bool:
        """Wait until its handler says the room's scatters are all done (or failed)."""
        request = self._requests[room]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.handler.is_failed(request):
                return False
            if self.handler.is_done(request):
                return True
            time.sleep(0.005)
        return False

    def _step(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            command()
        if self._progress is not None:
            self._progress()
        if self.socket.poll(_POLL_MS):
            frames = self.socket.recv_multipart()
            self.received.append(frames[0])
            if frames[0] == b"STAGING_REQ":
                self.manager._handle_staging_req(frames)
            elif not self.manager.handle_chunk_ready(frames):
                self.ignored.append(frames)
        for request in list(self._requests.values()):
            self.handler.advance_scatter(request)

    def close(self) -> None:
        """Stop the thread and close its sockets."""
        self._loop.stop()
        for socket in self._sockets:
            socket.close()
        self.socket.close(linger=0)
        self._context.term()


class _BatchTransfer:
    """Its Mooncake manager's transfer engine (``batch_transfer_sync``), as one of our
    engines' bulk write."""

    def __init__(self, engine: TransferEngine) -> None:
        self._engine = engine
        self.writes = 0

    def batch_transfer_sync(
        self, session: str, sources: list[int], targets: list[int], lengths: list[int]
    ) -> int:
        self._engine.write(
            session, [Transfer(s, t, n) for s, t, n in zip(sources, targets, lengths, strict=True)]
        )
        self.writes += 1
        return 0


class ReferencePrefillRank:
    """One prefill rank of the reference (its request, readiness, gather and arrival code).

    Args:
        reference: the reference's modules.
        kv_args: this rank's KV arguments.
        prefill_tp: attention TP size of prefill.
        pool: this rank's KV pool (gathered from).
        chunk_pages: pages per chunk (its ``chunked_prefill_size`` in pages).
        engine: our engine standing in for its transfer engine.
    """

    def __init__(
        self,
        reference: Reference,
        *,
        kv_args: KVArgsRecord,
        prefill_tp: int,
        pool: KVBufferTensors,
        chunk_pages: int,
        engine: TransferEngine,
    ) -> None:
        self.reference = reference
        self.engine = engine
        self.chunk_pages = chunk_pages
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.socket, self.endpoint = _bind_pull(self._context)
        handler_module = reference.staging_handler
        item = pool.k_buffers[0]
        self.staging = CpuStagingBuffer(
            chunk_pages
            * pool.page_size
            * item.shape[1]
            * item.shape[2]
            * item.element_size()
            * 2
            * len(pool.k_buffers)
        )
        engine.register(self.staging.get_ptr(), self.staging.get_size())
        manager: Any = object.__new__(reference.mooncake_conn.MooncakeKVManager)
        manager.kv_args = kv_args
        manager.attn_tp_size = prefill_tp
        manager.attn_tp_rank = kv_args.engine_rank
        manager.pp_size = 1
        manager.pp_rank = 0
        manager.attn_cp_size = 1
        manager.attn_cp_rank = 0
        manager.kv_buffer_tensors = _pool_dict(pool)
        manager._staging_ctx = handler_module.PrefillStagingContext()
        manager.transfer_infos = {}
        manager.engine = _BatchTransfer(engine)
        manager._send_multipart_locked = self._send
        self.manager = manager
        # its strategy's constructor reads the server's published scheduling config, which a
        # test does not publish: its three fields are set as the constructor would
        strategy: Any = object.__new__(handler_module.PrefillStagingStrategy)
        strategy.kv_manager = manager
        strategy.staging_buffer = self.staging
        strategy.full_chunk_pages = chunk_pages
        self.strategy = strategy
        self._sockets: dict[str, ZmqSocket] = {}
        self._lock = threading.Lock()
        self.ignored: list[list[bytes]] = []
        """Messages its bootstrap thread would not take as staging messages."""
        self._loop = _Loop(f"reference-prefill-{kv_args.engine_rank}", self._step)
        self._loop.start()

    @property
    def errors(self) -> list[BaseException]:
        """What its code raised on the bootstrap thread."""
        return self._loop.errors

    def _send(self, endpoint: str, parts: list[bytes], is_ipv6: bool = False) -> None:
        del is_ipv6
        with self._lock:
            socket = self._sockets.get(endpoint)
            if socket is None:
                socket = self._sockets[endpoint] = ZmqSocket(self._context, endpoint)
            socket.send_multipart(parts)

    def _step(self) -> None:
        if not self.socket.poll(_POLL_MS):
            return
        frames = self.socket.recv_multipart()
        handler_module = self.reference.staging_handler
        with self._lock:
            if frames[0] == b"WATERMARK":
                handler_module.handle_watermark_msg(self.manager._staging_ctx, frames)
            elif frames[0] == b"STAGING_RSP":
                handler_module.handle_staging_rsp(frames, self.manager.transfer_infos)
            else:
                self.ignored.append(frames)

    def add_room(self, room: int, decode: dict[str, tuple[str, list[int]]]) -> None:
        """Learn a room's decode ranks as its bootstrap would: session -> (control endpoint,
        the room's decode pages)."""
        infos = {}
        for session, (endpoint, pages) in decode.items():
            host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
            infos[session] = TransferInfo(
                host,
                int(port),
                list(pages),
                agent_name=session,
                mooncake_session_id=session,
                room=room,
            )
        with self._lock:
            self.manager.transfer_infos[room] = infos

    def prefetch(self, room: int) -> None:
        """Its prefetch: one STAGING_REQ per chunk and decode rank, over its own sockets."""
        ctx = self.manager._staging_ctx
        self.reference.staging_handler.prefetch_staging_reqs(
            room,
            self.manager.transfer_infos,
            self.manager.kv_buffer_tensors,
            self.chunk_pages * self.manager.kv_buffer_tensors["page_size"],
            ctx.prefetch_requested,
            ctx.prefetch_sockets,
        )

    def send_chunk(
        self,
        room: int,
        session: str,
        target: Any,
        page_start: int,
        pages: Sequence[int],
        timeout: float = 20.0,
    ) -> None:
        """Its transfer worker's staged send of one chunk to one decode rank: readiness
        (re-tried while not ready, as its worker re-enqueues), gather, write, CHUNK_READY.

        Raises:
            RuntimeError: its code failed the chunk, or it was not ready in time.
        """
        chunk = types.SimpleNamespace(
            room=room,
            index_slice=slice(page_start, page_start + len(pages)),
            prefill_kv_indices=np.array(pages, dtype=np.int32),
        )
        retries: list[Any] = []
        requeue = types.SimpleNamespace(put=retries.append)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                request = self.manager.transfer_infos[room][session]
            ret, deferred = self.manager._do_staging_transfer(
                self.strategy, chunk, request, target, None, None, requeue
            )
            if not deferred:
                if ret != 0:
                    raise RuntimeError(f"its staged transfer of room {room} failed: {ret}")
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"room {room} chunk at page {page_start} never became ready")

    def close(self) -> None:
        """Stop the thread and close its sockets (its prefetch sockets too)."""
        self._loop.stop()
        for socket in self._sockets.values():
            socket.close()
        for prefetch in self.manager._staging_ctx.prefetch_sockets.values():
            owner = prefetch.context  # each in a context of its own
            prefetch.close(linger=1000)
            owner.term()
        self.socket.close(linger=0)
        self._context.term()
