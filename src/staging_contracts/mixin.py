"""``StagingManagerMixin``: the staging logic shared by every transfer backend.

A backend mixes it in *before* its common base, and states its witness::

    class MooncakeKVManager(StagingManagerMixin, CommonKVManager):
        __contract: ClassVar[StagingHostCheck[MooncakeKVManager]]
        _staging_handler: StagingHandler | None
        _staging_ctx: DecodeStagingContext | PrefillStagingContext | None
        ...

and must satisfy :class:`~staging_contracts.protocols.StagingHost`. That is enforced by every
type checker at the witness (:class:`StagingHostCheck`), by mypy's plugin at the class line and
wherever a method below is called (they take ``self: StagingHostCore``), at class creation,
and once per instance after construction — never on the hot path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar, Final, Protocol, TypeVar, cast

from ._contract.contract import Contract
from ._contract.enforcement import ContractMixin
from ._contract.witness import HostCheck
from ._control.wire import (
    ChunkReady,
    MalformedMessage,
    Message,
    StagingReq,
    StagingRsp,
    WatermarkUpdate,
    decode_message,
    decode_notification,
)
from .protocols import (
    ArrivalOutcome,
    PrefillStagingContext,
    RegionAnswer,
    StagingHandler,
    StagingHost,
    StagingHostCore,
    StagingReqOutcome,
    Watermark,
)
from .stats import StagingCounters, StagingStats

__all__ = ["STAGING_CONTRACT", "StagingHostCheck", "StagingManagerMixin", "host_logger"]

_M = TypeVar("_M", StagingReq, StagingRsp, WatermarkUpdate, ChunkReady)

_REQ_COUNTER: Final[dict[StagingReqOutcome, str]] = {
    StagingReqOutcome.ALLOCATED: "allocated",
    StagingReqOutcome.SHARED: "",
    StagingReqOutcome.OVERSIZED: "oversized",
    StagingReqOutcome.UNKNOWN_ROOM: "dropped",
    StagingReqOutcome.REJECTED: "rejected",
    StagingReqOutcome.DEFERRED: "deferred",
}
_ARRIVAL_COUNTER: Final[dict[ArrivalOutcome, str]] = {
    ArrivalOutcome.WAITING: "arrivals",
    ArrivalOutcome.COMPLETE: "arrivals",
    ArrivalOutcome.DUPLICATE: "",
    ArrivalOutcome.UNKNOWN: "dropped",
    ArrivalOutcome.REJECTED: "rejected",
}

STAGING_CONTRACT: Final = Contract(
    StagingHost,
    optional=("kv_buffer_tensors",),
    set_later=("_staging_handler", "kv_buffer_tensors"),
)
"""The :class:`StagingHost` contract, as enforced by :class:`StagingManagerMixin`: every
assignment to ``_staging_handler`` and ``kv_buffer_tensors`` is checked."""

_Host = TypeVar("_Host", bound=StagingHostCore)


class StagingHostCheck(HostCheck[_Host]):
    """The witness of the :class:`StagingHost` contract: a backend states it as the first
    statement of its body, after the docstring, naming itself::

        class AcmeKVManager(StagingManagerMixin, CommonKVManager):
            __contract: ClassVar[StagingHostCheck[AcmeKVManager]]

    so that mypy (no plugin needed), pyright, ty and pyrefly report there a backend that does
    not satisfy :class:`StagingHostCore`: a member missing, a declared type that is not a
    subtype, no ``arrival`` (a Mori-like backend). Validated at class creation: it must name
    the class itself (see :mod:`~staging_contracts._contract.witness`).
    """


def host_logger(host: object) -> logging.Logger:
    """The logger of a staging host's concrete class (its module's logger)."""
    logger: logging.Logger = getattr(type(host), "_staging_logger")  # noqa: B009 - `host` is typed `object`
    return logger


class _StagingReceiver(StagingHostCore, Protocol):
    """A host together with the mixin's message handlers (so overrides are honoured)."""

    def _handle_staging_req(self, frames: Sequence[bytes]) -> StagingReqOutcome | None: ...
    def _handle_chunk_ready(self, frames: Sequence[bytes]) -> ArrivalOutcome | None: ...
    def _handle_staging_rsp(self, frames: Sequence[bytes]) -> RegionAnswer | None: ...
    def _handle_watermark(self, frames: Sequence[bytes]) -> bool: ...


def _set_handler(host: StagingHostCore, handler: StagingHandler | None) -> None:
    """Assign the host's handler by name: ``_staging_handler`` is read-only in the Protocol
    (so that a host may declare a narrower type); the host's ``__setattr__`` checks it."""
    setattr(host, "_staging_handler", handler)  # noqa: B010 - read-only in the Protocol


def _counters(host: StagingHostCore) -> StagingCounters | None:
    ctx = host._staging_ctx
    return None if ctx is None else ctx.counters


def _count(counters: StagingCounters | None, name: str) -> None:
    if counters is not None and name:
        counters.add(name)


