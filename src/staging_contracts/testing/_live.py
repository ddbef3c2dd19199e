"""The kit's harness around a live decode manager: fake prefill peers, rooms, waits.

Everything the harness opens (ZMQ sockets, rooms on the handler) it closes or releases in
:meth:`LiveDecode.close`, and it closes the manager last.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Final, NoReturn

import pytest
import zmq

from .._control.room_messages import Ping, RoomFence
from .._control.wire import MalformedMessage, StagingRsp, decode_message
from .._decode.handler import DecodeStagingHandler
from .._decode.rooms import PrefillPeer, RoomPlan, RoomStatus
from .._staging.layout import compute_staging_layout, prefill_ranks_for_decode, validate_tp_pair
from ..protocols import DecodeStagingContext, KVBufferTensors
from ._decode_setup import LiveDecodeManager

_PEER_CONTROL: Final = frozenset({Ping.KIND, RoomFence.KIND})
"""Peer messages a decode manager may send a prefill peer besides the staging messages."""

WAIT_S: Final = 5.0
"""How long the kit waits, by default, for the listener thread to act on a message."""
_POLL_S: Final = 0.002
_MAX_WRITERS_SEARCHED: Final = 8


def kit_fail(message: str) -> NoReturn:
    """Fail the running kit test with ``message`` (no traceback of the kit itself)."""
    pytest.fail(message, pytrace=False)


class FakePrefill:
    """A PULL socket standing in for a prefill rank's control listener.

    Args:
        context: the ZMQ context to open the socket in.
        wait_s: how long :meth:`answers` waits by default.
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], wait_s: float = WAIT_S) -> None:
        self._wait_s = wait_s
        self._socket: zmq.Socket[bytes] = context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind("tcp://127.0.0.1:*")
        except zmq.ZMQError:
            self._socket.close(linger=0)
            raise
        last = self._socket.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint: str = last.decode() if isinstance(last, bytes) else str(last)
        """``tcp://127.0.0.1:port`` to register as the peer's endpoint."""

    def answers(self, count: int, timeout: float | None = None) -> list[StagingRsp]:
        """Receive ``count`` ``STAGING_RSP`` messages (``WATERMARK`` messages are skipped).

        Returns:
            The answers received before ``timeout`` (default: the peer's ``wait_s``), possibly
            fewer than ``count``.
        """
        out: list[StagingRsp] = []
        deadline = time.monotonic() + (self._wait_s if timeout is None else timeout)
        while len(out) < count:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or self._socket.poll(remaining_ms) == 0:
                break
            frames = self._socket.recv_multipart()
            if frames and frames[0] in _PEER_CONTROL:
                continue  # liveness and fencing, not the staging messages under test
            try:
                message = decode_message(frames)
            except MalformedMessage as exc:
                kit_fail(f"the decode manager sent a malformed message to a prefill peer: {exc}")
            if isinstance(message, StagingRsp):
                out.append(message)
        return out

    def close(self) -> None:
        """Close the socket."""
        self._socket.close(linger=0)


