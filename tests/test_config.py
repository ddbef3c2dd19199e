"""Every ``STAGING_CONTRACTS_*`` setting of ``config.SETTINGS`` reaches its constructor
argument; an explicit argument wins; a bad value fails at construction, naming itself; the
table of docs/operating.md is the code's."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from staging_contracts import config
from staging_contracts._control.liveness import PeerLiveness
from staging_contracts._control.transport import PeerSockets
from staging_contracts._decode.handler import DecodeStagingHandler
from staging_contracts._prefill.writer import PrefillTimeouts
from staging_contracts.backends._common import Role
from staging_contracts.backends._kv_requests import PrefillTransfers
from staging_contracts.backends._staging_setup import enable_decode_staging, enable_prefill_staging
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.config import SETTINGS, ConfigError, Setting
from tests.local_cluster import Geometry

REPO: Final = Path(__file__).resolve().parent.parent
GEOMETRY: Final = Geometry(1, 1, 2)
SMALL_RING: Final = 1 << 16

Build = Callable[[Any], Any]
"""``build(explicit)``: construct the object with the argument (``None``: not given) and
return the value it took for it."""


def _kwargs(arg: str, explicit: Any) -> dict[str, Any]:
    return {} if explicit is None else {arg: explicit}


def _liveness(arg: str) -> Build:
    def build(explicit: Any) -> Any:
        sockets = PeerSockets()
        try:
            liveness = PeerLiveness(sockets, "tcp://127.0.0.1:1", **_kwargs(arg, explicit))
            return getattr(liveness, arg)
        finally:
            sockets.close()

    return build


def _decode(arg: str, read: Callable[[DecodeStagingHandler], Any]) -> Build:
    def build(explicit: Any) -> Any:
        manager = LocalKVManager(GEOMETRY.kv_args(1, 0), role=Role.DECODE, attn_tp_size=1)
        try:
            kwargs: dict[str, Any] = {} if arg == "ring_bytes" else {"ring_bytes": SMALL_RING}
            handler = enable_decode_staging(
                manager, kv_buffers=GEOMETRY.empty_pool(1, 0), **kwargs, **_kwargs(arg, explicit)
            )
            return read(handler)
        finally:
            manager.close()

    return build


def _timeouts(arg: str) -> Build:
    return lambda explicit: getattr(PrefillTimeouts(**_kwargs(arg, explicit)), arg)


def _transfers(arg: str, read: Callable[[PrefillTransfers], Any]) -> Build:
    def build(explicit: Any) -> Any:
        manager = LocalKVManager(GEOMETRY.kv_args(1, 0), role=Role.PREFILL, attn_tp_size=1)
        try:
            writer = enable_prefill_staging(
                manager, kv_buffers=GEOMETRY.empty_pool(1, 0), max_chunk_pages=2
            )
            transfers = PrefillTransfers(manager, writer, **_kwargs(arg, explicit))
            try:
                return read(transfers)
            finally:
                transfers.close()
        finally:
            manager.close()

    return build


def _share(handler: DecodeStagingHandler) -> float:
    quota = handler._quota_bytes
    return 1.0 if quota is None else quota / handler.allocator.total_size


@dataclass(frozen=True)
class Probe:
    """How to see one setting reach its argument."""

    build: Build
    raw: str
    """A valid value of the variable, other than the default."""
    value: Any
    """What ``raw`` means."""
    explicit: Any
    """An argument, other than both, that must win over the variable."""


PROBES: Final[dict[str, Probe]] = {
    config.LIVENESS_TIMEOUT_S.name: Probe(_liveness("timeout_s"), "7.5", 7.5, 9.0),
    config.LIVENESS_INTERVAL_S.name: Probe(_liveness("interval_s"), "0.25", 0.25, 0.75),
    config.STALL_TIMEOUT_S.name: Probe(
        _decode("stall_timeout_s", lambda h: h._stall_timeout), "12", 12.0, 3.0
    ),
    config.ROOM_TIMEOUT_S.name: Probe(
        _decode("room_timeout_s", lambda h: h._room_timeout), "45.5", 45.5, 2.0
    ),
    config.FENCE_TIMEOUT_S.name: Probe(
        _decode("fence_timeout_s", lambda h: h._fence_timeout), "4", 4.0, 6.0
    ),
    config.MAX_ROOMS_PER_PEER.name: Probe(
        _decode("max_rooms_per_peer", lambda h: h._max_rooms_per_peer), "16", 16, 8
    ),
    config.RING_SHARE.name: Probe(_decode("ring_share", _share), "0.5", 0.5, 0.25),
    config.RING_BYTES.name: Probe(
        _decode("ring_bytes", lambda h: h.allocator.total_size), "131072", 131072, SMALL_RING
    ),
    config.INTEGRITY.name: Probe(_decode("integrity", lambda h: h.integrity), "on", True, False),
    config.PREFILL_DEADLINE_S.name: Probe(_timeouts("deadline_s"), "3", 3.0, 4.0),
    config.PREFILL_ANSWER_S.name: Probe(_timeouts("answer_s"), "0.2", 0.2, 0.3),
    config.PREFILL_READY_S.name: Probe(_timeouts("ready_s"), "0.1", 0.1, 0.4),
    config.META_TIMEOUT_S.name: Probe(
        _transfers("meta_timeout_s", lambda t: t._meta_timeout), "5", 5.0, 6.0
    ),
    config.EARLY_META_PER_PEER.name: Probe(
        _transfers("early_meta_per_peer", lambda t: t._early_cap), "32", 32, 64
    ),
}

BAD: Final[dict[str, tuple[str, ...]]] = {
    "seconds": ("soon", "-1", "0", "inf", "nan"),
    "count": ("many", "0", "-3", "1.5"),
    "bytes": ("64MiB", "0", "-1"),
    "fraction": ("half", "0", "1.5", "-0.5"),
    "switch": ("maybe", "2"),
}
"""Values each kind refuses."""

NAMES: Final = [s.name for s in SETTINGS]


def _setting(name: str) -> Setting[Any]:
    return next(s for s in SETTINGS if s.name == name)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)


def test_the_table_is_well_formed() -> None:
    """Unique ``STAGING_CONTRACTS_*`` names, known kinds, a test probe and bad values each."""
    assert len(set(NAMES)) == len(NAMES)
    assert all(re.fullmatch(r"STAGING_CONTRACTS_[A-Z_]+", name) for name in NAMES)
    assert {s.kind for s in SETTINGS} <= set(BAD)
    assert set(PROBES) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_unset_means_the_default(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the argument nor the variable: the default; a blank variable counts as unset."""
    setting, probe = _setting(name), PROBES[name]
    assert probe.build(None) == setting.default
    monkeypatch.setenv(name, "  ")
    assert probe.build(None) == setting.default