def _expect(frames: Sequence[bytes], kind: type[_M], counters: StagingCounters | None) -> _M:
    try:
        message: Message = decode_message(frames)
    except MalformedMessage:
        _count(counters, "malformed")
        raise
    if not isinstance(message, kind):
        _count(counters, "malformed")
        raise MalformedMessage(
            f"expected {kind.WIRE_TYPE.decode()}, got {type(message).WIRE_TYPE.decode()}",
            0,
            "type",
        )
    return message


class StagingManagerMixin(ContractMixin, contract=STAGING_CONTRACT):
    """Shared staging logic for KV-transfer managers; enforces :class:`StagingHost`.

    Class keywords:
        abstract: ``True`` for an intermediate base that does not itself satisfy the
            contract; the check then applies to its subclasses only.

    Raises:
        ContractError: at class creation, when the class (with its bases) does not declare
            every required member, declares one with an incompatible type, or lists a base
            that shadows a mixin method before the mixin; after construction, when a member
            holds a value of the wrong type; at an assignment of ``_staging_handler`` or
            ``kv_buffer_tensors``, when the value is of the wrong type (it is not assigned).
    """

    _staging_logger: ClassVar[logging.Logger]
    """``logging.getLogger(cls.__module__)`` of the concrete backend, fixed at class creation,
    so that filters keyed on backend logger names see the mixin's records."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        cls._staging_logger = logging.getLogger(cls.__module__)
        super().__init_subclass__(**kwargs)

    def attach_staging_handler(self: StagingHostCore, handler: StagingHandler) -> None:
        """Attach the decode-side staging handler once the scheduler has created it.

        **Side:** decode. **Called by:** the scheduler, after the manager is constructed.
        **When:** before the prefill ranks are told about this decode (messages that arrive
        earlier are dropped and counted). **Blocking:** no.

        Raises:
            ContractError: ``handler`` does not satisfy :class:`StagingHandler` (checked by
                the assignment, as every assignment of ``_staging_handler`` is).
        """
        _set_handler(self, handler)
        host_logger(self).debug("staging handler attached: %r", handler)

    def detach_staging_handler(self: StagingHostCore) -> None:
        """Detach the handler; later staging messages are dropped and counted.

        **Side:** decode. **Called by:** the scheduler at shutdown.
        """
        _set_handler(self, None)

    # ------------------------------------------------------------------ decode side

    def _handle_staging_req(
        self: StagingHostCore, frames: Sequence[bytes]
    ) -> StagingReqOutcome | None:
        """Hand one ``STAGING_REQ`` to the attached handler.

        **Side:** decode. **Called by:** the host's listener thread. **Blocking:** no (the
        handler answers with non-blocking sends).

        Returns:
            What the handler did, or ``None`` when no handler is attached yet (the message is
            dropped with a warning and counted).

        Raises:
            MalformedMessage: the frames are not a valid ``STAGING_REQ`` (counted first).
        """
        counters = _counters(self)
        _count(counters, "received")
        req = _expect(frames, StagingReq, counters)
        handler = _attached_handler(self, counters, req)
        if handler is None:
            return None
        outcome = handler.handle_staging_req(
            req.room,
            req.chunk_idx,
            num_pages=req.num_pages,
            session_id=req.session_id,
            pp_rank=req.pp_rank,
        )
        _count(counters, _REQ_COUNTER[outcome])
        return outcome

    def _handle_chunk_ready(
        self: StagingHostCore, frames: Sequence[bytes]
    ) -> ArrivalOutcome | None:
        """Hand one ``CHUNK_READY`` (Mooncake's arrival signal) to the attached handler.

        **Side:** decode. **Called by:** the host's listener thread.

        Returns:
            What the handler did, or ``None`` when no handler is attached (dropped, counted).

        Raises:
            MalformedMessage: the frames are not a valid ``CHUNK_READY`` (counted first).
        """
        counters = _counters(self)
        _count(counters, "received")
        return _deliver_arrival(self, _expect(frames, ChunkReady, counters), counters)

    def _handle_chunk_notification(self: StagingHostCore, payload: bytes) -> ArrivalOutcome | None:
        """Hand one arrival notification (NIXL's write notification payload) to the handler.

        **Side:** decode. **Called by:** the thread that polls the engine's notifications.

        Raises:
            MalformedMessage: the payload is not a valid encoded ``CHUNK_READY`` (counted).
        """
        counters = _counters(self)
        _count(counters, "received")
        try:
            arrival = decode_notification(payload)
        except MalformedMessage:
            _count(counters, "malformed")
            raise
        return _deliver_arrival(self, arrival, counters)

    # ------------------------------------------------------------------ prefill side

    def _handle_staging_rsp(self: StagingHostCore, frames: Sequence[bytes]) -> RegionAnswer | None:
        """Record decode's answer to a ``STAGING_REQ`` and wake the waiting transfer worker.

        **Side:** prefill. **Called by:** the host's listener thread.

        Returns:
            The recorded answer, or ``None`` when this host has no prefill staging context.

        Raises:
            MalformedMessage: the frames are not a valid ``STAGING_RSP`` (counted first).
        """
        counters = _counters(self)
        _count(counters, "received")
        rsp = _expect(frames, StagingRsp, counters)
        ctx = self._staging_ctx
        if not isinstance(ctx, PrefillStagingContext):
            _count(counters, "dropped")
            host_logger(self).warning("STAGING_RSP room=%d dropped: not a prefill host", rsp.room)
            return None
        answer = RegionAnswer(rsp.offset, rsp.round, rsp.end)
        ctx.regions.record(rsp.room, rsp.chunk_idx, rsp.session_id, answer)
        _count(counters, "responses")
        return answer

    def _handle_watermark(self: StagingHostCore, frames: Sequence[bytes]) -> bool:
        """Record a decode session's new watermark and wake writers waiting on it.

        **Side:** prefill. **Called by:** the host's listener thread.

        Returns:
            ``True`` if the session's watermark moved forward.

        Raises:
            MalformedMessage: the frames are not a valid ``WATERMARK`` (counted first).
        """
        counters = _counters(self)
        _count(counters, "received")
        update = _expect(frames, WatermarkUpdate, counters)
        ctx = self._staging_ctx
        if not isinstance(ctx, PrefillStagingContext):
            _count(counters, "dropped")
            return False
        moved = ctx.watermarks.observe(update.session_id, Watermark(update.round, update.tail))
        if moved:
            _count(counters, "watermarks")
        return moved

    def _is_watermark_ready(
        self: StagingHostCore, session_id: str, alloc_round: int, alloc_end: int
    ) -> bool:
        """May this prefill write a region of ``alloc_round`` ending at ``alloc_end`` now?

        **Side:** prefill. **Called by:** transfer workers, before each chunk's write.
        **Blocking:** no. A host without a prefill staging context is never ready.
        """
        ctx = self._staging_ctx
        if not isinstance(ctx, PrefillStagingContext):
            return False
        return ctx.watermarks.is_ready(session_id, alloc_round, alloc_end)

    # ------------------------------------------------------------------ both sides

    def _dispatch_staging(self: _StagingReceiver, frames: Sequence[bytes]) -> bool:
        """Route a staging message by its frame type; ``False`` if it is not one.

        **Called by:** a listener thread that shares its socket with other traffic.

        Raises:
            MalformedMessage: a staging message type with invalid frames.
        """
        if not frames:
            return False
        kind = bytes(frames[0])
        if kind == StagingReq.WIRE_TYPE:
            self._handle_staging_req(frames)
        elif kind == ChunkReady.WIRE_TYPE:
            self._handle_chunk_ready(frames)
        elif kind == StagingRsp.WIRE_TYPE:
            self._handle_staging_rsp(frames)
        elif kind == WatermarkUpdate.WIRE_TYPE:
            self._handle_watermark(frames)
        else:
            return False
        return True

    def staging_stats(self: StagingHostCore) -> StagingStats:
        """What the staging message handling counted on this host (zeros without a context).

        **Called by:** anyone, any thread (monitoring, tests).
        """
        counters = _counters(self)
        return StagingStats() if counters is None else counters.snapshot()


def _attached_handler(
    host: StagingHostCore, counters: StagingCounters | None, message: StagingReq | ChunkReady
) -> StagingHandler | None:
    """The host's handler, or ``None`` after dropping ``message`` with a warning and a count."""
    handler = host._staging_handler
    if handler is None:
        _count(counters, "dropped")
        host_logger(host).warning(
            "%s room=%d chunk=%d dropped: no staging handler attached yet",
            message.WIRE_TYPE.decode(),
            message.room,
            message.chunk_idx,
        )
    return handler


class _TaggedArrivals(Protocol):
    """A handler that says ``accepts_arrival_tags = True``: it takes ``epoch`` and ``tag``."""

    def handle_chunk_arrival(
        self,
        room: int,
        chunk_idx: int,
        *,
        page_start: int,
        num_pages: int,
        session_id: str,
        writer_rank: int | None,
        epoch: int | None,
        tag: str | None,
    ) -> ArrivalOutcome: ...


def _deliver_arrival(
    host: StagingHostCore, arrival: ChunkReady, counters: StagingCounters | None
) -> ArrivalOutcome | None:
    handler = _attached_handler(host, counters, arrival)
    if handler is None:
        return None
    if arrival.epoch is not None and getattr(handler, "accepts_arrival_tags", False) is True:
        # A handler of ours takes the region epoch and the integrity tag; a handler that
        # does not say so gets the fields the StagingHandler protocol names.
        outcome = cast(_TaggedArrivals, handler).handle_chunk_arrival(
            arrival.room,
            arrival.chunk_idx,
            page_start=arrival.page_start,
            num_pages=arrival.num_pages,
            session_id=arrival.session_id,
            writer_rank=arrival.writer_rank,
            epoch=arrival.epoch,
            tag=arrival.tag,
        )
    else:
        outcome = handler.handle_chunk_arrival(
            arrival.room,
            arrival.chunk_idx,
            page_start=arrival.page_start,
            num_pages=arrival.num_pages,
            session_id=arrival.session_id,
            writer_rank=arrival.writer_rank,
        )
    _count(counters, _ARRIVAL_COUNTER[outcome])
    return outcome
