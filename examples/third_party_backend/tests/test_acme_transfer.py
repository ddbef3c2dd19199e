"""A whole staged transfer through AcmeKVManager, with the kit's harness."""

from __future__ import annotations

import pytest
from acme_kv.backend import AcmeKVManager

from staging_contracts.testing import run_transfer


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (4, 2)])
def test_rooms_land_bit_for_bit(prefill_tp: int, decode_tp: int) -> None:
    """Three multi-chunk rooms from prefill to decode; every decode page verified."""
    report = run_transfer(AcmeKVManager, prefill_tp=prefill_tp, decode_tp=decode_tp, rooms=3)
    assert report.ok, report.summary()
    assert all(room.arrivals == room.expected_arrivals for room in report.rooms)
