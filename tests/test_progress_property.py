"""Liveness as a property: any number of rooms, any chunk order, any writer interleaving and
any ring of at least one chunk region, every room completes (or fails with a reason); none
waits forever. Over the local engine, real ZMQ sockets and the per-request API."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staging_contracts._prefill.writer import PrefillTimeouts
from staging_contracts.backends._kv_requests import KVPoll, KVReceiver, KVSender
from tests.local_cluster import Geometry, sides, wait_for, wait_states
from tests.test_reliability import pages_match, region_bytes

TIMEOUTS = PrefillTimeouts(answer_s=0.05, ready_s=0.05, deadline_s=10.0)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[tuple[int, int], list[int], int, int, list[int]]:
    """(TP pair, chunks per room, ring regions, chunk pages, seed for the interleavings)."""
    tp = draw(st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2)]))
    chunks = draw(st.lists(st.integers(1, 4), min_size=1, max_size=6))
    ring_regions = draw(st.integers(1, 4))
    chunk_pages = draw(st.integers(1, 2))
    seeds = draw(st.lists(st.integers(0, 2**16), min_size=tp[0], max_size=tp[0]))
    return tp, chunks, ring_regions, chunk_pages, seeds


def interleave(rooms: list[int], chunks: list[int], seed: int) -> list[tuple[int, int]]:
    """A random interleaving of every room's chunks, each room's in order."""
    rng = random.Random(seed)
    left = {room: list(range(n)) for room, n in zip(rooms, chunks, strict=True)}
    order = []
    while left:
        room = rng.choice(sorted(left))
        order.append((room, left[room].pop(0)))
        if not left[room]:
            del left[room]
    return order


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(scenarios())
def test_every_room_completes_whatever_the_order_and_the_ring(
    scenario: tuple[tuple[int, int], list[int], int, int, list[int]],
) -> None:
    """Every room lands bit-exact on every decode rank and the rings end empty."""
    (prefill_tp, decode_tp), chunks, ring_regions, chunk_pages, seeds = scenario
    g = Geometry(prefill_tp, decode_tp, 4, pool_pages=2 * sum(chunks) * chunk_pages + 8)
    ring = ring_regions * max(region_bytes(g, chunk_pages), 1)
    with sides(g, ring_bytes=ring, timeouts=TIMEOUTS) as s:
        c = s.cluster
        requests = [
            c.add_request(200 + i, num_pages=n * chunk_pages, chunk_pages=chunk_pages, seed=i)
            for i, n in enumerate(chunks)
        ]
        receivers = []
        for request in requests:
            for d, transfers in enumerate(s.decode):
                c.handlers[d].release_room(request.room)
                receiver = KVReceiver(transfers, request.room)
                receiver.init(request.decode_pages, chunk_pages=chunk_pages)
                receivers.append(receiver)
        senders = {
            (p, r.room): KVSender(t, r.room) for p, t in enumerate(s.prefill) for r in requests
        }
        for (_, room), sender in senders.items():
            request = next(r for r in requests if r.room == room)
            sender.init(request.num_pages, c.targets)
        for receiver in receivers:
            receiver.send_metadata()
        assert wait_for(
            lambda: all(x.poll() is KVPoll.WaitingForInput for x in senders.values()),
            timeout=10,
        )
        by_room = {r.room: r for r in requests}
        for p, seed in enumerate(seeds):
            order = interleave([r.room for r in requests], chunks, seed)
            for room, index in order:
                request = by_room[room]
                pages = request.prefill_pages[index * chunk_pages : (index + 1) * chunk_pages]
                last = index == len(request.chunks()) - 1
                senders[(p, room)].send(pages, last=last)
        states = wait_states(list(senders.values()), timeout=60)
        failures = [x.failure() for x in senders.values() if x.failure()]
        assert states == [KVPoll.Success] * len(senders), failures
        assert wait_states(receivers, timeout=20) == [KVPoll.Success] * len(receivers)
        for d in range(decode_tp):
            assert all(pages_match(c, request, rank=d) for request in requests)
            assert c.handlers[d].allocator.live_count == 0
