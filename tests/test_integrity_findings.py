"""Issue 24, findings 1 and 2 in-process (over ``LocalKVManager``): each fails on the code
before integrity tags, so they import nothing that code lacks.

* Finding 1: a write that lands in a region over its writer's bytes (a paused writer's late
  write) made the room report SUCCESS with wrong bytes; now it fails with ``integrity``.
* Finding 2: with the secret set, a notification anyone can send completed a chunk before any
  byte landed; now it is dropped and counted in the manager's ``unauthorized``.

The same through real NIXL processes (a real ``SIGSTOP``, a real hostile agent) is in
``test_integrity_nixl.py``.
"""

from __future__ import annotations

import pytest

from staging_contracts._control.security import SECRET_ENV
from staging_contracts._decode.handler import RoomStatus
from staging_contracts.backends._staging_setup import staging_idle
from staging_contracts.protocols import Notification
from tests.integrity_helpers import land_first_then_late_then_second
from tests.local_cluster import Geometry, local_cluster, pools_equal, wait_for

SECRET = "integrity findings: a secret of 32"
INTEGRITY_ENV = "STAGING_CONTRACTS_INTEGRITY"
"""Integrity is off by default (its cost, README): these tests turn it on (a name the code
before it ignores)."""


def test_a_late_write_into_a_region_fails_the_room_with_integrity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding 1, in-process: bytes that land over a writer's after it wrote (a writer
    declared dead whose write was in flight) are caught before SUCCESS: the room fails, and
    its reason says integrity."""
    monkeypatch.setenv(INTEGRITY_ENV, "1")
    with local_cluster(Geometry(2, 1, 4)) as cluster:
        handler = cluster.handlers[0]
        cluster.add_request(501, num_pages=2, chunk_pages=2)
        land_first_then_late_then_second(cluster, 501)
        assert cluster.wait_rooms([501]) == {501: [RoomStatus.FAILED]}
        failure = handler.room_failure(501)
        assert failure is not None
        assert failure.startswith("integrity: chunk 0: the bytes of prefill writer rank 0")
        cluster.release([501])
        assert handler.allocator.live_count == 0


def test_with_the_secret_a_forged_notification_completes_no_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A notification of the room's chunk from someone holding no secret (what any agent
    with decode's engine metadata can send) is dropped and counted; the room completes only
    when its writer's bytes landed, bit-exact."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        decode, handler = cluster.decode[0], cluster.handlers[0]
        request = cluster.add_request(601, num_pages=2, chunk_pages=2)
        (chunk,) = request.chunks()
        writer = cluster.writers[0]
        writer.prefetch(601, [(0, 2)], cluster.targets)
        assert wait_for(lambda: handler._rooms[601].regions)
        session = handler.session_id.encode()
        forged = b"\x00".join([b"CHUNK_READY", b"601", b"0", b"0", b"2", session, b"0"])
        pending = [[Notification("hostile-agent", forged)]]
        monkeypatch.setattr(
            decode.engine, "poll_notifications", lambda: pending.pop() if pending else []
        )
        staging_idle(decode)
        assert wait_for(lambda: decode.unauthorized == 1, timeout=2)
        monkeypatch.undo()  # the engine's own polling again (the secret was read already)
        assert handler.poll_room(601) is RoomStatus.TRANSFERRING
        writer.send_chunk(601, chunk, cluster.targets)
        assert cluster.wait_rooms([601]) == {601: [RoomStatus.SUCCESS]}
        assert pools_equal(cluster.decode_pools[0], cluster.expected_decode_pool(0))
