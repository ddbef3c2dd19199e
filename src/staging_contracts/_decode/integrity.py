"""Decode: authenticating arrivals and checking the staged bytes against their tags.

:class:`ArrivalVerifier` is what :class:`~staging_contracts._decode.handler.DecodeStagingHandler`
asks (scheme of :mod:`~staging_contracts._control.integrity`):

* **authentic** (listener thread, before an arrival counts): with a cluster secret, an arrival
  (``CHUNK_READY`` or NIXL notification) must carry a writer rank, an epoch and a valid MAC
  for this rank's session; without a secret every arrival is authentic;
* **digest_of**: the digest an arrival's tag gives for the writer's bytes (kept in its
  region until the region is complete);
* **check** (after the region's scatter, before it is freed): every kept digest against the
  bytes of that writer in the region. A mismatch is the room's failure, with a reason that
  starts ``integrity``.

Stateless apart from its configuration; **thread-safety:** any thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .._control.integrity import (
    INTEGRITY_FAILURE,
    ArrivalKeys,
    ChunkIdentity,
    chunk_digest,
    parse_tag,
)
from .._control.wire import ChunkReady, MalformedMessage, decode_message, decode_notification
from .._staging.host_view import host_view
from .rooms import ChunkRegion, RoomPlan
from .scatter import ChunkScatter

__all__ = ["ArrivalVerifier"]

logger = logging.getLogger(__name__)


class ArrivalVerifier:
    """Authenticates arrivals and checks staged bytes against their tags (decode side).

    Args:
        scatterer: the rank's scatterer (it knows where each writer's bytes lie in a region).
        session_id: this rank's engine session id (the MAC key's session).
        integrity: check the digests that arrivals carry (an arrival without one is not
            checked: the reference's prefill, or a writer with integrity off).
        keys: the MAC keys derived from the cluster secret; ``None`` (no secret): arrivals
            are not authenticated.
    """

    def __init__(
        self,
        scatterer: ChunkScatter,
        *,
        session_id: str,
        integrity: bool,
        keys: ArrivalKeys | None,
    ) -> None:
        self._scatterer = scatterer
        self._session_id = session_id
        self.integrity = integrity
        """Whether digests are checked."""
        self._keys = keys

    @property
    def authenticates(self) -> bool:
        """Whether arrivals need a MAC (a cluster secret is set)."""
        return self._keys is not None

    def authentic(self, arrival: ChunkReady) -> bool:
        """Whether ``arrival`` may count: always without a secret; with one, only with a
        writer rank, an epoch and a valid MAC of them for the session it names."""
        keys = self._keys
        if keys is None:
            return True
        if arrival.writer_rank is None or arrival.epoch is None:
            return False
        return keys.authentic(_identity(arrival, arrival.writer_rank, arrival.epoch), arrival.tag)

    def authentic_frames(self, frames: Sequence[bytes]) -> bool:
        """:meth:`authentic` of a ``CHUNK_READY`` message; ``True`` for frames that do not
        decode (the codec rejects them, counted as malformed)."""
        if self._keys is None:
            return True
        try:
            message = decode_message(frames)
        except MalformedMessage:
            return True
        return not isinstance(message, ChunkReady) or self.authentic(message)

    def authentic_notification(self, payload: bytes) -> bool:
        """:meth:`authentic` of a NIXL notification payload; ``True`` for one that does not
        decode (the codec rejects it, counted as malformed)."""
        if self._keys is None:
            return True
        try:
            arrival = decode_notification(payload)
        except MalformedMessage:
            return True
        return self.authentic(arrival)

    def digest_of(self, tag: str | None) -> str | None:
        """The digest to check for an arrival with ``tag`` (``None``: nothing to check)."""
        if not self.integrity:
            return None
        parsed = parse_tag(tag)
        return None if parsed is None else parsed.digest

    def check(self, plan: RoomPlan, chunk_idx: int, region: ChunkRegion) -> str | None:
        """Compare each writer's bytes in a scattered region with the digest it sent.

        **Called by:** the handler after the region's scatter completed and before the region
        is freed (outside its lock). **Blocking:** for the hashes (on CUDA, a copy of the
        region to the host first).

        Returns:
            ``None`` when every digest matches (or none was sent), else the room's failure
            reason, starting with :data:`~staging_contracts._control.integrity.INTEGRITY_FAILURE`.
        """
        allocation = region.allocation
        for writer_rank, expected in sorted(region.digests.items()):
            identity = ChunkIdentity(
                plan.room,
                chunk_idx,
                region.page_start,
                region.num_pages,
                self._session_id,
                writer_rank,
                allocation.round,
            )
            staged = self._scatterer.writer_bytes(
                allocation, plan.prefill_tp, region.num_pages, writer_rank
            )
            if chunk_digest(identity, host_view(staged)) != expected:
                logger.warning(
                    "room %d chunk %d: the bytes of writer rank %d do not match its tag",
                    plan.room,
                    chunk_idx,
                    writer_rank,
                    extra={"room": plan.room},
                )
                return (
                    f"{INTEGRITY_FAILURE}: chunk {chunk_idx}: the bytes of prefill writer rank "
                    f"{writer_rank} in ring region [{allocation.offset}, {allocation.end}) of "
                    f"round {allocation.round} do not match its tag (another write landed in "
                    "the region, or the bytes changed on the way)"
                )
        return None


def _identity(arrival: ChunkReady, writer_rank: int, epoch: int) -> ChunkIdentity:
    return ChunkIdentity(
        arrival.room,
        arrival.chunk_idx,
        arrival.page_start,
        arrival.num_pages,
        arrival.session_id,
        writer_rank,
        epoch,
    )
