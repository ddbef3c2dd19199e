"""Device ordering: when the copies that an engine or the ring depend on have completed.

A gather into a staging buffer and a scatter out of a ring region are enqueued on a device; on
CUDA they return before the copy ran. Two hand-offs must wait for them:

* **prefill**: the engine must not read the staging buffer before the gather that filled it
  completed (an RDMA/UCX read is not ordered with the CUDA stream);
* **decode**: a ring region must not be freed (and the watermark that lets a writer overwrite
  it broadcast) before the scatter that reads it completed.

Both go through a :class:`DeviceOrdering`: the kernels stay ordering-free, the staging writer
calls :meth:`~DeviceOrdering.gathered` before its write, and the decode side frees a region
only once :meth:`~DeviceOrdering.done` says its scatter's token completed. A copy that raised
part-way may have enqueued some of its kernels, so the failure paths go through the ordering
too: the writer calls ``gathered`` after a gather that raised, and the decode side takes a
token after a scatter that raised and frees the region only once it completed. :class:`HostOrdering`
(CPU: every copy is complete when the call returns) and :class:`CudaOrdering` (stream
synchronisation and events, on the given stream or the device's current one) are the real
ones; tests run the writer and the handler with an instrumented ordering that records the
order of gather, write, scatter and free on CPU.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = [
    "CudaOrdering",
    "DeviceOrdering",
    "HostOrdering",
    "ordering_for",
    "token_done",
    "wait_token",
]


class DeviceOrdering(Protocol):
    """When enqueued copies have completed (see the module docstring).

    **Thread-safety:** the writer's and the handler's threads call it; implementations keep
    no state shared between calls beyond their stream.
    """

    def gathered(self) -> None:
        """Block until the gather enqueued last by this thread has completed (also one that
        raised after enqueueing part of its copies)."""
        ...

    def scattered(self) -> object | None:
        """A token for the scatter enqueued last by this thread, also one that raised after
        enqueueing part of its copies (``None``: already complete)."""
        ...

    def done(self, token: object) -> bool:
        """Whether the scatter behind ``token`` has completed (non-blocking)."""
        ...

    def wait(self, token: object) -> None:
        """Block until the scatter behind ``token`` has completed."""
        ...


class HostOrdering:
    """CPU copies: complete when the call that made them returns."""

    def gathered(self) -> None:
        """Nothing to wait for."""

    def scattered(self) -> object | None:
        """Already complete: no token."""
        return None

    def done(self, token: object) -> bool:
        """Complete, unless ``token`` is an event-like object that says otherwise."""
        return token_done(token)

    def wait(self, token: object) -> None:
        """Nothing to wait for, unless ``token`` is an event-like object."""
        wait_token(token)


class CudaOrdering:
    """CUDA copies, ordered by the stream they were enqueued on.

    Args:
        device: the CUDA device of the pools.
        stream: the stream the kernels enqueue on, or ``None`` for the device's current stream
            (the default set-up, where no stream is passed).
    """

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        self._device = device
        self._stream = stream

    def _current(self) -> torch.cuda.Stream:
        # Looked up at each call: the current stream of the calling thread, where the kernel
        # enqueued without a stream went.
        if self._stream is not None:
            return self._stream
        return torch.cuda.current_stream(self._device)

    def gathered(self) -> None:
        """Synchronise the stream the gather was enqueued on."""
        self._current().synchronize()

    def scattered(self) -> object | None:
        """An event recorded on the scatter's stream, after it."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        event.record(self._current())
        return event

    def done(self, token: object) -> bool:
        """``event.query()``."""
        return token_done(token)

    def wait(self, token: object) -> None:
        """``event.synchronize()``."""
        wait_token(token)


def token_done(token: object) -> bool:
    """Whether an event-like token (``query()``) completed; anything else is complete."""
    query = getattr(token, "query", None)
    return bool(query()) if callable(query) else True


def wait_token(token: object) -> None:
    """Block on an event-like token (``synchronize()``); anything else is complete."""
    sync = getattr(token, "synchronize", None)
    if callable(sync):
        sync()


def ordering_for(device: torch.device, stream: torch.cuda.Stream | None) -> DeviceOrdering:
    """The real ordering of pools on ``device`` (CUDA: on ``stream`` or the current one)."""
    if device.type == "cuda":
        return CudaOrdering(device, stream)
    return HostOrdering()
