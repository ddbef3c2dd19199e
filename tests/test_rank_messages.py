"""Rank⇄driver traffic is typed: dataclasses on one codec (``_cluster/_messages.py``), read back
exactly or refused, and no ``dict[str, Any]`` left in the cluster's modules but the JSON
documents they build."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

import pytest

from staging_contracts._cluster._messages import (
    Exit,
    Message,
    OpenRoom,
    Peers,
    RankMemory,
    RankStatus,
    RankSummary,
    RoomEnded,
    Stop,
    decode,
    encode,
)
from staging_contracts._cluster.bootstrap import RankInfo
from staging_contracts._control.wire import MalformedMessage

CLUSTER: Final = Path(__file__).resolve().parent.parent / "src" / "staging_contracts" / "cluster"
UNTYPED_ALLOWED: Final = {
    "bootstrap.py": "the bootstrap wire protocol (cross-host, hostile input): its own strict "
    "JSON validator reads request fields from the parsed document",
    "summary_json.py": "builds the --json summary documents",
    "logformat.py": "builds a JSON log line",
}
"""Modules of ``cluster/`` that may still say ``dict[str, Any]``, and why: none of them
carries rank⇄driver traffic."""


def test_no_untyped_dicts_in_rank_driver_traffic() -> None:
    found = {p.name for p in CLUSTER.glob("*.py") if "dict[str, Any]" in p.read_text()}
    assert found <= set(UNTYPED_ALLOWED), sorted(found - set(UNTYPED_ALLOWED))


SAMPLES: Final[tuple[Message, ...]] = (
    RankSummary(
        ok=True,
        failed={1: "boom", 2: None},
        rooms={0: True},
        room_done_s={0: 1.5},
        succeeded=(0,),
        memory=RankMemory(10, "timed requests", 9, None),
    ),
    RankStatus(3, True, rss=((1.0, 2048),), ring_live_count=0, answers_held=None),
    Peers((RankInfo("decode", 1, "tcp://127.0.0.1:9", "s", b"\x00meta", 4096, 64),)),
    OpenRoom(7, 2, instance=1),
    RoomEnded(7, 2, "ok", 12.5, verified=True, problems=("page 3 differs",)),
    Exit(False, "RuntimeError: x"),
    Stop(),
)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_reads_back_as_it_was_sent(message: Message) -> None:
    event = decode(encode(message, "prefill", 3, pid=42))
    assert (event.message, event.role, event.rank, event.pid) == (message, "prefill", 3, 42)
    command = decode(encode(message))
    assert (command.message, command.role, command.rank, command.pid) == (message, None, None, None)


def _doc(kind: str, body: object, **head: object) -> bytes:
    return json.dumps({"kind": kind, "body": body, **head}).encode()


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a rank message"),
        (_doc("Nope", {}), "not a rank message"),
        (_doc("OpenRoom", {"room": "7", "index": 1}), "'7' is not int"),
        (_doc("OpenRoom", {"room": True, "index": 1}), "True is not int"),
        (_doc("OpenRoom", {"room": 7}), "field 'index' missing"),
        (_doc("OpenRoom", [7, 1]), "is not an object"),
        (_doc("RankSummary", {"failed": {"x": "boom"}}), "invalid literal"),
        (_doc("Peers", {"ranks": [{"role": "decode"}]}), "bad rank info"),
        (_doc("Stop", {}, role="decode"), "both role and rank"),
        (_doc("Stop", {}, role="decode", rank=0, pid="1"), "is not"),
    ],
)
def test_a_malformed_message_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(MalformedMessage, match=why):
        decode(raw)
