"""The soak's ``flood`` fault: authenticated with the secret, and reported as it went.

With the cluster secret a flooder without a CURVE key is refused at the handshake, so its
flood tests nothing beyond it; the soak's flooder holds the secret (a key the target trusts),
its messages reach the dispatch, and the report says by which counter each was accounted for,
what the target holds after, and fails when a message went uncounted or state grew.
"""

from __future__ import annotations

import dataclasses
import random
import secrets

import pytest

from staging_contracts._cluster._messages import RankStatus
from staging_contracts._cluster.soak import run_soak
from staging_contracts._cluster.soak_flood import (
    COUNTERS,
    STATE,
    FloodTarget,
    flood_counts,
    state_bounds,
    unwanted_message,
)
from staging_contracts._cluster.soak_report import FloodRecord, SoakConfig, format_summary
from staging_contracts._control.room_messages import RoomMeta
from staging_contracts._control.security import SECRET_ENV, SECRET_FILE_ENV
from staging_contracts._control.wire import ChunkReady, StagingRsp

from .test_soak import passing_result


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_unwanted_flood_message_is_well_formed_and_names_no_room_in_flight(
    role: str,
) -> None:
    """The well-formed half of a flood decodes with its own codec (so it reaches the
    handler, not the malformed count), and names a room the soak never issued or one that
    closed."""
    rng = random.Random(3)
    target = FloodTarget("tcp://127.0.0.1:1", role, "decode-session", late_rooms=(1_000_007,))
    kinds = set()
    for _ in range(400):
        kind, frames = unwanted_message(target, rng)
        kinds.add(kind)
        if kind == "CHUNK_READY":
            ready = ChunkReady.from_frames(frames)
            assert ready.tag is None
            assert ready.room >= 1 << 40
        elif kind == "STAGING_RSP":
            answer = StagingRsp.from_frames(frames)
            assert answer.session_id == "decode-session"
            assert answer.room == 1_000_007
        else:
            assert RoomMeta.from_frames(frames).room >= 1 << 40
    assert kinds == ({"CHUNK_READY"} if role == "decode" else {"STAGING_RSP", "ROOM_META"})


def test_flood_counts_are_the_moves_of_each_counter() -> None:
    before = RankStatus(1, True, listener_malformed=5, unauthorized=1)
    after = RankStatus(2, True, listener_malformed=105, unauthorized=51, early_meta_held=7)
    counts = flood_counts(before, after)
    assert set(counts) == set(COUNTERS)
    assert counts["listener_malformed"] == 100
    assert counts["unauthorized"] == 50
    assert counts["early_meta_held"] == 7
    assert counts["staging_dropped"] == 0


def _flood(**changes: object) -> FloodRecord:
    record = FloodRecord(
        "prefill 0",
        5.0,
        20000,
        20000,
        0.8,
        True,
        {"malformed": 10000, "STAGING_RSP": 5000, "ROOM_META": 5000},
        {"listener_malformed": 10000, "unauthorized": 5000, "early_meta_held": 5000},
        {"answers_held": 4, "early_meta": 256, "open_rooms": 2},
        state_bounds(4, 4, 1),
    )
    return dataclasses.replace(record, **changes)  # type: ignore[arg-type]


def test_a_flood_that_was_counted_and_left_state_bounded_passes_and_is_reported() -> None:
    result = passing_result(floods=(_flood(),))
    assert result.ok, result.problems
    text = format_summary(result)
    assert "prefill 0 at 5.0 s, authenticated (CURVE, a trusted key): 20000 messages" in text
    assert "listener_malformed +10000, unauthorized +5000, early_meta_held +5000" in text
    assert "early_meta 256 (bound 264)" in text


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"counted": 0}, "20000 flood messages to prefill 0 not counted"),
        (
            {"state": {"answers_held": 20000, "early_meta": 0, "open_rooms": 0}},
            "the flood grew state on prefill 0: answers_held 20000 > 32",
        ),
        (
            {"state": {"answers_held": 0, "early_meta": 5000, "open_rooms": 0}},
            "early_meta 5000 > 264",
        ),
    ],
)
def test_a_flood_left_uncounted_or_that_grew_state_fails_the_soak(
    changes: dict[str, object], problem: str
) -> None:
    result = passing_result(floods=(_flood(**changes),))
    assert not result.ok
    assert len(result.problems) == 1
    assert problem in result.problems[0]
    assert "FAIL" in format_summary(result).splitlines()[-1]


def test_a_flood_with_the_secret_is_authenticated_counted_and_leaves_state_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the secret a flood of a decode and a prefill rank goes through CURVE with a key
    each trusts: every message reaches the dispatch (none is refused at the handshake), the
    well-formed ones are refused by an authoriser (``unauthorized``) or held within the
    sender's cap (``early_meta_held``), and the answer table and the early ROOM_META store
    stay within their bounds."""
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, secrets.token_hex(32))
    config = SoakConfig(duration_s=1.0, faults=("flood",), settle_s=0.5, room_bound_s=30.0)
    result = run_soak(config, progress=print)
    print(format_summary(result))

    decode, prefill = result.floods
    assert (decode.target, prefill.target) == ("decode 0", "prefill 0")
    for flood in (decode, prefill):
        assert flood.authenticated
        assert flood.sent == config.flood_frames
        assert flood.counted >= flood.sent, flood
        assert flood.counted_by["listener_malformed"] > 0
        assert flood.counted_by["unauthorized"] > 0  # reached the authorisers: past CURVE
        assert set(flood.state) == (set(STATE) if flood is prefill else {"open_rooms"})
        assert flood.grown == []
    assert decode.counted_by["unauthorized"] >= decode.sent_by_kind["CHUNK_READY"]
    assert prefill.counted_by["early_meta_held"] >= prefill.sent_by_kind["ROOM_META"]
    assert prefill.state["early_meta"] <= prefill.state_bounds["early_meta"]
    assert result.corrupt == 0
    assert result.hung == 0
    assert result.ok, result.problems
