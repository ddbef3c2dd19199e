"""The soak's ``forge`` fault: a hostile engine that holds decode's engine metadata.

Over NIXL, :class:`Forger`, an agent of its own in the driver's process (no secret), sends a
decode rank forged arrival notifications for the rooms in flight (:func:`forged_arrivals`).
Over Mooncake, whose arrivals are authenticated control messages, :class:`Scribbler` writes
garbage one-sidedly over the rank's whole staging ring instead. What decode must do with
either (a forged arrival taken, or garbage passed, shows as a corrupt room):
docs/operating.md (the ``forge`` row) and docs/security.md.

**Threads:** the driver's (:meth:`Scribbler.scribble` runs on a thread of its own, one at a
time); every call blocks for at most the engine's write timeout.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

import torch

from .._control.wire import ChunkReady
from ..protocols import Transfer, TransferError

if TYPE_CHECKING:
    from ..engines.mooncake import MooncakeEngine
    from ..engines.nixl import NixlEngine


logger = logging.getLogger(__name__)

FORGE_WRITE_TIMEOUT_S: Final = 5.0
"""Longest the hostile agent waits for one notification (or one write) to go."""
SCRIBBLE_S: Final = 1.5
"""How long the hostile Mooncake engine keeps overwriting a decode rank's ring."""


def forged_arrivals(
    rooms: Iterable[int],
    chunks: list[tuple[int, int]],
    session_id: str,
    writers: int,
    rng: random.Random,
) -> list[bytes]:
    """Notification payloads claiming that every chunk of ``rooms`` landed in
    ``session_id``: for each chunk and writer, one without a tag and one with a made-up MAC.

    Args:
        rooms: Room ids in flight.
        chunks: ``(page_start, num_pages)`` of each chunk of a room.
        session_id: The decode session named as written to.
        writers: How many prefill writers a chunk has.
        rng: Draws the epochs, digests and MACs.
    """
    out: list[bytes] = []
    for room in rooms:
        for chunk_idx, (start, count) in enumerate(chunks):
            for writer in range(writers):
                head = (room, chunk_idx, start, count, session_id, writer)
                digest, mac = rng.randbytes(8).hex(), rng.randbytes(16).hex()
                tagged = ChunkReady(*head, rng.randrange(4), f"{digest}:{mac}")
                out += [ChunkReady(*head).to_notification(), tagged.to_notification()]
    return out


class Forger:
    """A hostile NIXL agent that sends forged arrival notifications to decode ranks.

    Its engine is created at the first :meth:`send` (on ``host``, as the ranks' engines);
    :meth:`close` ends it. **Threads:** one caller at a time (the driver's).
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self.engine: NixlEngine | None = None
        self.known: dict[str, bytes] = {}

    def send(self, session_id: str, metadata: bytes, payloads: list[bytes]) -> int:
        """Load ``metadata`` (decode's, as published) and send every payload to
        ``session_id``, each as a notification without a write.

        Returns:
            How many notifications went (a failed one is logged and not counted).

        Raises:
            TransferError: the hostile agent could not start or load the metadata.
        """
        if self.engine is None:
            from ..engines.nixl import NixlEngine  # noqa: PLC0415 - only where NIXL is used

            # NIXL installs an INFO handler: its start-up lines would cut into the soak's.
            logging.getLogger("nixl").setLevel(logging.WARNING)
            # As the ranks' backends: no InfiniBand modules (their destructor crashes the
            # driver at exit on hosts with the system's ibverbs providers).
            self.engine = NixlEngine(
                host=self.host, write_timeout_s=FORGE_WRITE_TIMEOUT_S, load_ib_modules=False
            )
        if self.known.get(session_id) != metadata:
            self.engine.add_peer(session_id, metadata)
            self.known[session_id] = metadata
        sent = 0
        for payload in payloads:
            try:
                self.engine.write(session_id, [], notify=payload)
            except TransferError as exc:  # a lost one is counted as not sent, the rest still go
                logger.warning("a forged notification to %s did not go: %r", session_id, exc)
                continue
            sent += 1
        return sent

    def progress(self) -> None:
        """Drive the hostile agent once, so that the notifications it posted go out
        (UCX sends them as the sender progresses). **Blocking:** no."""
        if self.engine is not None:
            self.engine.progress()

    def close(self) -> None:
        """End the hostile agent (idempotent)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None


class Scribbler:
    """A hostile Mooncake engine that overwrites a decode rank's staging ring with garbage.

    Its engine and its garbage buffer are created at the first :meth:`scribble` (on
    ``host``, as the ranks' engines); :meth:`close` ends it. **Threads:** one
    :meth:`scribble` at a time, on any thread; :meth:`close` once it returned.
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self.engine: MooncakeEngine | None = None
        self.buffer: torch.Tensor | None = None
        self.known: set[str] = set()

    def scribble(
        self,
        session_id: str,
        metadata: bytes,
        ring: tuple[int, int],
        stop: threading.Event,
        seed: int,
    ) -> tuple[int, int]:
        """Write fresh random bytes over the whole ``ring`` (``(base, size)`` in the decode
        rank's memory, as it publishes them) of ``session_id`` until ``stop`` is set.

        **Blocking:** until ``stop`` (plus at most one write's timeout).

        Returns:
            ``(writes, bytes)`` that Mooncake reported landed (a failed write is logged and
            not counted).

        Raises:
            TransferError: the hostile engine could not start or register its buffer.
        """
        base, size = ring
        if self.engine is None:
            from ..engines.mooncake import MooncakeEngine  # noqa: PLC0415 - only with Mooncake

            os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # as the ranks: no C++ info logs
            self.engine = MooncakeEngine(host=self.host, write_timeout_s=FORGE_WRITE_TIMEOUT_S)
        if self.buffer is None or self.buffer.numel() < size:
            if self.buffer is not None:
                self.engine.deregister(self.buffer.data_ptr())
            self.buffer = torch.empty(size, dtype=torch.uint8)
            self.engine.register(self.buffer.data_ptr(), size)
        if session_id not in self.known:
            self.engine.add_peer(session_id, metadata)
            self.known.add(session_id)
        generator = torch.Generator().manual_seed(seed)
        writes = 0
        while not stop.is_set():
            self.buffer.random_(0, 256, generator=generator)
            try:
                self.engine.write(session_id, [Transfer(self.buffer.data_ptr(), base, size)])
            except TransferError as exc:  # a failed one is not counted; the next one goes
                logger.warning("a hostile write to %s failed: %r", session_id, exc)
                stop.wait(0.05)
                continue
            writes += 1
        return writes, writes * size

    def close(self) -> None:
        """End the hostile engine (idempotent)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            self.buffer = None
            self.known.clear()
