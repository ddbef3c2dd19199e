"""``CommonKVManager``: what every KV-transfer backend has, staging or not.

KV arguments, attention TP and PP sizes, a transfer engine, the control listener (a thread
draining a PULL socket on loopback) and non-blocking PUSH sockets to peers. It knows no
staging: a backend adds staging by mixing in ``StagingManagerMixin`` *before* this class
(``class MooncakeKVManager(StagingManagerMixin, CommonKVManager)``), and a backend without
staging support (Mori) uses it alone.

**Authentication.** When the cluster secret is set (``STAGING_CONTRACTS_SECRET`` or
``STAGING_CONTRACTS_SECRET_FILE``, see :mod:`~staging_contracts._control.security`), the listener
is a CURVE server that accepts only the peers trusted with :meth:`CommonKVManager.trust_peer`
(their keys come from the authenticated bootstrap), every message to a peer is encrypted to it,
and each message is handed on only if every authoriser registered with
:meth:`CommonKVManager.add_authorizer` accepts its sender (the staging set-up registers the
per-room rules); the rest are dropped and counted in ``unauthorized``. Without a secret the
control plane is unauthenticated and binds loopback only (``allow_insecure=True`` opts out,
named as such); that is logged once per process.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from typing import overload

from .._control.liveness import PeerLiveness
from .._control.room_messages import Ping, Pong
from .._control.security import (
    FROM_ENV,
    ControlSecurity,
    SecurityError,
    check_insecure_bind,
    resolve_secret,
)
from .._control.transport import Listener, LogThrottle, PeerSockets
from .._control.wire import MESSAGE_TYPES, MalformedMessage
from ..protocols import KVArgs, TransferEngine
from ._drain import DrainGate, DrainResult, check_drain_s
from ._health import ManagerHealth

__all__ = ["CommonKVManager", "Role"]

logger = logging.getLogger(__name__)

Authorizer = Callable[[list[bytes], str], bool]
"""``(frames, sender_endpoint) -> allowed``: may this authenticated peer send this message?"""

_insecure_noted = False


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
        secret: the cluster secret; :data:`FROM_ENV` (the default) reads it from the
            environment, ``None`` runs unauthenticated.
        allow_insecure: bind a non-loopback ``host`` even without a secret.

    Raises:
        ValueError: a size is not positive.
        SecurityError: the secret in the environment is unusable, or ``host`` is not
            loopback and there is no secret and ``allow_insecure`` is false.
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
        secret: bytes | str | None = FROM_ENV,
        allow_insecure: bool = False,
    ) -> None:
        if attn_tp_size < 1 or pp_size < 1:
            raise ValueError(f"attn_tp_size={attn_tp_size} and pp_size={pp_size} must be >= 1")
        cluster_secret = resolve_secret(secret)
        if cluster_secret is not None:
            self.security: ControlSecurity | None = ControlSecurity(cluster_secret)
            """CURVE keys and trusted peers (``None``: unauthenticated, loopback only)."""
        else:
            check_insecure_bind(host, allow_insecure=allow_insecure)
            self.security = None
            _note_insecure()
        self.kv_args = kv_args
        self.attn_tp_size = attn_tp_size
        self.pp_size = pp_size
        self.role = role
        self.engine = engine
        self.peers = PeerSockets(security=self.security)
        self.listener = Listener(
            self._receive,
            name=f"{type(self).__name__}-{role.value}-{kv_args.engine_rank}",
            host=host,
            idle=self._on_idle,
            poll_interval_s=poll_interval_s,
            security=self.security,
        )
        self._control: dict[bytes, Callable[[list[bytes]], None]] = {}
        self._kinds: dict[bytes, int] = dict.fromkeys(MESSAGE_TYPES, 0)
        """Authorised messages per known frame-0 type (listener thread only; see
        :meth:`control_counts`)."""
        self._other_kinds = 0
        self._authorizers: list[Authorizer] = []
        self._unauthorized_log = LogThrottle(logger, f"{self.listener.endpoint}: unauthorized")
        self.unauthorized = 0
        """Messages from authenticated peers that an authoriser refused (dropped)."""
        self._closed = False
        self.liveness = PeerLiveness(
            self.peers,
            self.listener.endpoint,
            identity=None if self.security is None else self.message_sender,
        )
        """Which peers are alive (``PING``/``PONG``, counted by the authenticated sender with a
        secret; ticked by the staging idle hook)."""
        self.drain_gate = DrainGate()
        """The books of this manager's rooms, and whether it drains (see :meth:`close`)."""
        self.register_control(Ping.KIND, self.liveness.on_ping)
        self.register_control(Pong.KIND, self.liveness.on_pong)

    def message_sender(self) -> str | None:
        """The authenticated sender (its endpoint) of the message being dispatched; ``None``
        without a secret. **Called by:** control handlers, on the listener thread."""
        return self.listener.sender

    @property
    def endpoint(self) -> str:
        """The control listener's ``tcp://host:port``, for peers to send to."""
        return self.listener.endpoint

    @property
    def curve_key(self) -> bytes | None:
        """This manager's CURVE public key, to publish at bootstrap (``None``: no secret)."""
        return None if self.security is None else self.security.keys.public

    def trust_peer(self, endpoint: str, curve_key: bytes | None) -> None:
        """Accept messages from, and encrypt messages to, the peer at ``endpoint``.

        **Called by:** the bootstrap wiring, for each peer learned from the bootstrap.
        Without a secret it does nothing.

        Raises:
            SecurityError: there is a secret but the peer published no key.
        """
        if self.security is None:
            return
        if not curve_key:
            raise SecurityError(f"peer {endpoint} published no CURVE key, but a secret is set")
        self.security.directory.trust(curve_key, endpoint)

    def add_authorizer(self, authorizer: Authorizer) -> None:
        """Hand a message on only if ``authorizer(frames, sender)`` accepts it (with a secret).

        **Called by:** the staging set-up, before the listener starts.
        """
        self._authorizers.append(authorizer)

    def _receive(self, frames: list[bytes]) -> None:
        """The listener's dispatch: authorise (with a secret), then :meth:`_on_message`."""
        if self._authorized(frames):
            if frames and frames[0] in self._kinds:
                self._kinds[frames[0]] += 1
            else:
                self._other_kinds += 1
            self._on_message(frames)

    def _authorized(self, frames: list[bytes]) -> bool:
        if self.security is None:
            return True
        sender = self.listener.sender
        if sender is not None and all(allows(frames, sender) for allows in self._authorizers):
            return True
        self.unauthorized += 1
        if self._unauthorized_log.admit():
            kind = bytes(frames[0][:32]) if frames else b""
            logger.warning("%r from %s not authorized for it: dropped", kind, sender)
        return False

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
        self._kinds.setdefault(kind, 0)

    def control_counts(self) -> dict[str, int]:
        """Authorised messages the listener handed on, per frame-0 type (the staging types
        and every registered one; any other type counts as ``"other"``).

        **Called by:** monitoring, any thread (read without locking: only the listener thread
        counts, so each value is current or slightly stale).
        """
        counts = {kind.decode("ascii", "replace"): n for kind, n in dict(self._kinds).items()}
        counts["other"] = self._other_kinds
        return counts

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

    def health(self) -> ManagerHealth:
        """A snapshot of this manager's state: listener, peers, ring, rooms, drain.

        **Side:** either. **Called by:** anyone, any thread (a monitor, a readiness probe),
        also after ``close``. **Blocking:** no (each part's lock, briefly).
        """
        # Decode's ring, read by name: this base knows no staging (the handler's allocator).
        ring = getattr(getattr(self, "_staging_handler", None), "allocator", None)
        reserved = getattr(ring, "live_bytes", None)
        capacity = getattr(ring, "total_size", None)
        return ManagerHealth(
            role=self.role.value,
            endpoint=self.listener.endpoint,
            listener_alive=self.listener.alive,
            closed=self._closed,
            draining=self.drain_gate.draining,
            peers=self.liveness.watched,
            dead_peers=self.liveness.dead & self.liveness.watched,
            rooms_in_flight=self.drain_gate.rooms_in_flight(),
            ring_reserved_bytes=reserved if isinstance(reserved, int) else None,
            ring_capacity_bytes=capacity if isinstance(capacity, int) else None,
        )

    @overload
    def close(self) -> None: ...
    @overload
    def close(self, drain_s: float) -> DrainResult: ...
    def close(self, drain_s: float | None = None) -> DrainResult | None:
        """Stop the listener, close the sockets and the engine; safe to call twice.

        With ``drain_s``, drain first (:class:`~staging_contracts.backends._drain.DrainGate`):
        new rooms are refused at once (reason *draining*), the rooms in flight get up to
        ``drain_s`` seconds to end on their own, those still running then are failed (reason
        *draining*), and only then does the manager close. A second call finds it closed
        and drains nothing (an empty result).

        **Side:** either. **Called by:** the scheduler thread (never the listener's).
        **Blocking:** up to ``drain_s``, then until the listener stopped (bounded).

        Returns:
            With ``drain_s``: what the drain did (:class:`DrainResult`); else ``None``.

        Raises:
            ValueError: ``drain_s`` is negative or not finite (nothing is closed).
        """
        result: DrainResult | None = None
        if drain_s is not None:
            check_drain_s(drain_s)
            if self._closed:
                return DrainResult(drain_s, 0.0)
            result = self.drain_gate.drain(drain_s)
        if self._closed:
            return result
        self._closed = True
        self.listener.stop()
        self.peers.close()
        if self.security is not None:
            self.security.close()
        self.engine.close()
        return result


def _note_insecure() -> None:
    global _insecure_noted  # noqa: PLW0603 - once per process
    if not _insecure_noted:
        _insecure_noted = True
        logger.warning(
            "no cluster secret (STAGING_CONTRACTS_SECRET): the control plane is "
            "unauthenticated and binds loopback only"
        )
