"""The soak's ``forge`` fault over Mooncake: a hostile engine's one-sided writes.

Over Mooncake arrivals are ``CHUNK_READY`` control messages (authenticated with the secret),
but a hostile Mooncake engine that holds a decode rank's engine metadata (its session id, as
published) can still write one-sidedly into that rank's staging ring, with no arrival at all.
The soak's ``forge`` has one in the driver overwrite the whole ring with garbage for a while,
through real rank processes over Mooncake TCP: with the integrity check on (the fault turns it
on), a room whose region was overwritten before its check fails with reason ``integrity``,
and none reports success with those bytes (each success is checked bit for bit). With the
check off, the same writes pass as success: the soak finds corrupt rooms.
"""

from __future__ import annotations

import secrets

import pytest

from staging_contracts._cluster.soak import run_soak
from staging_contracts._cluster.soak_report import SoakConfig, format_summary
from staging_contracts._control.security import SECRET_ENV, SECRET_FILE_ENV
from staging_contracts.engines import engine_available

MOONCAKE_OK, MOONCAKE_WHY = engine_available("mooncake")
pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(not MOONCAKE_OK, reason=MOONCAKE_WHY)]


def forge_config() -> SoakConfig:
    return SoakConfig(
        backend="mooncake", duration_s=1.0, faults=("forge",), settle_s=1.0, room_bound_s=30.0
    )


def test_the_forge_fault_turns_the_integrity_check_on_in_every_rank() -> None:
    assert forge_config().rank_settings().body.integrity is True


def test_hostile_mooncake_writes_over_decodes_ring_fail_rooms_with_integrity_never_succeed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, secrets.token_hex(32))
    result = run_soak(forge_config(), progress=print)
    print(format_summary(result))

    (forge,) = result.forges
    assert forge.kind == "write"
    assert forge.target == "decode 0"
    assert forge.sent > 0  # hostile writes landed
    assert forge.bytes_written >= forge.sent
    assert forge.integrity_failed > 0, forge  # overwritten regions failed their rooms
    assert result.failed_by_reason.get("integrity", 0) >= forge.integrity_failed
    assert result.corrupt == 0, result.corrupt_details
    assert result.hung == 0, result.hung_details
    assert result.rooms_succeeded > 0
    assert result.ok, result.problems
    assert "hostile writes" in format_summary(result)


def test_without_the_integrity_check_the_hostile_writes_pass_as_success(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same fault with the check forced off: rooms report success with the garbage
    (the soak finds them corrupt), so the test above can fail."""
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv("STAGING_CONTRACTS_INTEGRITY", "0")
    monkeypatch.setattr(SoakConfig, "integrity", property(lambda self: False))
    config = forge_config()
    assert config.rank_settings().body.integrity is None  # each rank reads the variable: off
    result = run_soak(config, progress=print)
    print(format_summary(result))

    (forge,) = result.forges
    assert forge.sent > 0
    assert forge.integrity_failed == 0
    assert result.corrupt > 0
    assert not result.ok
