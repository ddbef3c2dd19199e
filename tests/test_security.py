"""The authenticated control plane: the cluster secret, CURVE with ZAP, authorisation per room,
and hostile peers (one holding no key, one authenticated but not part of the room)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from staging_contracts import StagingReqOutcome
from staging_contracts._cluster.bootstrap import (
    BootstrapError,
    BootstrapServer,
    RankInfo,
    query_ranks,
    register_rank,
)
from staging_contracts._cluster.runner import run_cluster
from staging_contracts._control.room_messages import RoomFailed, RoomFence, RoomFenced
from staging_contracts._control.security import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    ControlSecurity,
    CurveKeys,
    SecurityError,
    check_insecure_bind,
    load_cluster_secret,
)
from staging_contracts._control.transport import Listener, PeerSockets
from staging_contracts._control.wire import ChunkReady, StagingReq, StagingRsp, WatermarkUpdate
from staging_contracts._decode.handler import DecodeStagingHandler, RoomStatus
from staging_contracts._decode.rooms import PrefillPeer, RoomPlan
from staging_contracts._run.workload import TransferConfig
from staging_contracts.backends._common import CommonKVManager, Role
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.engines import engine_available
from staging_contracts.engines.local import LocalEngine
from tests.local_cluster import Geometry, local_cluster, trust_each_other, wait_for
from tests.test_reliability import FAST, pages_match, region_bytes

SECRET = b"0123456789abcdef0123456789abcdef"


# --------------------------------------------------------------------------- the secret


def test_no_secret_in_the_environment_is_none() -> None:
    """Neither variable set: no secret."""
    assert load_cluster_secret({}) is None


def test_the_secret_comes_from_the_variable_or_the_file(tmp_path: Path) -> None:
    """The variable's value, or the named file's content, without surrounding white space."""
    assert load_cluster_secret({SECRET_ENV: " " + SECRET.decode() + "\n"}) == SECRET
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert load_cluster_secret({SECRET_FILE_ENV: str(path)}) == SECRET


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        ({SECRET_ENV: "x" * 16, SECRET_FILE_ENV: "/nowhere"}, r"^set STAGING_CONTRACTS_SECRET or"),
        ({SECRET_ENV: "short"}, r"^the cluster secret in STAGING_CONTRACTS_SECRET has 5 bytes"),
        ({SECRET_FILE_ENV: "/nonexistent/secret"}, r"^STAGING_CONTRACTS_SECRET_FILE='/nonex"),
    ],
)
def test_a_bad_secret_is_refused(environ: dict[str, str], match: str) -> None:
    """Both set, too short, or an unreadable file: a clear error."""
    with pytest.raises(SecurityError, match=match):
        load_cluster_secret(environ)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_binds_need_no_secret(host: str) -> None:
    """Loopback addresses are allowed without a secret."""
    check_insecure_bind(host, allow_insecure=False)


def test_a_non_loopback_bind_without_a_secret_is_refused() -> None:
    """Binding every interface unauthenticated needs the explicit opt-out."""
    with pytest.raises(SecurityError, match=r"^refusing to bind '0.0.0.0' without auth"):
        check_insecure_bind("0.0.0.0", allow_insecure=False)
    check_insecure_bind("0.0.0.0", allow_insecure=True)


def test_a_manager_refuses_a_non_loopback_bind_without_a_secret() -> None:
    """CommonKVManager applies the rule before binding anything."""
    with pytest.raises(SecurityError, match=r"^refusing to bind"):
        CommonKVManager(
            Geometry(1, 1, 2).kv_args(1, 0),
            role=Role.DECODE,
            attn_tp_size=1,
            engine=LocalEngine(),
            host="0.0.0.0",
            secret=None,
        )


def test_derived_keys_are_the_same_for_every_holder_of_the_secret() -> None:
    """Derivation is deterministic per label and differs between labels and secrets."""
    a = CurveKeys.derive(SECRET, "bootstrap-server")
    assert a == CurveKeys.derive(SECRET, "bootstrap-server")
    assert a != CurveKeys.derive(SECRET, "bootstrap-client")
    assert a != CurveKeys.derive(SECRET[::-1], "bootstrap-server")
    assert zmq.curve_public(a.secret) == a.public


# --------------------------------------------------------------------------- CURVE sockets


def test_a_listener_hears_only_trusted_peers_and_names_them() -> None:
    """A trusted key is delivered with its sender's endpoint; a stranger's key is refused
    by ZAP (and counted); a plain-TCP client never gets through."""
    server, friend = ControlSecurity(SECRET), ControlSecurity(SECRET)
    got: list[tuple[list[bytes], str | None]] = []
    listener = Listener(
        lambda frames: got.append((frames, listener.sender)), name="secure", security=server
    )
    friend_endpoint = "tcp://127.0.0.1:1"  # the friend's own listener, as it would publish it
    server.directory.trust(friend.keys.public, friend_endpoint)
    friend.directory.trust(server.keys.public, listener.endpoint)
    stranger = ControlSecurity(SECRET)  # knows the secret but was never trusted by the server
    stranger.directory.trust(server.keys.public, listener.endpoint)
    senders = [PeerSockets(security=s) for s in (friend, stranger)]
    plain: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    plain.setsockopt(zmq.LINGER, 0)
    try:
        with listener:
            for sockets, text in zip(senders, (b"friend", b"stranger"), strict=True):
                assert sockets.send(listener.endpoint, [b"HELLO", text])
            plain.connect(listener.endpoint)
            plain.send_multipart([b"HELLO", b"plain"])
            assert wait_for(lambda: len(got) == 1)
            assert wait_for(lambda: server.denied >= 1)
            time.sleep(0.3)
        assert got == [([b"HELLO", b"friend"], friend_endpoint)]
        assert server.denied >= 1
    finally:
        plain.close(linger=0)
        for sockets in senders:
            sockets.close()
        server.close()


def test_peer_sockets_never_send_in_the_clear_to_an_unknown_peer() -> None:
    """Without the peer's key a message is not sent: dropped and counted."""
    sockets = PeerSockets(security=ControlSecurity(SECRET))
    try:
        assert not sockets.send("tcp://127.0.0.1:9", [b"PING", b"x"])
        assert sockets.untrusted == 1
    finally:
        sockets.close()


