"""Rank⇄driver traffic is typed: dataclasses on one codec (``_run/_codec.py``), the cluster's
(``_cluster/_messages.py``) and the harness's (``testing/_rank_steps.py``) alike, read back
exactly or refused; no two message classes share a name; and no ``dict[str, Any]`` left in
the tooling but the JSON documents it builds."""

from __future__ import annotations

import enum
import json
import types
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Final, Union, get_args, get_origin, get_type_hints

import pytest

from staging_contracts._cluster._messages import (
    Exit,
    OpenRoom,
    Peers,
    RankMemory,
    RankStatus,
    RankSummary,
    RoomEnded,
    Stop,
)
from staging_contracts._cluster.bootstrap import RankInfo
from staging_contracts._control.wire import MalformedMessage
from staging_contracts._run._codec import Message, RankEvent, decode, encode, rank_event
from staging_contracts.backends._kv_requests import KVPoll
from staging_contracts.stats import StagingStats
from staging_contracts.testing._rank_steps import (
    Close,
    DecodeReport,
    DecodeReported,
    Joined,
    PrefillReported,
    ProcessLocal,
    Settled,
    Wire,
)

PACKAGE: Final = Path(__file__).resolve().parent.parent / "src" / "staging_contracts"
TOOLING: Final = ("_run", "_cluster", "_bench", "testing")
UNTYPED_ALLOWED: Final = {
    "_cluster/bootstrap.py": "the bootstrap wire protocol (cross-host, hostile input): its own "
    "strict JSON validator reads request fields from the parsed document",
    "_run/_rank_info.py": "RankInfo's JSON document for that protocol, every field checked",
    "_cluster/summary_json.py": "builds the --json summary documents",
    "_cluster/logformat.py": "builds a JSON log line",
    "_bench/scaling.py": "the scaling run's JSON document and its machine facts",
    "_bench/contract_bench.py": "the namespace of a class the benchmark makes",
    "testing/plugin.py": "the namespace of a class the contract kit makes",
}
"""Modules of the tooling that may still say ``dict[str, Any]``, and why: none of them
carries rank⇄driver (or harness rank⇄parent) traffic."""


def test_no_untyped_dicts_in_rank_driver_traffic() -> None:
    modules = [p for d in TOOLING for p in (PACKAGE / d).glob("*.py")]
    assert len(modules) > 40, "the tooling's modules are not where this test looks"
    found = {
        p.relative_to(PACKAGE).as_posix() for p in modules if "dict[str, Any]" in p.read_text()
    }
    assert found == set(UNTYPED_ALLOWED), (
        f"untyped: {sorted(found - set(UNTYPED_ALLOWED))}, "
        f"allowed but typed now: {sorted(set(UNTYPED_ALLOWED) - found)}"
    )


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
    Joined(RankInfo("prefill", 0, "tcp://127.0.0.1:8", "s", b"", 0, 0), notifies=True),
    Settled(((KVPoll.Success, None), (KVPoll.Failed, "boom"))),
    DecodeReported(DecodeReport([[True, False], []], [2, 0], {9, 3}, StagingStats(received=4))),
    PrefillReported(StagingStats(malformed=1, deferred=2)),
    ProcessLocal("LocalEngine moves bytes within one process"),
    Wire(()),
    Close(),
)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_reads_back_as_it_was_sent(message: Message) -> None:
    event = decode(encode(message, "prefill", 3, pid=42))
    assert (event.message, event.role, event.rank, event.pid) == (message, "prefill", 3, 42)
    assert repr(event.message) == repr(message)  # an IntEnum equals its int: repr tells them apart
    command = decode(encode(message))
    assert (command.message, command.role, command.rank, command.pid) == (message, None, None, None)


@dataclass(frozen=True, slots=True)
class _EveryForm(Message):
    """A message of every form the codec reads (no package message has them all)."""

    by_state: dict[KVPoll, int]
    by_room: dict[int, str]
    frozen: frozenset[int]
    mixed: set[int | None]
    points: list[tuple[float, KVPoll]]
    by_name: dict[str, int]
    either: tuple[int | str, ...]
    maybe: RankInfo | None = None


def test_every_form_reads_back_with_its_types() -> None:
    message = _EveryForm(
        by_state={KVPoll.Success: 2, KVPoll.Failed: 0},
        by_room={7: "a", -1: "b"},
        frozen=frozenset({10, 9}),
        mixed={None, 3},
        points=[(1, KVPoll.Bootstrapping), (2.5, KVPoll.Success)],
        by_name={"a": 1, "7": 2},
        either=(3, "three"),
    )
    got = decode(encode(message)).message
    assert got == message
    assert repr(got) == repr(message).replace("(1, ", "(1.0, ")  # a float field takes an int


_READ: Final = (str, int, float, bool, type(None))


