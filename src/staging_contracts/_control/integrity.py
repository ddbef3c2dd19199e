"""Integrity tags of staged chunks and the MAC that authenticates an arrival (scheme v1).

**What a tag binds.** Each writer tags the bytes it staged for one chunk of one decode rank:
the **digest** is xxHash's XXH3-64 over a binding of the chunk's identity (room, chunk_idx,
page_start, num_pages, decode session, writer rank and the region's epoch, its ring round)
followed by the staged bytes, so the same bytes under another identity give another digest.
With a cluster secret the tag also carries a **MAC**: HMAC-SHA256, cut to 128 bits, over the
same binding and the digest, keyed per decode session (:class:`ArrivalKeys`: derived from the
secret and the session id). On the wire the tag is one ``CHUNK_READY`` frame (or notification
field), ``<digest>[:<mac>]``: 16 lowercase hex digits, or ``-`` when the writer computed no
digest (integrity off), then ``:`` and 32 hex digits when there is a secret.

**Who checks what.** Decode checks the MAC when the arrival comes in (before it counts:
an arrival without a valid MAC is dropped and counted as unauthorized), and the digest after
the bytes landed and were scattered, over the region's bytes of that writer, before the
region is freed: a mismatch fails the room with a reason starting ``integrity``.

**Configuration.** :data:`INTEGRITY_ENV` (``STAGING_CONTRACTS_INTEGRITY``): ``1``/``on`` or
``0``/``off``; unset means :data:`DEFAULT_INTEGRITY`. Writers then compute digests, and
decode checks the digests it is sent. The MAC does not depend on it: it is on whenever the
cluster secret is set.

Pure functions and small records; no torch (callers hand over the staged bytes as a buffer).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Mapping
from typing import Final, NamedTuple

import xxhash

from .. import config

__all__ = [
    "DEFAULT_INTEGRITY",
    "INTEGRITY_ENV",
    "INTEGRITY_FAILURE",
    "ArrivalKeys",
    "ChunkIdentity",
    "Tag",
    "chunk_digest",
    "integrity_enabled",
    "make_tag",
    "parse_tag",
]

INTEGRITY_ENV: Final = config.INTEGRITY.name
"""Environment variable that turns the integrity digests on (``1``, ``on``, ``true``) or off
(``0``, ``off``, ``false``)."""

DEFAULT_INTEGRITY: Final = config.INTEGRITY.default
"""Whether digests are computed and checked when :data:`INTEGRITY_ENV` is unset: off, since
they cost about 30 % of a staged transfer at memory speed, more than the 10 % that would make
them the default (``staging.integrity.transfer.*`` rows of ``staging-contracts bench staging``;
docs/security.md, "Integrity")."""

INTEGRITY_FAILURE: Final = "integrity"
"""The first word of the failure reason of a room whose staged bytes did not match a tag."""

_VERSION: Final = b"staging-contracts/chunk/v1"
_NO_DIGEST: Final = "-"


def integrity_enabled(value: bool | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """``value`` itself, or the environment's setting when ``None`` (see the module).

    Raises:
        ConfigError: :data:`INTEGRITY_ENV` holds something else than the words above (a
            ``ValueError``).
    """
    return config.INTEGRITY.value(value, environ)


class ChunkIdentity(NamedTuple):
    """What a tag is bound to: one writer's part of one chunk region of one decode rank."""

    room: int
    chunk_idx: int
    page_start: int
    num_pages: int
    session_id: str
    """The decode session written to."""
    writer_rank: int
    epoch: int
    """The region's epoch (its ring round, as ``STAGING_RSP`` gave it)."""

    def binding(self) -> bytes:
        """The identity as the bytes every digest and MAC starts with."""
        fields = (
            b"%d" % self.room,
            b"%d" % self.chunk_idx,
            b"%d" % self.page_start,
            b"%d" % self.num_pages,
            self.session_id.encode("ascii"),
            b"%d" % self.writer_rank,
            b"%d" % self.epoch,
        )
        return b"\x00".join((_VERSION, *fields)) + b"\x00"


class Tag(NamedTuple):
    """A parsed tag: its digest (``None``: the writer computed none) and MAC (``None``: no
    secret)."""

    digest: str | None
    mac: str | None


def chunk_digest(identity: ChunkIdentity, staged: memoryview | bytes) -> str:
    """The digest of ``staged`` (a writer's staged bytes) under ``identity``: 16 hex digits.

    **Thread-safety:** pure; releases nothing it does not own. **Blocking:** for the hash.
    """
    hasher = xxhash.xxh3_64(identity.binding())
    hasher.update(staged)
    return hasher.hexdigest()


class ArrivalKeys:
    """The MAC keys of arrivals, one per decode session, derived from the cluster secret.

    The secret itself is not kept: only ``HMAC-SHA256(secret, "staging-contracts/arrival")``,
    from which each session's key is ``HMAC-SHA256(root, session_id)``.

    **Thread-safety:** any thread.
    """

    def __init__(self, cluster_secret: bytes) -> None:
        self._root = hmac.new(cluster_secret, b"staging-contracts/arrival", hashlib.sha256).digest()
        self._lock = threading.Lock()
        self._keys: dict[str, bytes] = {}

    def __repr__(self) -> str:
        return "ArrivalKeys(<derived>)"

    def key(self, session_id: str) -> bytes:
        """The MAC key of arrivals into decode session ``session_id`` (cached)."""
        with self._lock:
            key = self._keys.get(session_id)
            if key is None:
                if len(self._keys) >= 4096:  # sessions of peers come and go: stay bounded
                    self._keys.clear()
                key = hmac.new(self._root, session_id.encode("ascii"), hashlib.sha256).digest()
                self._keys[session_id] = key
            return key

    def mac(self, identity: ChunkIdentity, digest: str | None) -> str:
        """The MAC of an arrival of ``identity`` carrying ``digest``: 32 hex digits."""
        message = identity.binding() + (digest or _NO_DIGEST).encode("ascii")
        return hmac.new(self.key(identity.session_id), message, hashlib.sha256).hexdigest()[:32]

    def authentic(self, identity: ChunkIdentity, tag: str | None) -> bool:
        """Whether ``tag`` carries a valid MAC of ``identity`` (``False`` without one)."""
        parsed = parse_tag(tag)
        if parsed is None or parsed.mac is None:
            return False
        return hmac.compare_digest(self.mac(identity, parsed.digest), parsed.mac)


def make_tag(identity: ChunkIdentity, digest: str | None, keys: ArrivalKeys | None) -> str | None:
    """The wire tag of an arrival: ``digest`` (``-`` when ``None``), then ``:`` and the MAC
    when ``keys`` are given; ``None`` when there is neither."""
    if keys is None:
        return digest
    return f"{digest or _NO_DIGEST}:{keys.mac(identity, digest)}"


def parse_tag(tag: str | None) -> Tag | None:
    """Split a wire tag (validated by the codec) into digest and MAC; ``None`` for none."""
    if tag is None:
        return None
    digest, _, mac = tag.partition(":")
    return Tag(None if digest == _NO_DIGEST else digest, mac or None)
