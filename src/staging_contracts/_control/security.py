"""Authentication of the control plane: a cluster secret, CURVE keys and a ZAP handler.

Every participant of a cluster (manager, bootstrap server, rank process) reads one shared
secret from the environment: ``STAGING_CONTRACTS_SECRET``, or the file named by
``STAGING_CONTRACTS_SECRET_FILE`` (never a command-line argument, which other users of the
machine can read). With it:

* each rank's control listener is a CURVE server with a key pair of its own (random, made at
  start-up); the public key is published through the bootstrap, which is itself authenticated;
* a listener accepts a connection only from a client whose CURVE public key is in its
  :class:`KeyDirectory` (the keys of the participants it learned from the bootstrap), through
  a ZAP handler (:func:`zap_handler`) that also counts the refused handshakes;
* each message then carries its sender's identity (the ``User-Id`` ZMQ sets from the key),
  which the listener maps to the sender's endpoint for authorisation per room;
* the bootstrap server and its clients use key pairs derived from the secret
  (:meth:`CurveKeys.derive`), so that only holders of the secret can query or register;
* arrivals (``CHUNK_READY`` and NIXL notifications) carry a MAC keyed per decode session from
  the secret (:class:`~staging_contracts._control.integrity.ArrivalKeys`, held by
  :attr:`ControlSecurity.arrival_keys`), which decode requires.

Without a secret the control plane runs unauthenticated, on loopback only
(:func:`check_insecure_bind`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

import zmq
from zmq.utils import z85

from .integrity import ArrivalKeys

__all__ = [
    "FROM_ENV",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "ControlSecurity",
    "CurveKeys",
    "KeyDirectory",
    "SecurityError",
    "ZapHandler",
    "check_insecure_bind",
    "load_cluster_secret",
    "resolve_secret",
    "zap_handler",
]

logger = logging.getLogger(__name__)

SECRET_ENV: Final = "STAGING_CONTRACTS_SECRET"
"""Environment variable holding the cluster secret."""
SECRET_FILE_ENV: Final = "STAGING_CONTRACTS_SECRET_FILE"
"""Environment variable naming a file that holds the cluster secret."""
FROM_ENV: Final = "env"
"""``secret=FROM_ENV``: read the cluster secret from the environment (the default)."""
MIN_SECRET_BYTES: Final = 16
"""Shortest secret accepted."""
_ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"


class SecurityError(RuntimeError):
    """The security set-up is wrong: a bad secret, or an insecure bind that was not allowed."""


def load_cluster_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The cluster secret from the environment, or ``None`` when none is set.

    Args:
        environ: the environment to read (default: ``os.environ``).

    Raises:
        SecurityError: both variables are set, the file cannot be read, or the secret is
            shorter than :data:`MIN_SECRET_BYTES` bytes (surrounding white space is dropped).
    """
    env = os.environ if environ is None else environ
    value, path = env.get(SECRET_ENV), env.get(SECRET_FILE_ENV)
    if value is not None and path is not None:
        raise SecurityError(f"set {SECRET_ENV} or {SECRET_FILE_ENV}, not both")
    if path is not None:
        try:
            with open(path, "rb") as handle:
                secret = handle.read().strip()
        except OSError as exc:
            raise SecurityError(f"{SECRET_FILE_ENV}={path!r} cannot be read: {exc}") from None
        source = f"the file named by {SECRET_FILE_ENV}"
    elif value is not None:
        secret, source = value.strip().encode(), SECRET_ENV
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise SecurityError(
            f"the cluster secret in {source} has {len(secret)} bytes; use at least "
            f"{MIN_SECRET_BYTES} (e.g. 32 random bytes, hex-encoded)"
        )
    return secret


def resolve_secret(secret: bytes | str | None) -> bytes | None:
    """``secret`` itself, or the environment's for :data:`FROM_ENV`.

    Raises:
        SecurityError: as :func:`load_cluster_secret`, or ``secret`` is another string.
    """
    if secret == FROM_ENV:
        return load_cluster_secret()
    if secret is None or isinstance(secret, bytes):
        return secret
    raise SecurityError(f"secret must be bytes, None or FROM_ENV, got {type(secret).__name__}")