# --------------------------------------------------------------------------- hostile peers


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every manager made in the test reads the cluster secret from the environment."""
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())


@pytest.mark.usefixtures("secret_env")
def test_forged_messages_from_an_authenticated_stranger_are_dropped_and_counted() -> None:
    """A participant that holds the secret and is trusted, but is not part of the room,
    forges every message kind to decode and to prefill: none fails a room, none lands, the
    room still succeeds bit-exact, and every forgery is counted."""
    g = Geometry(2, 1, 4)
    with local_cluster(g, timeouts=FAST) as cluster:
        rogue = LocalKVManager(g.kv_args(1, 0), role=Role.DECODE, attn_tp_size=1)
        try:
            trust_each_other(*cluster.prefill, *cluster.decode, rogue)
            rogue.start()
            decode, handler = cluster.decode[0], cluster.handlers[0]
            request = cluster.add_request(300, num_pages=2, chunk_pages=2)
            session = handler.session_id
            prefill_endpoint = cluster.prefill[0].endpoint
            to_decode = [
                StagingReq(300, 0, 2, session).to_frames(),
                ChunkReady(300, 0, 0, 2, session, 0).to_frames(),
                ChunkReady(300, 0, 0, 2, session).to_frames(),
                RoomFailed(300, "forged").to_frames(),
                RoomFenced(300, session, 0).to_frames(),
            ]
            for frames in to_decode:
                rogue.send(decode.endpoint, frames)
            assert wait_for(lambda: decode.unauthorized == len(to_decode) - 1)
            # (ROOM_FENCED for no fence is let through and ignored by the handler.)
            for writer in cluster.writers:
                writer.prefetch(300, [(0, 2)], cluster.targets)
            to_prefill = [
                StagingRsp(300, 0, 64, 0, 64 + 4096, session).to_frames(),
                WatermarkUpdate(9, 0, session).to_frames(),
                WatermarkUpdate(9, 0).to_frames(),
                RoomFence(300, session, rogue.endpoint, "forged").to_frames(),
                RoomFence(300, session, decode.endpoint, "forged").to_frames(),
            ]
            for frames in to_prefill:
                rogue.send(prefill_endpoint, frames)
            assert wait_for(lambda: cluster.prefill[0].unauthorized == len(to_prefill))
            assert handler.poll_room(300) is RoomStatus.TRANSFERRING
            cluster.send_all([request])
            assert cluster.wait_rooms([300])[300] == [RoomStatus.SUCCESS]
            assert pages_match(cluster, request)
            assert wait_for(lambda: handler.allocator.live_count == 0)
        finally:
            rogue.close()


@pytest.mark.usefixtures("secret_env")
def test_a_peer_holding_no_key_is_not_heard() -> None:
    """Plain TCP and a stranger's CURVE key both fail the handshake: their forgeries never
    reach the listener, and the stranger's refusal is counted."""
    g = Geometry(1, 1, 2)
    with local_cluster(g, timeouts=FAST) as cluster:
        decode, handler = cluster.decode[0], cluster.handlers[0]
        cluster.add_request(301, num_pages=2, chunk_pages=2)
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        plain = context.socket(zmq.PUSH)
        keyed = context.socket(zmq.PUSH)
        try:
            for sock in (plain, keyed):
                sock.setsockopt(zmq.LINGER, 0)
            CurveKeys.generate().connect_to(keyed, decode.curve_key or b"")
            for sock in (plain, keyed):
                sock.connect(decode.endpoint)
                sock.send_multipart(RoomFailed(301, "forged").to_frames())
            assert wait_for(lambda: decode.security is not None and decode.security.denied >= 1)
            time.sleep(0.3)
            # Not delivered at all: a delivered message without a trusted sender would have
            # been counted as unauthorized, and a handled ROOM_FAILED would fail the room.
            assert decode.unauthorized == 0
            assert handler.poll_room(301) is RoomStatus.REGISTERED
        finally:
            plain.close(linger=0)
            keyed.close(linger=0)


