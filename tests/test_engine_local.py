"""LocalEngine: same-process copies, notifications, range checks, lifecycle, threads."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from staging_contracts.engines.local import LocalEngine
from staging_contracts.protocols import Notification, Transfer, TransferEngine, TransferError

SIZE = 1 << 16


@pytest.fixture
def pair() -> Iterator[tuple[LocalEngine, LocalEngine, torch.Tensor, torch.Tensor]]:
    """A writer and a reader engine with registered buffers; the writer knows the reader."""
    writer, reader = LocalEngine(), LocalEngine()
    source = torch.randint(
        0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
    )
    sink = torch.zeros(SIZE, dtype=torch.uint8)
    writer.register(source.data_ptr(), SIZE)
    reader.register(sink.data_ptr(), SIZE)
    writer.add_peer(reader.session_id, reader.metadata())
    yield writer, reader, source, sink
    writer.close()
    reader.close()


def test_local_engine_satisfies_the_protocol() -> None:
    """LocalEngine is a TransferEngine that supports notifications."""
    engine: TransferEngine = LocalEngine()
    try:
        assert engine.supports_notifications
        assert engine.metadata() == engine.session_id.encode()
    finally:
        engine.close()


def test_write_copies_every_transfer(
    pair: tuple[LocalEngine, LocalEngine, torch.Tensor, torch.Tensor],
) -> None:
    """A bulk write copies each transfer's bytes to its place and nothing else."""
    writer, reader, source, sink = pair
    plan = [(0, 100, 10), (1000, 0, 64), (SIZE - 5, SIZE - 5, 5)]
    writer.write(
        reader.session_id,
        [Transfer(source.data_ptr() + s, sink.data_ptr() + d, n) for s, d, n in plan],
    )
    expected = torch.zeros(SIZE, dtype=torch.uint8)
    for s, d, n in plan:
        expected[d : d + n] = source[s : s + n]
    assert torch.equal(sink, expected)
    assert reader.poll_notifications() == []


def test_notification_follows_the_data(
    pair: tuple[LocalEngine, LocalEngine, torch.Tensor, torch.Tensor],
) -> None:
    """The peer receives the payload, named by the writer, once per write and in order."""
    writer, reader, source, sink = pair
    transfer = Transfer(source.data_ptr(), sink.data_ptr(), 8)
    writer.write(reader.session_id, [transfer], notify=b"first")
    writer.write(reader.session_id, [], notify=b"")
    assert torch.equal(sink[:8], source[:8])
    assert reader.poll_notifications() == [
        Notification(writer.session_id, b"first"),
        Notification(writer.session_id, b""),
    ]
    assert reader.poll_notifications() == []
    assert writer.poll_notifications() == []


def test_ranges_outside_registered_memory_are_rejected(
    pair: tuple[LocalEngine, LocalEngine, torch.Tensor, torch.Tensor],
) -> None:
    """Every bad range is reported at once, nothing is copied, and the next write works."""
    writer, reader, source, sink = pair
    bad = [
        Transfer(source.data_ptr(), sink.data_ptr() + SIZE - 4, 8),
        Transfer(source.data_ptr() + SIZE, sink.data_ptr(), 1),
        Transfer(source.data_ptr(), sink.data_ptr(), 0),
        Transfer(source.data_ptr(), sink.data_ptr(), 16),
    ]
    with pytest.raises(TransferError, match=r"^local engine '.*' cannot write to '.*':\n") as info:
        writer.write(reader.session_id, bad, notify=b"never")
    lines = str(info.value).splitlines()[1:]
    assert lines[0].startswith("  - transfer 0: remote [")
    assert "runs 4 bytes past the end of the registered range" in lines[0]
    assert lines[1].startswith("  - transfer 1: local [")
    assert "is not in any registered range (1 known)" in lines[1]
    assert lines[2] == "  - transfer 2: length 0 must be >= 1"
    assert len(lines) == 3
    assert not sink.any()
    assert reader.poll_notifications() == []
    writer.write(reader.session_id, [bad[3]])
    assert torch.equal(sink[:16], source[:16])


def test_unknown_and_closed_peers_are_rejected() -> None:
    """Writing to a peer never added, or closed since, raises TransferError."""
    writer, reader = LocalEngine(), LocalEngine()
    try:
        with pytest.raises(
            TransferError, match=r"^unknown peer '.*' of local engine '.*'; call add_peer first$"
        ):
            writer.write(reader.session_id, [])
        with pytest.raises(ValueError, match=r"^metadata b'x' does not belong to local engine"):
            writer.add_peer(reader.session_id, b"x")
        writer.add_peer(reader.session_id, reader.metadata())
        writer.add_peer(reader.session_id, reader.metadata())
        reader.close()
        with pytest.raises(TransferError, match=r"^peer '.*' of local engine '.*' is gone$"):
            writer.write(reader.session_id, [])
        with pytest.raises(TransferError, match=r"^no live local engine named"):
            writer.add_peer(reader.session_id, reader.metadata())
    finally:
        writer.close()
        reader.close()