def _readable(hint: object, where: str) -> list[str]:
    """What in ``hint`` the codec cannot read back (``[]``: all of it)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType, tuple, list, set, frozenset):
        return [bad for arg in args if arg is not Ellipsis for bad in _readable(arg, where)]
    if origin is dict:
        keys = [] if args[0] in (str, int) or _int_enum(args[0]) else [f"{where}: key {args[0]}"]
        return keys + _readable(args[1], where)
    if hint in _READ or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return []
    if isinstance(hint, type) and hasattr(hint, "from_json") and hasattr(hint, "to_json"):
        return []
    if isinstance(hint, type) and is_dataclass(hint):
        return [
            bad
            for name, inner in get_type_hints(hint).items()
            if name in {f.name for f in fields(hint)}
            for bad in _readable(inner, f"{hint.__name__}.{name}")
        ]
    return [f"{where}: {hint}"]


def _int_enum(hint: object) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.IntEnum)


def test_every_field_of_every_message_is_of_a_type_the_codec_reads_back() -> None:
    """No ``Any``, ``object``, ``Mapping`` or odd ``dict`` key hides in a message: what a rank
    sends its driver is typed all the way down, and decodes to what was sent."""
    kinds = dict(Message.KINDS)
    assert {"RankSummary", "RankStatus", "Joined", "DecodeReported", "Failure"} <= set(kinds)
    unreadable = [bad for kind in kinds.values() for bad in _readable(kind, kind.__name__)]
    assert unreadable == []


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
        (_doc("Settled", {"outcomes": [[7, None]]}), "7 is not a KVPoll"),
        (_doc("Settled", {"outcomes": [[True, None]]}), "True is not a KVPoll"),
        (_doc("PrefillReported", {"stats": {"received": 1.5}}), "1.5 is not int"),
        (
            _doc(
                "DecodeReported",
                {"report": {"chunks_ok": {}, "arrivals": [], "stray": [], "stats": {}}},
            ),
            "is not a list",
        ),
        (_doc("Stop", {}, role="decode", rank=0, pid="1"), "is not"),
    ],
)
def test_a_malformed_message_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(MalformedMessage, match=why):
        decode(raw)


def test_a_second_message_class_of_a_known_name_is_refused() -> None:
    """The codec knows a message by its class name: a clash would decode as the other class."""
    with pytest.raises(TypeError, match=r"message kind 'Stop' is already .*_messages\.Stop"):

        @dataclass(frozen=True, slots=True)
        class Stop(Message):
            pass


def test_a_set_goes_as_a_sorted_list() -> None:
    raw = encode(DecodeReported(DecodeReport([], [], {5, 1, 3}, StagingStats())))
    assert json.loads(raw)["body"]["report"]["stray"] == [1, 3, 5]


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"id": 1, "listener_alive": True, "rss": "x"}, "'x' is not a list"),
        ({"id": 1, "listener_alive": True, "rss": [[1.0]]}, "[1.0] does not have 2 items"),
        ({"id": 1, "listener_alive": True, "rss": [[1.0, 2.5]]}, "2.5 is not int"),
    ],
)
def test_a_refusal_names_the_value_and_the_message_type(body: object, why: str) -> None:
    """Each refusal says what was wrong in words, and which message it was reading."""
    with pytest.raises(MalformedMessage) as refused:
        decode(_doc("RankStatus", body))
    assert (refused.value.reason, refused.value.message_type) == (why, "RankStatus")


def test_a_refused_sender_and_a_refused_body_say_which_and_of_what() -> None:
    with pytest.raises(MalformedMessage) as refused:
        decode(_doc("Stop", {}, role="decode"))
    assert (refused.value.reason, refused.value.message_type) == (
        "a sender needs both role and rank",
        "Stop",
    )
    with pytest.raises(MalformedMessage) as refused:
        decode(_doc("RankSummary", {"failed": []}))
    assert refused.value.reason == "[] is not an object"
    long = b"[" + b"1, " * 100 + b"1]"
    with pytest.raises(MalformedMessage) as refused:
        decode(long)
    assert refused.value.reason == f"not a rank message: {long[:80]!r}"


def test_a_driver_takes_only_well_formed_events_that_name_their_sender(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A driver's inbox reads an event with its whole sender, and drops (with a warning, not
    an exception) bytes that do not decode and a message that names no sender."""
    got = rank_event(encode(Exit(ok=True), "decode", 3, pid=4242))
    assert got == RankEvent(Exit(ok=True), "decode", 3, 4242)
    assert got.key == ("decode", 3)
    with caplog.at_level("WARNING", logger="staging_contracts._run._codec"):
        assert rank_event(b"{not json") is None
        assert rank_event(encode(Stop())) is None
        no_pid = json.dumps({"kind": "Stop", "role": "decode", "rank": 0, "body": {}}).encode()
        assert rank_event(no_pid) is None
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "malformed event from a rank dropped",
        "event without a sender dropped",
        "event without a sender dropped",
    ]
