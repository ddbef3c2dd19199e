"""Integrity of staged chunks (issue 24): tags, region epochs and authenticated arrivals.

In-process, over ``LocalKVManager`` (real listeners and sockets, memcpy for the engine): a
write that lands in a region after its writer's (a paused writer's late write) fails the room
with ``integrity`` instead of letting it report SUCCESS with wrong bytes; an arrival for an old
epoch of a region is dropped; with the secret an arrival without a valid MAC never counts. The
same through real NIXL processes is in ``test_integrity_nixl.py``.
"""

from __future__ import annotations

import pytest

from staging_contracts._control.integrity import (
    DEFAULT_INTEGRITY,
    INTEGRITY_ENV,
    ArrivalKeys,
    ChunkIdentity,
    chunk_digest,
    integrity_enabled,
    make_tag,
    parse_tag,
)
from staging_contracts._control.security import SECRET_ENV
from staging_contracts._control.wire import ChunkReady
from staging_contracts._decode.handler import RoomStatus
from staging_contracts.backends._staging_setup import staging_idle
from staging_contracts.protocols import ArrivalOutcome, Notification
from tests.integrity_helpers import land_first_then_late_then_second, region_of
from tests.local_cluster import Geometry, local_cluster, pools_equal, wait_for

SECRET = b"integrity tests: a secret of 32 b"


def test_without_a_late_write_the_checked_room_is_bit_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same two writers with nothing landing in between: SUCCESS, pool bit-exact."""
    monkeypatch.setenv(INTEGRITY_ENV, "1")
    with local_cluster(Geometry(2, 1, 4)) as cluster:
        cluster.add_request(502, num_pages=4, chunk_pages=2)
        assert cluster.send_all(cluster.requests) == []
        assert cluster.wait_rooms([502]) == {502: [RoomStatus.SUCCESS]}
        assert pools_equal(cluster.decode_pools[0], cluster.expected_decode_pool(0))


def test_with_integrity_off_nothing_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """STAGING_CONTRACTS_INTEGRITY=0: writers send no digest and decode checks none, so the
    late write goes unnoticed (what the setting trades away)."""
    monkeypatch.setenv(INTEGRITY_ENV, "0")
    with local_cluster(Geometry(2, 1, 4)) as cluster:
        assert not cluster.handlers[0].integrity
        assert not any(w.integrity for w in cluster.writers)
        cluster.add_request(503, num_pages=2, chunk_pages=2)
        land_first_then_late_then_second(cluster, 503)
        assert cluster.wait_rooms([503]) == {503: [RoomStatus.SUCCESS]}
        assert not pools_equal(cluster.decode_pools[0], cluster.expected_decode_pool(0))


def test_an_arrival_for_another_epoch_of_the_region_is_dropped() -> None:
    """A CHUNK_READY naming an older round than its region's (a writer of an earlier use of
    the room id) does not count: the room waits for the real writer and then succeeds."""
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        handler = cluster.handlers[0]
        request = cluster.add_request(504, num_pages=2, chunk_pages=2)
        (chunk,) = request.chunks()
        writer = cluster.writers[0]
        writer.prefetch(504, [(0, 2)], cluster.targets)
        assert wait_for(lambda: handler._rooms[504].regions)
        _, _, epoch = region_of(cluster, 504)
        stale = handler.handle_chunk_arrival(
            504,
            0,
            page_start=0,
            num_pages=2,
            session_id=handler.session_id,
            writer_rank=0,
            epoch=epoch + 1,
            tag=None,
        )
        assert stale is ArrivalOutcome.UNKNOWN
        assert handler.poll_room(504) is RoomStatus.TRANSFERRING
        writer.send_chunk(504, chunk, cluster.targets)
        assert cluster.wait_rooms([504]) == {504: [RoomStatus.SUCCESS]}
        assert pools_equal(cluster.decode_pools[0], cluster.expected_decode_pool(0))


def test_with_the_secret_a_notification_without_a_valid_mac_is_dropped_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding 2, in-process: notifications of the region's chunk without a MAC, with a
    forged one, or with a valid MAC of another identity complete nothing and are counted in
    the manager's ``unauthorized``; the writer's own arrival then completes the room."""
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        decode, handler = cluster.decode[0], cluster.handlers[0]
        request = cluster.add_request(505, num_pages=2, chunk_pages=2)
        (chunk,) = request.chunks()
        writer = cluster.writers[0]
        writer.prefetch(505, [(0, 2)], cluster.targets)
        assert wait_for(lambda: handler._rooms[505].regions)
        _, _, epoch = region_of(cluster, 505)
        session = handler.session_id
        identity = ChunkIdentity(505, 0, 0, 2, session, 0, epoch)
        other = ArrivalKeys(b"not the cluster's secret, 32 b!!")
        forged = [
            ChunkReady(505, 0, 0, 2, session),
            ChunkReady(505, 0, 0, 2, session, 0, epoch),
            ChunkReady(505, 0, 0, 2, session, 0, epoch, "0" * 16),
            ChunkReady(505, 0, 0, 2, session, 0, epoch, make_tag(identity, None, other)),
            ChunkReady(
                505,
                0,
                0,
                2,
                session,
                0,
                epoch,
                make_tag(identity._replace(room=9), None, ArrivalKeys(SECRET)),
            ),
        ]
        before = decode.unauthorized
        engine = decode.engine
        notes = [Notification("hostile", f.to_notification()) for f in forged]
        pending = [notes]  # handed over once, to whichever thread polls first
        monkeypatch.setattr(engine, "poll_notifications", lambda: pending.pop() if pending else [])
        staging_idle(decode)
        assert wait_for(lambda: decode.unauthorized - before == len(forged))
        monkeypatch.undo()  # the engine's own polling again (the secret was read already)
        assert decode.unauthorized - before == len(forged)
        assert handler.poll_room(505) is RoomStatus.TRANSFERRING
        writer.send_chunk(505, chunk, cluster.targets)
        assert cluster.wait_rooms([505]) == {505: [RoomStatus.SUCCESS]}
        assert pools_equal(cluster.decode_pools[0], cluster.expected_decode_pool(0))