class LiveDecode:
    """A started decode manager under test, with what the kit opened around it.

    Args:
        manager: what the factory returned.
        wait_s: how long to wait for the listener thread to act on a message.

    Raises:
        pytest.fail.Exception: the manager lacks what the kit needs (the message says what).
    """

    def __init__(self, manager: LiveDecodeManager, *, wait_s: float = WAIT_S) -> None:
        self.manager: Final = manager
        self.wait_s: Final = wait_s
        name = type(manager).__name__
        handler = manager._staging_handler
        if not isinstance(handler, DecodeStagingHandler):
            kit_fail(
                f"{name}._staging_handler is {type(handler).__name__}, the kit needs the "
                "DecodeStagingHandler attached by enable_decode_staging (call "
                "setup.start(manager) or setup.enable_staging(manager) in make_decode_manager)"
            )
        context = manager._staging_ctx
        if not isinstance(context, DecodeStagingContext):
            kit_fail(
                f"{name}._staging_ctx is {type(context).__name__}, the kit needs a "
                "DecodeStagingContext (enable_decode_staging sets it)"
            )
        pool = getattr(manager, "kv_buffer_tensors", None)
        if not isinstance(pool, KVBufferTensors):
            kit_fail(
                f"{name}.kv_buffer_tensors is {type(pool).__name__}, the kit needs the decode "
                "KV pool (enable_decode_staging sets it)"
            )
        self.handler: Final = handler
        self.context: Final = context
        self.pool: Final = pool
        self._zmq: Final[zmq.Context[zmq.Socket[bytes]]] = zmq.Context.instance()
        self._push: zmq.Socket[bytes] | None = None
        self._peers: list[FakePrefill] = []
        self._rooms: list[int] = []

    # ------------------------------------------------------------------ geometry

    @property
    def session_id(self) -> str:
        """The decode session id that STAGING_REQ and CHUNK_READY name."""
        return self.handler.session_id

    @property
    def decode_tp(self) -> int:
        """Attention TP size of the decode side."""
        return self.manager.attn_tp_size

    @property
    def decode_rank(self) -> int:
        """This decode rank."""
        return self.manager.kv_args.engine_rank

    @property
    def total_heads(self) -> int:
        """KV heads of the whole model."""
        return self.manager.kv_args.total_kv_head_num

    @property
    def pool_pages(self) -> int:
        """Pages in the decode KV pool."""
        return int(self.pool.k_buffers[0].shape[0]) // self.pool.page_size

    @property
    def ring_bytes(self) -> int:
        """Size of the decode staging ring."""
        return self.context.allocator.total_size

    def region_bytes(self, prefill_tp: int, num_pages: int) -> int:
        """Bytes of the ring region of a chunk of ``num_pages`` from a prefill side of TP."""
        k = self.pool.k_buffers[0]
        return compute_staging_layout(
            prefill_tp,
            self.decode_tp,
            self.decode_rank,
            self.total_heads,
            num_pages * self.pool.page_size,
            int(k.shape[2]) * k.element_size(),
            self.pool.num_layers,
        ).total_bytes

    def writers(self, prefill_tp: int) -> range:
        """The prefill ranks that write into this decode rank's regions."""
        return prefill_ranks_for_decode(prefill_tp, self.decode_tp, self.decode_rank)

    def multi_writer_prefill_tp(self) -> int:
        """The smallest prefill TP size with at least two writers per chunk of this rank."""
        for k in range(2, _MAX_WRITERS_SEARCHED + 1):
            prefill_tp = k * self.decode_tp
            try:
                validate_tp_pair(prefill_tp, self.decode_tp, self.total_heads)
            except ValueError:
                continue
            return prefill_tp
        kit_fail(
            f"no prefill TP size gives two writers per chunk for decode TP {self.decode_tp} "
            f"with {self.total_heads} KV heads; use the kit's DecodeSetup (2 heads, TP 1)"
        )

    # ------------------------------------------------------------------ peers and rooms

    def prefill_peer(self) -> FakePrefill:
        """A new fake prefill listener (closed by :meth:`close`)."""
        peer = FakePrefill(self._zmq, self.wait_s)
        self._peers.append(peer)
        return peer

    def register(
        self,
        room: int,
        pages: Sequence[int],
        chunk_pages: int,
        prefill_tp: int,
        peers: Sequence[FakePrefill],
    ) -> RoomStatus:
        """Register a room whose writers are ``peers`` (in writer order); released at close."""
        writer_ranks = self.writers(prefill_tp)
        plan = RoomPlan(
            room,
            tuple(pages),
            chunk_pages,
            prefill_tp,
            tuple(
                PrefillPeer(rank, peer.endpoint)
                for rank, peer in zip(writer_ranks, peers, strict=True)
            ),
        )
        self._rooms.append(room)
        return self.handler.register_room(plan)

    def send(self, frames: Sequence[bytes]) -> None:
        """Send one message to the manager's control listener, as a prefill rank does."""
        if self._push is None:
            push: zmq.Socket[bytes] = self._zmq.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(self.manager.endpoint)
            self._push = push
        self._push.send_multipart(list(frames))

    @property
    def listener_hint(self) -> str:
        """What to check when a message sent to the listener seems to go nowhere."""
        return (
            "is the listener started, and does "
            f"{type(self.manager).__name__}._on_message hand staging messages to "
            "self._dispatch_staging?"
        )

    def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        """Poll ``predicate`` until it holds; fail the test, saying ``what``, after a while."""
        self.wait_until(predicate, lambda: what)

    def wait_until(self, predicate: Callable[[], bool], describe: Callable[[], str]) -> None:
        """Like :meth:`wait_for`, with the failure text built when the wait times out."""
        deadline = time.monotonic() + self.wait_s
        while not predicate():
            if time.monotonic() > deadline:
                kit_fail(f"after {self.wait_s:g}s, {describe()}")
            time.sleep(_POLL_S)

    def close(self) -> None:
        """Release the kit's rooms, close its sockets, then close the manager."""
        try:
            for room in self._rooms:
                self.handler.release_room(room)
        finally:
            if self._push is not None:
                self._push.close(linger=0)
            for peer in self._peers:
                peer.close()
            self.manager.close()