@pytest.mark.parametrize("name", NAMES)
def test_the_variable_reaches_its_argument(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable's value is what the constructor takes (it differs from the default)."""
    setting, probe = _setting(name), PROBES[name]
    assert probe.value != setting.default
    monkeypatch.setenv(name, probe.raw)
    assert probe.build(None) == probe.value


@pytest.mark.parametrize("name", NAMES)
def test_an_explicit_argument_wins(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given both, the argument wins over the variable."""
    probe = PROBES[name]
    assert probe.explicit != probe.value
    monkeypatch.setenv(name, probe.raw)
    assert probe.build(probe.explicit) == probe.explicit


@pytest.mark.parametrize(("name", "raw"), [(s.name, raw) for s in SETTINGS for raw in BAD[s.kind]])
def test_a_bad_value_fails_at_construction(
    name: str, raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One ``ConfigError`` (a ``ValueError``) naming the variable and its value, raised where
    the object is built."""
    monkeypatch.setenv(name, raw)
    with pytest.raises(ConfigError) as caught:
        PROBES[name].build(None)
    assert isinstance(caught.value, ValueError)
    assert str(caught.value).startswith(f"{name}={raw!r}: ")
    assert (caught.value.name, caught.value.raw) == (name, raw)


def test_a_bad_value_is_ignored_when_the_argument_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The variable is not read at all when the argument is explicit."""
    monkeypatch.setenv(config.STALL_TIMEOUT_S.name, "soon")
    assert PROBES[config.STALL_TIMEOUT_S.name].build(3.0) == 3.0


def test_the_docs_table_is_the_code_table() -> None:
    """docs/operating.md shows :func:`config.markdown_table` between its markers, verbatim."""
    page = (REPO / "docs" / "operating.md").read_text()
    found = re.search(
        r"<!-- config-table: begin -->\n(.*?)\n<!-- config-table: end -->", page, re.S
    )
    assert found is not None
    assert found.group(1) == config.markdown_table()
    for setting in SETTINGS:
        assert f"| `{setting.name}` |" in found.group(1)
