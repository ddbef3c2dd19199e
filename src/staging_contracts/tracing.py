"""Optional OpenTelemetry traces: a span per room on each side, an event per chunk.

Only when a tracer provider is configured: the application's (``opentelemetry.trace.
set_tracer_provider``), or one given to :func:`use_tracer_provider`. Otherwise
:func:`room_tracer` returns ``None`` and the staging path does nothing but test that ``None``
(no import of OpenTelemetry, whose API is the optional extra ``tracing``): the check looks
only at ``sys.modules``, since an application that configured a provider has imported it.

The provider is looked up when the decode handler or the prefill per-request layer is built
(one provider configured later is not seen by them).

**Spans.** ``staging.room`` (one per room and side, from its registration on decode or its
``open_room`` on prefill to its end), with the attributes ``staging.room`` (the room id),
``staging.side`` (``decode``/``prefill``) and, at the end, ``staging.outcome``
(``success``/``failed``) and, when it failed, ``staging.failure_reason`` (a
:class:`~staging_contracts.outcomes.FailureReason` value) and ``staging.failure_detail``; a
failed room's span has the status ``ERROR``. **Events.** ``chunk`` per chunk: written (prefill)
or complete and scattered (decode), with ``staging.chunk`` (its index) and ``staging.pages``.

**Threads:** a :class:`RoomTracer` may be used from any thread (one lock). Spans end on the
thread that ends the room, with the side's lock held: configure a batching span processor
(the SDK's ``BatchSpanProcessor``), not one that exports on that thread.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Final

from .outcomes import FailureReason, Outcome, classify

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider

__all__ = ["SPAN_NAME", "RoomTracer", "room_tracer", "use_tracer_provider"]

SPAN_NAME: Final = "staging.room"
"""The name of every room's span."""

_provider: TracerProvider | None = None


def use_tracer_provider(provider: TracerProvider | None) -> None:
    """Trace rooms into ``provider`` (``None``: back to OpenTelemetry's global provider),
    for handlers and transfer layers built from now on.

    **Called by:** the application (or a test) at start-up, any thread.
    """
    global _provider  # noqa: PLW0603 - the library's own choice of provider
    _provider = provider


def room_tracer(side: str) -> RoomTracer | None:
    """A tracer of ``side``'s rooms, or ``None`` when no tracer provider is configured.

    **Called by:** the decode handler and the prefill per-request layer, at construction.
    **Blocking:** no; imports nothing when OpenTelemetry was not imported.
    """
    provider = _provider
    if provider is None:
        trace = sys.modules.get("opentelemetry.trace")
        if trace is None:
            return None
        found = trace.get_tracer_provider()
        if isinstance(found, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return None
        provider = found
    return RoomTracer(provider.get_tracer("staging_contracts"), side)


class RoomTracer:
    """The open span of each room of one side.

    Args:
        tracer: where the spans go.
        side: ``"decode"`` or ``"prefill"`` (the ``staging.side`` attribute).
    """

    def __init__(self, tracer: Tracer, side: str) -> None:
        self._tracer = tracer
        self._side = side
        self._lock = threading.Lock()
        self._spans: dict[int, Span] = {}

    def start(self, room: int) -> None:
        """Open the room's span (nothing if one is open already)."""
        with self._lock:
            if room in self._spans:
                return
            self._spans[room] = self._tracer.start_span(
                SPAN_NAME, attributes={"staging.room": room, "staging.side": self._side}
            )

    def chunk(self, room: int, chunk_idx: int, pages: int) -> None:
        """Add a ``chunk`` event to the room's open span (nothing without one)."""
        with self._lock:
            span = self._spans.get(room)
        if span is not None:
            span.add_event("chunk", {"staging.chunk": chunk_idx, "staging.pages": pages})

    def end(self, room: int, failure: str | None, reason: FailureReason | None = None) -> None:
        """End the room's open span: succeeded (``failure`` is ``None``) or failed (nothing
        without an open span); ``reason``: the failure's, as the room's book typed it
        (``None``: read from ``failure``)."""
        with self._lock:
            span = self._spans.pop(room, None)
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415 - loaded: a span exists

        if failure is None:
            span.set_attribute("staging.outcome", Outcome.SUCCESS.value)
        else:
            span.set_attribute("staging.outcome", Outcome.FAILED.value)
            kind = reason if reason is not None else classify(failure)
            span.set_attribute("staging.failure_reason", kind.value)
            span.set_attribute("staging.failure_detail", failure)
            span.set_status(Status(StatusCode.ERROR, failure))
        span.end()

    @property
    def open_rooms(self) -> frozenset[int]:
        """The rooms whose span is open."""
        with self._lock:
            return frozenset(self._spans)
