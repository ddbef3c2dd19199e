"""Liveness by identity (issue 24, finding 7): a PONG counts only for the authenticated peer
that sent it, whatever it names, and the sockets that named endpoints open are bounded."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from staging_contracts._control.liveness import PeerLiveness
from staging_contracts._control.room_messages import Ping, Pong
from staging_contracts._control.security import SECRET_ENV
from staging_contracts._control.transport import (
    DEFAULT_MAX_PEER_SOCKETS,
    PeerSockets,
    open_socket_count,
)
from staging_contracts.backends._common import Role
from staging_contracts.backends.local import LocalKVManager
from tests.local_cluster import Geometry, trust_each_other, wait_for

SECRET = b"0123456789abcdef0123456789abcdef"
G = Geometry(1, 1, 2)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())


@pytest.fixture
def managers(request: pytest.FixtureRequest) -> Iterator[list[LocalKVManager]]:
    """Three decode managers (a watcher, a peer that will die, a forger), started."""
    made = [LocalKVManager(G.kv_args(1, 0), role=Role.DECODE, attn_tp_size=1) for _ in range(3)]
    try:
        yield made
    finally:
        for manager in made:
            manager.close()


@pytest.mark.usefixtures("secret_env")
def test_a_peer_forging_pongs_for_a_dead_one_does_not_keep_it_alive(
    managers: list[LocalKVManager],
) -> None:
    """With the secret, an authenticated peer that sends PONG naming a dead peer (and PING
    with the dead peer as ``reply_to``) keeps it alive on main; now the dead peer is declared
    dead within the liveness bound, the forgeries are counted, and a live peer's own PONGs
    still keep it alive."""
    watcher, victim, forger = managers
    trust_each_other(watcher, victim, forger)
    watcher.liveness.interval_s = 0.1
    watcher.liveness.timeout_s = 0.5
    for manager in managers:
        manager.start()
    watcher.liveness.watch(victim.endpoint)
    watcher.liveness.watch(forger.endpoint)
    time.sleep(4 * watcher.liveness.timeout_s)  # real PONGs from live peers keep them alive
    assert not watcher.liveness.is_dead(victim.endpoint)
    assert not watcher.liveness.is_dead(forger.endpoint)
    victim.close()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and not watcher.liveness.is_dead(victim.endpoint):
        forger.send(watcher.endpoint, Pong(victim.endpoint).to_frames())
        forger.send(watcher.endpoint, Ping(victim.endpoint).to_frames())
        time.sleep(0.01)
    assert watcher.liveness.is_dead(victim.endpoint)
    assert watcher.liveness.forged > 0
    assert not watcher.liveness.is_dead(forger.endpoint)  # its own sign of life still counts


def test_a_forged_pong_counts_for_its_sender_only() -> None:
    """With ``identity``, a PONG naming another peer credits its real sender, not the named
    one, and a PING is answered at the sender, not at ``reply_to``."""
    sent: list[tuple[str, list[bytes]]] = []

    class Recording(PeerSockets):
        def send(self, endpoint: str, frames: object) -> bool:
            assert isinstance(frames, list)
            sent.append((endpoint, frames))
            return True

    clock = Clock()
    speaker: list[str | None] = ["tcp://forger:1"]
    liveness = PeerLiveness(
        Recording(), "tcp://me:1", timeout_s=2.0, clock=clock, identity=lambda: speaker[0]
    )
    liveness.watch("tcp://dead:1")
    liveness.watch("tcp://forger:1")
    clock.now += 1.5
    liveness.on_pong(Pong("tcp://dead:1").to_frames())
    liveness.on_ping(Ping("tcp://dead:1").to_frames())
    assert sent == [("tcp://forger:1", Pong("tcp://me:1").to_frames())]
    speaker[0] = None  # a sender the directory does not know: credits nobody
    liveness.on_pong(Pong("tcp://dead:1").to_frames())
    assert liveness.forged == 3
    clock.now += 1.0
    assert liveness.tick() == ["tcp://dead:1"]


def test_distinct_reply_to_values_open_at_most_the_cap_of_sockets() -> None:
    """Without a secret, 2000 PINGs with distinct ``reply_to`` opened 2000 sockets (up to
    ZMQ's 1023) on main; now at most the cap are ever open, and the answers still go out."""
    before = open_socket_count()
    manager = LocalKVManager(G.kv_args(1, 0), role=Role.DECODE, attn_tp_size=1, secret=None)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    flood = context.socket(zmq.PUSH)
    flood.setsockopt(zmq.LINGER, 0)
    try:
        manager.start()
        flood.connect(manager.endpoint)
        count = 2000
        for i in range(count):
            flood.send_multipart(Ping(f"tcp://127.0.0.1:{20000 + i}").to_frames())
        assert wait_for(lambda: manager.listener.stats().received >= count, timeout=30.0)
        assert open_socket_count() - before <= DEFAULT_MAX_PEER_SOCKETS + 1  # + its listener
        assert manager.listener.stats().errors == 0  # main: ZMQ ran out of sockets
        peers = manager.peers
        assert peers.peak <= DEFAULT_MAX_PEER_SOCKETS
        assert peers.open_count <= DEFAULT_MAX_PEER_SOCKETS
        assert peers.evicted >= count - DEFAULT_MAX_PEER_SOCKETS
    finally:
        flood.close(linger=0)
        manager.close()
    assert open_socket_count() == before


def test_peer_sockets_evict_the_least_recently_used_and_reap_idle_ones() -> None:
    """Past ``max_sockets`` the least recently used socket closes; one unused for ``idle_s``
    closes at the next send; a send to a closed peer reconnects."""
    clock = Clock()
    peers = PeerSockets(max_sockets=2, idle_s=10.0, clock=clock)
    before = open_socket_count()
    try:
        for port in (1, 2):
            assert peers.send(f"tcp://127.0.0.1:{29000 + port}", [b"x"])
        clock.now += 1
        assert peers.send("tcp://127.0.0.1:29001", [b"x"])  # 29001 is now the most recent
        assert peers.send("tcp://127.0.0.1:29003", [b"x"])  # evicts 29002
        assert peers.evicted == 1
        assert set(peers._sockets) == {"tcp://127.0.0.1:29001", "tcp://127.0.0.1:29003"}
        assert open_socket_count() - before == 2
        clock.now += 10.5  # both idle now
        assert peers.send("tcp://127.0.0.1:29002", [b"x"])
        assert peers.reaped == 2
        assert peers.open_count == 1
        assert peers.peak == 2
    finally:
        peers.close()
    assert open_socket_count() == before
    with pytest.raises(ValueError, match=r"^max_sockets=0 must be >= 1 and idle_s=1 > 0$"):
        PeerSockets(max_sockets=0, idle_s=1)
