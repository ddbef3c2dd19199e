"""ROOM_META for a room prefill has not opened yet (issue 24, finding 8): it creates no room
(it is held aside, bounded per sender, for the ROOM_META bound), and applies at open only if
it came from the decode rank it names."""

from __future__ import annotations

from staging_contracts._control.room_messages import RoomMeta
from staging_contracts._prefill.writer import DecodeTarget
from staging_contracts.backends._kv_requests import KVPoll, PrefillTransfers
from staging_contracts.protocols import KVArgs
from tests.test_kv_requests import FakeHost
from tests.test_prefill_writer import Clock, make_rig


class SenderHost(FakeHost):
    """A FakeHost whose messages come from ``sender`` (an authenticated peer's endpoint)."""

    def __init__(self, kv_args: KVArgs) -> None:
        super().__init__(kv_args)
        self.sender: str | None = None

    def message_sender(self) -> str | None:
        return self.sender


def rig_transfers(
    early_meta_per_peer: int = 256,
) -> tuple[SenderHost, PrefillTransfers, list[DecodeTarget]]:
    rig = make_rig(Clock())
    host = SenderHost(rig.geometry.kv_args(1, 0))
    transfers = PrefillTransfers(
        host, rig.writer, meta_timeout_s=60.0, early_meta_per_peer=early_meta_per_peer
    )
    return host, transfers, list(rig.targets)


def test_a_flood_of_room_meta_for_unopened_rooms_leaves_no_rooms_behind() -> None:
    """Main made a room for each (100k of them: +50 MiB); now none is made, at most the cap
    per sender is held, and the rest are counted as dropped."""
    host, transfers, _ = rig_transfers(early_meta_per_peer=64)
    try:
        on_meta = host.handlers[RoomMeta.KIND]
        for sender in ("tcp://decode:0", "tcp://rogue:9"):
            host.sender = sender
            for room in range(5000):
                on_meta(RoomMeta(room, 0, 2, 2).to_frames())
        assert transfers._rooms == {}
        assert transfers.status(7) == (KVPoll.Failed, "unknown room")
        assert transfers.early_meta_held == 10000
        assert transfers.early_meta_dropped == 2 * (5000 - 64)
        held = sum(len(h) for h in transfers._early.values())
        assert held == 2 * 64
        assert sum(len(s) for s in transfers._early_rooms.values()) == held
    finally:
        transfers.close()


def test_a_forged_early_room_meta_cannot_pre_fail_another_tenant_s_room() -> None:
    """An authenticated peer sends ROOM_META naming decode rank 0, with a page count that
    disagrees, before the room is opened: on main the room then failed at open ("decode
    expects 3 pages"); now the forgery is dropped at open and the room waits for its decode
    rank's own ROOM_META, which decode sent early too and which applies."""
    host, transfers, targets = rig_transfers()
    try:
        on_meta = host.handlers[RoomMeta.KIND]
        host.sender = "tcp://rogue:9"
        on_meta(RoomMeta(5, 0, 3, 2).to_frames())
        transfers.open_room(5, 2, targets)
        assert transfers.status(5) == (KVPoll.Bootstrapping, None)
        assert transfers.early_meta_dropped == 1
        host.sender = targets[0].endpoint
        on_meta(RoomMeta(6, 0, 2, 2).to_frames())  # decode quicker than KVSender.init
        transfers.open_room(6, 2, targets)
        assert transfers.status(6) == (KVPoll.WaitingForInput, None)
        assert transfers._early == {}
        assert transfers._early_rooms == {}
    finally:
        transfers.close()