def check_insecure_bind(host: str, *, allow_insecure: bool) -> None:
    """Refuse to bind a non-loopback address without a secret, unless explicitly allowed.

    Raises:
        SecurityError: ``host`` is not a loopback address and ``allow_insecure`` is false.
    """
    if allow_insecure or _is_loopback(host):
        return
    raise SecurityError(
        f"refusing to bind {host!r} without authentication: set {SECRET_ENV} (or "
        f"{SECRET_FILE_ENV}) on every participant, or pass allow_insecure=True to accept "
        "control messages from anyone who can reach the address"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """A CURVE key pair, both halves Z85-encoded (40 ASCII bytes each)."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        """A fresh random key pair."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def derive(cls, cluster_secret: bytes, label: str) -> CurveKeys:
        """The key pair every holder of ``cluster_secret`` derives alike for ``label``."""
        seed = hmac.new(cluster_secret, b"staging-contracts/" + label.encode(), hashlib.sha256)
        secret = z85.encode(seed.digest())
        return cls(zmq.curve_public(secret), secret)

    def serve(self, sock: zmq.Socket[bytes], domain: str) -> None:
        """Make ``sock`` a CURVE server with these keys, authenticated in ZAP ``domain``."""
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)

    def connect_to(self, sock: zmq.Socket[bytes], server_key: bytes) -> None:
        """Make ``sock`` a CURVE client with these keys, of the server with ``server_key``."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


class KeyDirectory:
    """The participants a rank trusts: CURVE public key <-> control endpoint.

    **Thread-safety:** any thread (the ZAP handler reads it on its own thread).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[bytes, str] = {}
        self._by_endpoint: dict[str, bytes] = {}

    def trust(self, public_key: bytes, endpoint: str) -> None:
        """Trust the participant with ``public_key``, whose listener is ``endpoint``.

        A participant that restarted on the same endpoint replaces its old key.
        """
        with self._lock:
            old = self._by_endpoint.get(endpoint)
            if old is not None and old != public_key:
                self._by_key.pop(old, None)
            self._by_key[public_key] = endpoint
            self._by_endpoint[endpoint] = public_key

    def endpoint_of(self, public_key: bytes) -> str | None:
        """The endpoint of a trusted key (``None``: not trusted)."""
        with self._lock:
            return self._by_key.get(public_key)

    def key_of(self, endpoint: str) -> bytes | None:
        """The public key of a trusted endpoint (``None``: unknown)."""
        with self._lock:
            return self._by_endpoint.get(endpoint)


