"""Device ordering, checked on CPU with an instrumented ordering that behaves like an
asynchronous device: the engine never reads a staging buffer before its gather completed, and
a ring region is never freed before its scatter completed, on every path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from staging_contracts.decode.handler import RoomStatus
from staging_contracts.staging.ordering import CudaOrdering, HostOrdering, ordering_for
from tests.local_cluster import Geometry, local_cluster, wait_for


@dataclass
class Token:
    """A scatter's completion, released by the test (a stand-in for a CUDA event)."""

    complete: bool = False


@dataclass
class RecordingOrdering:
    """An instrumented ordering (a fake of an asynchronous device, named as such): copies
    complete only when the ordering says so, and every hand-off is logged in order."""

    log: list[str]
    tokens: list[Token] = field(default_factory=list)

    def gathered(self) -> None:
        self.log.append("gathered")

    def scattered(self) -> object | None:
        token = Token()
        self.tokens.append(token)
        self.log.append("scattered")
        return token

    def done(self, token: object) -> bool:
        return isinstance(token, Token) and token.complete

    def wait(self, token: object) -> None:
        if isinstance(token, Token):
            token.complete = True
            self.log.append("waited")


def writes_after_gathers(log: list[str]) -> bool:
    """Every engine write comes after a gather that was waited for, and no gather is pending."""
    pending = False
    for entry in log:
        if entry == "gather":
            pending = True
        elif entry == "gathered":
            pending = False
        elif entry == "write" and pending:
            return False
    return "write" in log


def _logged(log: list[str], name: str, fn: Callable[..., object]) -> Callable[..., object]:
    def wrapper(*args: object, **kwargs: object) -> object:
        log.append(name)
        return fn(*args, **kwargs)

    return wrapper


def test_the_engine_never_reads_a_buffer_before_its_gather_completed() -> None:
    """gather, gathered, write: for every chunk and every decode rank fed."""
    g = Geometry(1, 2, 4)
    with local_cluster(g) as cluster:
        request = cluster.add_request(400, num_pages=4, chunk_pages=2)
        log: list[str] = []
        writer = cluster.writers[0]
        writer._ordering = RecordingOrdering(log)
        writer._pools.gather = _logged(log, "gather", writer._pools.gather)  # type: ignore[method-assign,assignment]
        engine = cluster.prefill[0].engine
        engine.write = _logged(log, "write", engine.write)  # type: ignore[method-assign,assignment]
        assert cluster.send_all([request]) == []
        assert log.count("write") == 4  # two chunks, two decode ranks
        assert writes_after_gathers(log)


def test_a_writer_that_skips_the_wait_is_caught() -> None:
    """The check fails on a reordered variant (an ordering that never waits)."""
    assert not writes_after_gathers(["gather", "write"])
    assert writes_after_gathers(["gather", "gathered", "write"])
    assert not writes_after_gathers(["gather", "gathered"])


def test_a_region_is_freed_only_after_its_scatter_completed() -> None:
    """Until the scatter's token completes: the region stays live, no watermark moves, the
    room is not SUCCESS; then progress frees it and the room succeeds."""
    g = Geometry(1, 1, 2)
    with local_cluster(g) as cluster:
        handler = cluster.handlers[0]
        log: list[str] = []
        ordering = RecordingOrdering(log)
        handler._scatterer.ordering = ordering
        request = cluster.add_request(401, num_pages=2, chunk_pages=2)
        cluster.send_all([request])
        assert wait_for(lambda: ordering.tokens)
        watermark = handler.allocator.get_watermark()
        handler.progress()
        assert handler.allocator.live_count == 1
        assert handler.allocator.get_watermark() == watermark
        assert handler.poll_room(401) is RoomStatus.TRANSFERRING
        ordering.tokens[0].complete = True
        assert wait_for(lambda: handler.poll_room(401) is RoomStatus.SUCCESS)
        assert handler.allocator.live_count == 0
        assert handler.allocator.get_watermark() != watermark


def test_release_waits_for_a_pending_scatter_before_freeing() -> None:
    """Tearing a room down waits on its scatter's token, then frees the region."""
    g = Geometry(1, 1, 2)
    with local_cluster(g) as cluster:
        handler = cluster.handlers[0]
        ordering = RecordingOrdering([])
        handler._scatterer.ordering = ordering
        request = cluster.add_request(402, num_pages=2, chunk_pages=2)
        cluster.send_all([request])
        assert wait_for(lambda: ordering.tokens)
        handler.release_room(402)
        assert ordering.log[-1] == "waited"
        assert handler.allocator.live_count == 0


def test_cpu_pools_get_the_host_ordering() -> None:
    """On CPU every copy is complete when its call returns."""
    ordering = ordering_for(torch.device("cpu"), None)
    assert isinstance(ordering, HostOrdering)
    assert ordering.scattered() is None
    assert ordering.done(None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_without_a_stream_still_gets_an_event() -> None:
    """The default set-up (no stream) records an event on the current stream: the region is
    freed only once the scatter ran (it used to return None and free at once)."""
    ordering = ordering_for(torch.device("cuda"), None)
    assert isinstance(ordering, CudaOrdering)
    x = torch.ones(1 << 20, device="cuda")
    x.mul_(2)
    token = ordering.scattered()
    assert token is not None
    ordering.wait(token)
    assert ordering.done(token)