def test_registration_rules() -> None:
    """Registering is idempotent, conflicts and bad ranges are refused, deregister forgets."""
    engine = LocalEngine()
    buffer = torch.zeros(64, dtype=torch.uint8)
    try:
        engine.register(buffer.data_ptr(), 64)
        engine.register(buffer.data_ptr(), 64)
        with pytest.raises(
            ValueError, match=r"^address 0x[0-9a-f]+ is already registered with length 64, not 32"
        ):
            engine.register(buffer.data_ptr(), 32)
        with pytest.raises(ValueError, match=r"^length 0 must be >= 1$"):
            engine.register(buffer.data_ptr() + 1, 0)
        with pytest.raises(ValueError, match=r"^address 0x0 must be positive$"):
            engine.register(0, 8)
        engine.deregister(buffer.data_ptr())
        engine.deregister(buffer.data_ptr())
        engine.add_peer(engine.session_id, engine.metadata())
        with pytest.raises(
            TransferError,
            match=r"^local engine '.*' cannot write to '.*':\n  - transfer 0: local \[",
        ):
            engine.write(engine.session_id, [Transfer(buffer.data_ptr(), buffer.data_ptr() + 8, 8)])
    finally:
        engine.close()


def test_names_are_unique_while_alive() -> None:
    """A second live engine with the same name is refused; after close the name is free."""
    first = LocalEngine("decode-0")
    with pytest.raises(ValueError, match=r"^a local engine named 'decode-0' already exists$"):
        LocalEngine("decode-0")
    first.close()
    second = LocalEngine("decode-0")
    assert second.session_id == "decode-0"
    second.close()


def test_close_twice_is_safe_and_closed_engines_refuse_work() -> None:
    """Closing twice is harmless; a closed engine refuses writes and registrations."""
    engine = LocalEngine()
    buffer = torch.zeros(8, dtype=torch.uint8)
    engine.register(buffer.data_ptr(), 8)
    engine.close()
    engine.close()
    assert engine.poll_notifications() == []
    engine.deregister(buffer.data_ptr())
    with pytest.raises(TransferError, match=r"^local engine '.*' is closed$"):
        engine.register(buffer.data_ptr(), 8)
    assert "closed" in repr(engine)


def test_loopback_write_within_one_engine() -> None:
    """An engine can write into its own registered memory and notify itself."""
    engine = LocalEngine()
    buffer = torch.arange(16, dtype=torch.uint8)
    try:
        engine.register(buffer.data_ptr(), 16)
        engine.add_peer(engine.session_id, engine.metadata())
        engine.write(
            engine.session_id, [Transfer(buffer.data_ptr(), buffer.data_ptr() + 8, 8)], notify=b"me"
        )
        assert buffer[8:].tolist() == list(range(8))
        assert engine.poll_notifications() == [Notification(engine.session_id, b"me")]
    finally:
        engine.close()


def test_concurrent_writes_and_polls_are_safe() -> None:
    """Writers in both directions and a poller on each side run at once without loss or deadlock."""
    left, right = LocalEngine(), LocalEngine()
    chunk, count = 256, 200
    buffers = {
        engine.session_id: (
            torch.randint(
                0,
                256,
                (chunk * count,),
                dtype=torch.uint8,
                generator=torch.Generator().manual_seed(n),
            ),
            torch.zeros(chunk * count, dtype=torch.uint8),
        )
        for n, engine in enumerate((left, right))
    }
    for engine in (left, right):
        source, sink = buffers[engine.session_id]
        engine.register(source.data_ptr(), source.numel())
        engine.register(sink.data_ptr(), sink.numel())
    left.add_peer(right.session_id, right.metadata())
    right.add_peer(left.session_id, left.metadata())
    received: dict[str, list[Notification]] = {left.session_id: [], right.session_id: []}
    stop = threading.Event()

    def write(source_engine: LocalEngine, target_engine: LocalEngine) -> None:
        source = buffers[source_engine.session_id][0]
        sink = buffers[target_engine.session_id][1]
        for index in range(count):
            offset = index * chunk
            transfer = Transfer(source.data_ptr() + offset, sink.data_ptr() + offset, chunk)
            source_engine.write(target_engine.session_id, [transfer], notify=str(index).encode())

    def poll(engine: LocalEngine) -> None:
        while not stop.is_set():
            received[engine.session_id].extend(engine.poll_notifications())

    threads = [
        threading.Thread(target=write, args=(left, right)),
        threading.Thread(target=write, args=(right, left)),
        threading.Thread(target=poll, args=(left,)),
        threading.Thread(target=poll, args=(right,)),
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads[:2]:
            thread.join(30)
        stop.set()
        for thread in threads[2:]:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads)
        for engine, other in ((left, right), (right, left)):
            received[engine.session_id].extend(engine.poll_notifications())
            payloads = [note.payload for note in received[engine.session_id]]
            assert payloads == [str(index).encode() for index in range(count)]
            assert torch.equal(buffers[engine.session_id][1], buffers[other.session_id][0])
    finally:
        stop.set()
        left.close()
        right.close()
