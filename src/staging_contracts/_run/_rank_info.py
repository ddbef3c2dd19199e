"""What a rank tells its peers when it starts: :class:`RankInfo`, and how it is read back.

A rank publishes one :class:`RankInfo` (its control endpoint, engine session and metadata, on
decode its staging ring, with a cluster secret its CURVE key) to whoever wires the ranks: the
bootstrap server of ``cluster`` (as JSON, :meth:`RankInfo.to_json` and
:meth:`RankInfo.from_json`, every field checked) or the harness's parent process (pickled).
The field readers here (:func:`show`, :func:`int_field`, :func:`str_field`) also check the
bootstrap's requests.

**Thread:** any; values are immutable.
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass
from typing import Any, Final

MAX_RANKS: Final = 1 << 16
"""Bound (exclusive) on a rank's ``tp_rank``; also on a bootstrap query's ``count`` and a
barrier's ``wait_for`` (inclusive)."""
MAX_NAME_CHARS: Final = 256
"""Longest role, barrier, party, endpoint or session id, in characters."""
MAX_POOL_POINTERS: Final = 4096
"""Most KV pool addresses a rank may publish (2 per layer)."""
MAX_METADATA_CHARS: Final = 1 << 20
"""Longest engine metadata (base64 text) a rank info carries: a registration must fit the
bootstrap server's 1 MiB request bound."""
ROLES: Final = ("prefill", "decode")
_MAX_ADDRESS: Final = 2**64 - 1
_CURVE_KEY_CHARS: Final = 40
_SHOW_CHARS: Final = 40


def curve_key_text(key: bytes | None) -> str:
    """A CURVE public key as :class:`RankInfo` carries it (empty without a cluster secret)."""
    return "" if key is None else key.decode("ascii")


def show(value: object) -> str:
    """A short, safe rendering of a JSON value for an error text (never recursive)."""
    if isinstance(value, str):
        return repr(value[:_SHOW_CHARS]) + ("..." if len(value) > _SHOW_CHARS else "")
    if value is None or isinstance(value, bool | float):
        return repr(value)
    if isinstance(value, int):
        return str(value) if abs(value) < 10**20 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def int_field(doc: dict[str, Any], key: str, low: int, high: int, default: int | None) -> int:
    """``doc[key]``, an integer (not a bool) in ``[low, high]``; ``default`` if absent."""
    if key not in doc:
        if default is None:
            raise ValueError(f"missing field {key!r}")
        return default
    value = doc[key]
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{key} must be an integer in [{low}, {high}], got {show(value)}")
    return value


def str_field(doc: dict[str, Any], key: str) -> str:
    """``doc[key]``, a string of 1 to ``MAX_NAME_CHARS`` characters."""
    if key not in doc:
        raise ValueError(f"missing field {key!r}")
    value = doc[key]
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
        raise ValueError(
            f"{key} must be a string of 1-{MAX_NAME_CHARS} characters, got {show(value)}"
        )
    return value


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What a rank tells its peers at bootstrap."""

    role: str
    """``"prefill"`` or ``"decode"``."""
    tp_rank: int
    """Attention-TP rank."""
    endpoint: str
    """Control listener (``tcp://host:port``)."""
    session_id: str
    """Engine session id (Mooncake ``host:port``, NIXL agent name)."""
    metadata: bytes
    """Engine metadata a peer passes to ``add_peer``."""
    ring_base: int = 0
    """Decode: address of the staging ring."""
    ring_size: int = 0
    """Decode: bytes of the staging ring."""
    curve_key: str = ""
    """The rank's CURVE public key (Z85 text) when the cluster secret is set, else empty:
    peers trust the rank's listener by it."""
    pool_ptrs: tuple[int, ...] = ()
    """Decode, per-token mode (``TransferConfig.mode``): the address of each of its KV pool
    tensors, registered with its engine, K of layers ``0..L-1`` then V (at most
    :data:`MAX_POOL_POINTERS`); empty otherwise."""

    def to_json(self) -> dict[str, Any]:
        """As a JSON-ready dict (metadata base64-encoded)."""
        doc = asdict(self)
        doc["metadata"] = base64.b64encode(self.metadata).decode()
        return doc

    @classmethod
    def from_json(cls, doc: object) -> RankInfo:
        """Parse a dict made by :meth:`to_json`, checking every field's type and bounds.

        **Called by:** the bootstrap server (registrations) and :func:`query_ranks` (answers).

        Raises:
            ValueError: not an object, a missing field, a field of the wrong type, or out of
                bounds (``tp_rank`` in ``[0, MAX_RANKS)``, ring fields in ``[0, 2**64)``,
                strings of at most ``MAX_NAME_CHARS``, metadata base64).
        """
        if not isinstance(doc, dict):
            raise ValueError("rank info must be an object")
        try:
            role, tp_rank = doc["role"], doc["tp_rank"]
            endpoint, session_id = doc["endpoint"], doc["session_id"]
            metadata = doc["metadata"]
        except KeyError as exc:
            raise ValueError(f"bad rank info: {exc}") from None
        if role not in ROLES or type(tp_rank) is not int or not 0 <= tp_rank < MAX_RANKS:
            raise ValueError(f"bad rank info: role {show(role)}, rank {show(tp_rank)}")
        try:
            endpoint = str_field(doc, "endpoint")
            session_id = str_field(doc, "session_id")
            ring_base = int_field(doc, "ring_base", 0, _MAX_ADDRESS, 0)
            ring_size = int_field(doc, "ring_size", 0, _MAX_ADDRESS, 0)
            pool_ptrs = pointers(doc.get("pool_ptrs", []))
            curve_key = doc.get("curve_key", "")
            if not isinstance(curve_key, str) or not (
                curve_key == "" or (len(curve_key) == _CURVE_KEY_CHARS and curve_key.isascii())
            ):
                raise ValueError(f"curve_key must be 40 Z85 characters, got {show(curve_key)}")
            if not isinstance(metadata, str) or len(metadata) > MAX_METADATA_CHARS:
                raise ValueError(f"metadata must be a base64 string, got {show(metadata)}")
            try:
                raw = base64.b64decode(metadata, validate=True)
            except ValueError:
                raise ValueError(f"metadata is not base64: {show(metadata)}") from None
        except ValueError as exc:
            raise ValueError(f"bad rank info: {exc}") from None
        return cls(
            str(role),
            tp_rank,
            endpoint,
            session_id,
            raw,
            ring_base,
            ring_size,
            curve_key,
            pool_ptrs,
        )


def pointers(value: object) -> tuple[int, ...]:
    """A list of at most ``MAX_POOL_POINTERS`` addresses (integers in ``[0, 2**64)``)."""
    if not isinstance(value, list | tuple) or len(value) > MAX_POOL_POINTERS:
        raise ValueError(f"pool_ptrs must be a list of at most {MAX_POOL_POINTERS} addresses")
    if not all(type(v) is int and 0 <= v <= _MAX_ADDRESS for v in value):
        raise ValueError(f"pool_ptrs must hold integers in [0, {_MAX_ADDRESS}]")
    return tuple(value)