class ZapHandler:
    """Answers ZMQ's authentication requests (ZAP) for the CURVE sockets of one context.

    Each CURVE server socket names a ZAP domain; the handler asks that domain's policy
    whether a client key may connect, and counts the refusals. Runs on a thread of its own,
    which survives every exception (a failed request is refused).
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._lock = threading.Lock()
        self._policies: dict[str, Callable[[bytes], bool]] = {}
        self._denied: dict[str, int] = {}
        self._socket = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(_ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="zap-handler", daemon=True)
        self._thread.start()

    def register(self, domain: str, allows: Callable[[bytes], bool]) -> None:
        """Let ``allows(z85_public_key)`` decide who may connect to sockets of ``domain``."""
        with self._lock:
            self._policies[domain] = allows
            self._denied.setdefault(domain, 0)

    def unregister(self, domain: str) -> None:
        """Forget a domain (its sockets then refuse everyone)."""
        with self._lock:
            self._policies.pop(domain, None)

    def denied(self, domain: str) -> int:
        """Handshakes refused so far in ``domain``."""
        with self._lock:
            return self._denied.get(domain, 0)

    def _decide(self, frames: list[bytes]) -> tuple[bool, bytes]:
        if len(frames) < 7 or frames[0] != b"1.0" or frames[5] != b"CURVE":
            return False, b""
        domain = frames[2].decode("ascii", "replace")
        key = z85.encode(frames[6]) if len(frames[6]) == 32 else b""
        with self._lock:
            policy = self._policies.get(domain)
        try:
            allowed = bool(key) and policy is not None and policy(key)
        except Exception:  # a policy bug refuses the client, never kills the handler
            logger.exception("ZAP policy of domain %r failed", domain)
            allowed = False
        if not allowed:
            with self._lock:
                self._denied[domain] = self._denied.get(domain, 0) + 1
        return allowed, key

    def _run(self) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart()
            except zmq.ContextTerminated:
                return
            except zmq.ZMQError:
                logger.exception("ZAP handler: receive failed")
                continue
            request_id = frames[1] if len(frames) > 1 else b""
            try:
                allowed, key = self._decide(frames)
            except Exception:  # a bad request is refused; the handler keeps serving
                logger.exception("ZAP handler: a request could not be decided")
                allowed, key = False, b""
            reply = [
                b"1.0",
                request_id,
                b"200" if allowed else b"400",
                b"OK" if allowed else b"unknown key",
                key if allowed else b"",
                b"",
            ]
            try:
                self._socket.send_multipart(reply)
            except zmq.ZMQError:
                logger.exception("ZAP handler: reply failed")


_handlers: dict[int, ZapHandler] = {}
_handlers_lock = threading.Lock()


def zap_handler(context: zmq.Context[zmq.Socket[bytes]] | None = None) -> ZapHandler:
    """The ZAP handler of ``context`` (default: the process-wide one), started on first use."""
    ctx = context or zmq.Context.instance()
    with _handlers_lock:
        handler = _handlers.get(id(ctx))
        if handler is None:
            handler = _handlers[id(ctx)] = ZapHandler(ctx)
        return handler


class ControlSecurity:
    """One participant's side of the authenticated control plane.

    Holds the participant's own CURVE keys (random) and the :class:`KeyDirectory` of the peers
    it trusts.

    Args:
        cluster_secret: the shared secret (see :func:`load_cluster_secret`).
        keys: this participant's key pair (default: a fresh one).
        context: the ZMQ context of its sockets (default: the process-wide one).
    """

    def __init__(
        self,
        cluster_secret: bytes,
        *,
        keys: CurveKeys | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.keys = keys or CurveKeys.generate()
        """This participant's key pair; its public half goes to the bootstrap."""
        self.directory = KeyDirectory()
        """The peers this participant trusts (learned from the bootstrap)."""
        self._context = context or zmq.Context.instance()
        self.arrival_keys = ArrivalKeys(cluster_secret)
        """The MAC keys of arrivals, derived from the secret (the secret is not kept)."""
        self.domain = f"staging-contracts-{id(self):x}"
        """The ZAP domain of this participant's listener."""

    def serve(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (a listener) accept only the trusted peers' keys."""
        self.keys.serve(sock, self.domain)
        zap_handler(self._context).register(
            self.domain, lambda key: self.directory.endpoint_of(key) is not None
        )

    def connect(self, sock: zmq.Socket[bytes], endpoint: str) -> bool:
        """Make ``sock`` a CURVE client of the trusted peer at ``endpoint``; ``False`` (and
        ``sock`` untouched) when no key is known for it."""
        server_key = self.directory.key_of(endpoint)
        if server_key is None:
            return False
        self.keys.connect_to(sock, server_key)
        return True

    def sender(self, user_id: str | None) -> str | None:
        """The endpoint of the peer a message came from, by its ZMQ ``User-Id`` (its key)."""
        return None if not user_id else self.directory.endpoint_of(user_id.encode("ascii"))

    @property
    def denied(self) -> int:
        """Connections to this participant's listener refused for an untrusted key."""
        return zap_handler(self._context).denied(self.domain)

    def close(self) -> None:
        """Stop accepting anyone on this participant's listener domain."""
        zap_handler(self._context).unregister(self.domain)