# --------------------------------------------------------------------------- the bootstrap


def _info(rank: int, endpoint: str, key: str = "") -> RankInfo:
    return RankInfo("decode", rank, endpoint, f"session-{rank}", b"meta", 0, 0, key)


@pytest.mark.usefixtures("secret_env")
def test_the_bootstrap_answers_only_holders_of_the_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the secret, registration and queries work; without it, or with another secret,
    the handshake fails and nothing is answered (the refusals are counted)."""
    server = BootstrapServer()
    server.start()
    try:
        assert server.authenticated
        register_rank(server.endpoint, _info(0, "tcp://127.0.0.1:7", "k" * 40))
        assert query_ranks(server.endpoint, "decode", 1, timeout=2)[0].curve_key == "k" * 40
        monkeypatch.delenv(SECRET_ENV)
        with pytest.raises(BootstrapError, match=r"did not answer"):
            query_ranks(server.endpoint, "decode", 1, timeout=0.5)
        monkeypatch.setenv(SECRET_ENV, "another secret of 32 characters!")
        with pytest.raises(BootstrapError, match=r"did not answer"):
            register_rank(server.endpoint, _info(1, "tcp://127.0.0.1:8"), timeout=0.5)
        # A client that knows the server's key (derived from the secret) but not the
        # secret's client key is refused by ZAP, and counted.
        stranger: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
        stranger.setsockopt(zmq.LINGER, 0)
        try:
            server_key = CurveKeys.derive(SECRET, "bootstrap-server").public
            CurveKeys.generate().connect_to(stranger, server_key)
            stranger.connect(server.endpoint)
            stranger.send(b'{"op": "query", "role": "decode", "count": 1}')
            assert stranger.poll(500) == 0
        finally:
            stranger.close(linger=0)
        assert server.denied >= 1
        assert [i.tp_rank for i in server.infos("decode")] == [0]
    finally:
        server.stop()


def test_a_bootstrap_entry_is_replaced_only_explicitly() -> None:
    """The same entry again is fine; another participant's needs replace=True."""
    server = BootstrapServer(secret=None)
    server.start()
    try:
        register_rank(server.endpoint, _info(0, "tcp://127.0.0.1:7"))
        register_rank(server.endpoint, _info(0, "tcp://127.0.0.1:7"))
        with pytest.raises(BootstrapError, match=r"already registered by another participant"):
            register_rank(server.endpoint, _info(0, "tcp://127.0.0.1:9"))
        assert server.infos("decode")[0].endpoint == "tcp://127.0.0.1:7"
        register_rank(server.endpoint, _info(0, "tcp://127.0.0.1:9"), replace=True)
        assert server.infos("decode")[0].endpoint == "tcp://127.0.0.1:9"
    finally:
        server.stop()


