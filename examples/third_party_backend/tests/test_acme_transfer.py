"""A whole staged transfer through AcmeKVManager, with the kit's harness: in one process over
``LocalEngine``, and with a process per rank over NIXL (``over_nixl``)."""

from __future__ import annotations

import pytest
from acme_kv.backend import AcmeKVManager, over_nixl

from staging_contracts.engines import engine_available
from staging_contracts.testing import run_transfer

NIXL_OK, NIXL_WHY = engine_available("nixl")


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (4, 2)])
def test_rooms_land_bit_for_bit(prefill_tp: int, decode_tp: int) -> None:
    """Three multi-chunk rooms from prefill to decode; every decode page verified."""
    report = run_transfer(AcmeKVManager, prefill_tp=prefill_tp, decode_tp=decode_tp, rooms=3)
    assert report.ok, report.summary()
    assert all(room.arrivals == room.expected_arrivals for room in report.rooms)


@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_rooms_land_with_a_process_per_rank() -> None:
    """The same rooms, each rank in a process of its own, over a NIXL agent."""
    report = run_transfer(over_nixl, prefill_tp=2, decode_tp=1, rooms=3, processes=True)
    assert report.ok, report.summary()
    assert report.processes
    assert all(room.arrivals == room.expected_arrivals for room in report.rooms)
