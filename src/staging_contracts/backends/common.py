"""``CommonKVManager``: what every KV-transfer backend has, staging or not.

KV arguments, attention TP and PP sizes, a transfer engine, the control listener (a thread
draining a PULL socket on loopback) and non-blocking PUSH sockets to peers. It knows no
staging: a backend adds staging by mixing in ``StagingManagerMixin`` *before* this class
(``class MooncakeKVManager(StagingManagerMixin, CommonKVManager)``), and a backend without
staging support (Mori) uses it alone.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence

from ..control.liveness import PeerLiveness
from ..control.room_messages import Ping, Pong
from ..control.transport import Listener, PeerSockets
from ..control.wire import MalformedMessage
from ..protocols import KVArgs, TransferEngine

__all__ = ["CommonKVManager", "Role"]

logger = logging.getLogger(__name__)


class Role(enum.Enum):
    """Which side of the disaggregated deployment a manager serves."""

    PREFILL = "prefill"
    DECODE = "decode"


class CommonKVManager:
    """Shared base of the KV managers: arguments, sizes, engine, listener and peer sockets.

    **Thread-safety:** construction and ``close`` on the scheduler thread; ``_on_message``
    and ``_on_idle`` run on the listener thread.

    Args:
        kv_args: this rank's KV arguments.
        role: prefill or decode.
        attn_tp_size: attention TP size of this side.
        engine: the transfer engine (owned: closed with the manager).
        pp_size: pipeline-parallel size of this side.
        host: address the control listener binds (loopback by default).
        poll_interval_s: longest wait of the listener before its idle work runs.

    Raises:
        ValueError: a size is not positive.
    """

    kv_args: KVArgs
    """This rank's KV arguments."""
    attn_tp_size: int
    """Attention tensor-parallel size of this side."""
    pp_size: int
    """Pipeline-parallel size of this side."""

    def __init__(
        self,
        kv_args: KVArgs,
        *,
        role: Role,
        attn_tp_size: int,
        engine: TransferEngine,
        pp_size: int = 1,
        host: str = "127.0.0.1",
        poll_interval_s: float = 0.002,
    ) -> None:
        if attn_tp_size < 1 or pp_size < 1:
            raise ValueError(f"attn_tp_size={attn_tp_size} and pp_size={pp_size} must be >= 1")
        self.kv_args = kv_args
        self.attn_tp_size = attn_tp_size
        self.pp_size = pp_size
        self.role = role
        self.engine = engine
        self.peers = PeerSockets()
        self.listener = Listener(
            self._on_message,
            name=f"{type(self).__name__}-{role.value}-{kv_args.engine_rank}",
            host=host,
            idle=self._on_idle,
            poll_interval_s=poll_interval_s,
        )
        self._control: dict[bytes, Callable[[list[bytes]], None]] = {}
        self._closed = False
        self.liveness = PeerLiveness(self.peers, self.listener.endpoint)
        """Which peers are alive (``PING``/``PONG``; ticked by the staging idle hook)."""
        self.register_control(Ping.KIND, self.liveness.on_ping)
        self.register_control(Pong.KIND, self.liveness.on_pong)

    @property
    def endpoint(self) -> str:
        """The control listener's ``tcp://host:port``, for peers to send to."""
        return self.listener.endpoint

    def start(self) -> None:
        """Start the listener thread."""
        self.listener.start()

    def register_control(self, kind: bytes, handler: Callable[[list[bytes]], None]) -> None:
        """Route control messages whose frame 0 is ``kind`` to ``handler`` (listener thread).

        **Called by:** the per-request layer, before the listener starts.

        Raises:
            ValueError: ``kind`` already has a handler.
        """
        if kind in self._control:
            raise ValueError(f"control message {kind!r} already has a handler")
        self._control[kind] = handler

    def _on_message(self, frames: list[bytes]) -> None:
        """Handle one control message on the listener thread, by its registered type.

        Raises:
            MalformedMessage: no handler for the message's type (or the handler rejected it).
        """
        kind = bytes(frames[0][:32]) if frames else b""
        handler = self._control.get(kind)
        if handler is None:
            raise MalformedMessage(f"{type(self).__name__} handles no message of type {kind!r}")
        handler(frames)

    def _on_idle(self) -> None:
        """Periodic work on the listener thread (nothing in the base)."""

    def send(self, endpoint: str, frames: Sequence[bytes]) -> bool:
        """Send a control message to a peer without blocking; ``False`` if dropped."""
        return self.peers.send(endpoint, frames)

    def close(self) -> None:
        """Stop the listener, close the sockets and the engine; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.listener.stop()
        self.peers.close()
        self.engine.close()