def test_a_non_loopback_bootstrap_without_a_secret_is_refused() -> None:
    """The bootstrap follows the same bind rule as the listeners."""
    with pytest.raises(SecurityError, match=r"^refusing to bind '0.0.0.0'"):
        BootstrapServer("0.0.0.0", secret=None)


def test_rank_info_carries_a_curve_key() -> None:
    """The key survives the JSON round trip; a malformed one is refused."""
    info = _info(3, "tcp://127.0.0.1:7", "a" * 40)
    assert RankInfo.from_json(info.to_json()) == info
    with pytest.raises(ValueError, match=r"curve_key must be 40 Z85 characters"):
        RankInfo.from_json({**info.to_json(), "curve_key": "short"})


@pytest.mark.nixl
@pytest.mark.skipif(not engine_available("nixl")[0], reason=engine_available("nixl")[1])
@pytest.mark.usefixtures("secret_env")
def test_a_multi_process_transfer_runs_with_curve_on() -> None:
    """Rank processes read the secret, publish their keys through the authenticated
    bootstrap, trust each other by them, and land every page bit for bit."""
    config = TransferConfig(
        backend="nixl",
        prefill_tp=2,
        decode_tp=1,
        kv_heads=2,
        layers=2,
        head_dim=16,
        tokens=48,
        page_size=4,
        requests=2,
        chunk_tokens=16,
        ring_chunks=2,
    )
    result = run_cluster(config, timeout_s=120)
    assert result.verified, result
    assert result.first_death is None


# --------------------------------------------------------------------------- ring share


def test_one_prefill_instance_cannot_pin_the_whole_ring(
    fake_prefills: tuple[list[str], list[zmq.Socket[bytes]]],
) -> None:
    """With a ring share of one half, an instance asking for more is deferred (not answered)
    while another instance still gets its region; the deferred request is answered once the
    first instance's own region frees."""
    g = Geometry(1, 1, 2)
    endpoints, _ = fake_prefills
    with local_cluster(g, ring_bytes=4 * region_bytes(g, 1)) as cluster:
        handler = cluster.handlers[0]
        handler._quota_bytes = 0.5 * handler.allocator.total_size
        sid = handler.session_id
        greedy = RoomPlan(310, (1, 2, 3), 1, 1, (PrefillPeer(0, endpoints[0]),))
        modest = RoomPlan(311, (4,), 1, 1, (PrefillPeer(0, endpoints[1]),))
        for plan in (greedy, modest):
            handler.register_room(plan)
        outcomes = [
            handler.handle_staging_req(310, c, num_pages=1, session_id=sid, pp_rank=None)
            for c in range(3)
        ]
        assert outcomes == [StagingReqOutcome.ALLOCATED] * 2 + [StagingReqOutcome.DEFERRED]
        modest_outcome = handler.handle_staging_req(
            311, 0, num_pages=1, session_id=sid, pp_rank=None
        )
        assert modest_outcome is StagingReqOutcome.ALLOCATED
        assert handler.allocator.live_count == 3
        handler.handle_chunk_arrival(
            310, 0, page_start=0, num_pages=1, session_id=sid, writer_rank=0
        )
        again = handler.handle_staging_req(310, 2, num_pages=1, session_id=sid, pp_rank=None)
        assert again is StagingReqOutcome.ALLOCATED


def test_a_ring_share_outside_zero_to_one_is_refused() -> None:
    """The share is a fraction of the ring."""
    with local_cluster(Geometry(1, 1, 2)) as cluster:
        manager = cluster.decode[0]
        with pytest.raises(ValueError, match=r"^ring_share=0 must be in \(0, 1\]$"):
            DecodeStagingHandler(
                allocator=cluster.handlers[0].allocator,
                kv_buffers=cluster.decode_pools[0],
                decode_tp=1,
                decode_rank=0,
                total_kv_heads=2,
                session_id="s",
                sender=manager.peers,
                ring_share=0,
            )


@pytest.fixture
def fake_prefills() -> Iterator[tuple[list[str], list[zmq.Socket[bytes]]]]:
    """Two PULL sockets standing in for two prefill instances' listeners."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sockets = [context.socket(zmq.PULL) for _ in range(2)]
    for sock in sockets:
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:*")
    endpoints = [str(s.getsockopt_string(zmq.LAST_ENDPOINT)) for s in sockets]
    try:
        yield endpoints, sockets
    finally:
        for sock in sockets:
            sock.close(linger=0)