def test_a_malformed_tag_is_counted_and_the_listener_keeps_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A notification whose tag is not one (with or without the secret) is malformed: counted
    as such, dropped, and the next arrivals are still delivered."""
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        decode, handler = cluster.decode[0], cluster.handlers[0]
        request = cluster.add_request(506, num_pages=2, chunk_pages=2)
        (chunk,) = request.chunks()
        session = handler.session_id.encode()
        bad = b"\x00".join([b"CHUNK_READY", b"506", b"0", b"0", b"2", session, b"0", b"0", b"xyz"])
        pending = [[Notification("peer", bad)]]
        monkeypatch.setattr(
            decode.engine, "poll_notifications", lambda: pending.pop() if pending else []
        )
        staging_idle(decode)
        assert wait_for(lambda: decode.staging_stats().malformed == 1)
        monkeypatch.undo()
        assert decode.unauthorized == 0
        cluster.writers[0].send_chunk(506, chunk, cluster.targets)
        assert cluster.wait_rooms([506]) == {506: [RoomStatus.SUCCESS]}


def test_the_tag_scheme() -> None:
    """Digests bind every field of the identity; the MAC binds the digest and the session's
    key; parse_tag splits what make_tag joins."""
    identity = ChunkIdentity(1, 2, 3, 4, "d", 5, 6)
    data = bytes(range(256)) * 4
    digest = chunk_digest(identity, data)
    assert len(digest) == 16
    changed = [
        identity._replace(room=7),
        identity._replace(chunk_idx=7),
        identity._replace(page_start=7),
        identity._replace(num_pages=7),
        identity._replace(session_id="e"),
        identity._replace(writer_rank=7),
        identity._replace(epoch=7),
    ]
    for other in changed:
        assert chunk_digest(other, data) != digest
    assert chunk_digest(identity, data[:-1] + b"\x00") != digest
    keys = ArrivalKeys(SECRET)
    tag = make_tag(identity, digest, keys)
    assert tag is not None
    assert parse_tag(tag) == (digest, tag.partition(":")[2])
    assert keys.authentic(identity, tag)
    assert not keys.authentic(identity, make_tag(identity, "f" * 16, None))
    assert not keys.authentic(identity, f"{'0' * 16}:{tag.partition(':')[2]}")
    assert make_tag(identity, digest, None) == digest
    assert make_tag(identity, None, None) is None
    assert parse_tag(make_tag(identity, None, keys)) == (None, keys.mac(identity, None))
    assert keys.key("a") != keys.key("b")
    assert "derived" in repr(keys)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, False),
        ("", False),
        ("1", True),
        ("on", True),
        (" TRUE ", True),
        ("0", False),
        ("off", False),
        ("false", False),
        ("no", False),
    ],
)
def test_the_integrity_setting(value: str | None, expected: bool) -> None:
    """STAGING_CONTRACTS_INTEGRITY: off by default (its cost), the usual words either way."""
    environ = {} if value is None else {INTEGRITY_ENV: value}
    assert integrity_enabled(None, environ) is expected
    assert integrity_enabled(None, {}) is DEFAULT_INTEGRITY
    assert integrity_enabled(not expected, environ) is (not expected)


def test_an_unreadable_integrity_setting_is_refused() -> None:
    """Anything else is a mistake, said at construction."""
    with pytest.raises(ValueError, match=r"^STAGING_CONTRACTS_INTEGRITY='maybe': use 1/on"):
        integrity_enabled(None, {INTEGRITY_ENV: "maybe"})
