"""Where each engine listens: the sockets of an engine's process, and its start-up warning.

Each engine runs in a child process of its own; the test lists that process's listening TCP
sockets from ``/proc`` (the same sockets ``ss -ltnp`` shows) and compares them with what the
engine was told and what it logged.
"""

from __future__ import annotations

import ipaddress
import logging
import multiprocessing
import os
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import pytest

from staging_contracts.engines import engine_available, load_engine_class
from staging_contracts.engines._netif import (
    ListeningSocket,
    interface_addresses,
    interface_of,
    is_wildcard,
    listening_sockets,
    resolve_host,
    unconfined,
)

MOONCAKE_OK, MOONCAKE_WHY = engine_available("mooncake")
NIXL_OK, NIXL_WHY = engine_available("nixl")
CHILD_TIMEOUT_S = 60.0
LOGGER = "staging_contracts.engines"


# --------------------------------------------------------------------------- the helpers


@pytest.fixture
def two_listeners() -> Iterator[tuple[int, int]]:
    """A TCP listener on 127.0.0.1 and one on every IPv6 address, in this process."""
    v4 = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    v6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        v4.bind(("127.0.0.1", 0))
        v4.listen()
        v6.bind(("::", 0))
        v6.listen()
        yield v4.getsockname()[1], v6.getsockname()[1]
    finally:
        v4.close()
        v6.close()


def test_listening_sockets_reads_this_process_from_proc(two_listeners: tuple[int, int]) -> None:
    """Both families are parsed from /proc, by this process's socket inodes only."""
    v4_port, v6_port = two_listeners
    found = listening_sockets()
    assert ListeningSocket("127.0.0.1", v4_port) in found
    assert ListeningSocket("::", v6_port) in found
    assert str(ListeningSocket("::", v6_port)) == f"[::]:{v6_port}"
    assert str(ListeningSocket("127.0.0.1", v4_port)) == f"127.0.0.1:{v4_port}"
    connected = socket.create_connection(("127.0.0.1", v4_port), timeout=5)
    try:
        assert all(item.port != connected.getsockname()[1] for item in listening_sockets())
    finally:
        connected.close()


def test_unconfined_names_the_listeners_beyond_the_allowed_addresses() -> None:
    """Wildcards and other addresses are beyond; an allowed address in brackets is not."""
    items = [
        ListeningSocket("::", 2),
        ListeningSocket("127.0.0.1", 1),
        ListeningSocket("0.0.0.0", 3),
        ListeningSocket("::1", 4),
    ]
    assert unconfined(items, ["127.0.0.1", "[::1]"]) == [
        ListeningSocket("0.0.0.0", 3),
        ListeningSocket("::", 2),
    ]
    assert unconfined(items, []) == sorted(items)
    assert is_wildcard("0.0.0.0")
    assert is_wildcard("[::]")
    assert is_wildcard("")
    assert not is_wildcard("127.0.0.1")


def test_interfaces_hold_loopback_and_resolve_names() -> None:
    """getifaddrs finds loopback on lo; a name resolves to an address."""
    addresses = interface_addresses()
    assert "127.0.0.1" in addresses["lo"]
    assert interface_of("127.0.0.1") == "lo"
    assert resolve_host("[::1]") == "::1"
    assert ipaddress.ip_address(resolve_host("localhost")).is_loopback
    held = {ipaddress.ip_address(a) for values in addresses.values() for a in values}
    stranger = next(
        str(a) for a in ipaddress.ip_network("198.51.100.0/24").hosts() if a not in held
    )
    assert interface_of(stranger) is None


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_ucx_confinement_names_the_interface_and_family() -> None:
    """host picks the interface that holds it and the address family; a wildcard picks none."""
    from staging_contracts.engines.nixl import ucx_confinement
    from staging_contracts.protocols import TransferError

    assert ucx_confinement("127.0.0.1") == {"NET_DEVICES": "lo", "TCP_AF_PRIO": "inet"}
    assert ucx_confinement("::1") == {"NET_DEVICES": "lo", "TCP_AF_PRIO": "inet6"}
    assert ucx_confinement("0.0.0.0") == {}
    with pytest.raises(TransferError, match=r"no network interface of this host holds"):
        ucx_confinement("198.51.100.254" if interface_of("198.51.100.254") is None else "::2")


# --------------------------------------------------------------------------- engine processes


@dataclass(frozen=True, slots=True)
class EngineSockets:
    """What a child process running one engine saw and logged, and the test's own look."""

    engine_listening: tuple[str, ...]
    """The engine's own account (``engine.listening``)."""
    process: frozenset[ListeningSocket]
    """Every TCP socket the child process listened on, from /proc, read by the test."""
    warnings: tuple[str, ...]
    """The engine's warnings at start-up."""
    infos: tuple[str, ...]
    """The engine's INFO lines at start-up."""


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


def engine_child(
    name: str, options: dict[str, Any], env: dict[str, str], report: Connection
) -> None:
    """Start one engine, report what it says and logged, wait for the parent, close it."""
    os.environ.update(env)
    collect = _Collect()
    logging.getLogger(LOGGER).addHandler(collect)
    logging.getLogger(LOGGER).setLevel(logging.INFO)
    try:
        engine = load_engine_class(name)(**options)
        report.send(("ok", (tuple(getattr(engine, "listening", ())), tuple(collect.lines))))
        report.poll(CHILD_TIMEOUT_S)  # the parent lists our sockets meanwhile
        engine.close()
    except Exception as exc:  # reported to the test, which fails with it
        report.send(("error", repr(exc)))
        raise


def run_engine(name: str, options: Mapping[str, Any], env: Mapping[str, str]) -> EngineSockets:
    """Run ``name`` in a child process and list that process's listening sockets."""
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    child = context.Process(
        target=engine_child, args=(name, dict(options), dict(env), there), name=f"{name}-sockets"
    )
    child.start()
    try:
        if not here.poll(CHILD_TIMEOUT_S):
            pytest.fail(f"the {name} engine did not start within {CHILD_TIMEOUT_S} s")
        status, value = here.recv()
        if status != "ok":
            pytest.fail(f"the {name} engine failed to start: {value}")
        listening, lines = value
        assert child.pid is not None
        process = listening_sockets(child.pid)
        here.send("close")
        child.join(CHILD_TIMEOUT_S)
        assert child.exitcode == 0, f"{name} child exited with {child.exitcode}"
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
    warnings = tuple(text for level, text in lines if level >= logging.WARNING)
    infos = tuple(text for level, text in lines if level == logging.INFO)
    return EngineSockets(listening, process, warnings, infos)


NIXL_ENV = {"UCX_MODULES": "^ib", "UCX_TLS": "tcp"}
"""The engine child's UCX: no InfiniBand modules (see nixl.py), and TCP as the transport
whose listeners are checked; ``UCX_NET_DEVICES`` is removed so that ``host`` governs."""


def _without_net_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_nixl_with_host_listens_only_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """NixlEngine(host="127.0.0.1"): UCX's every TCP listener is on 127.0.0.1; no warning."""
    _without_net_devices(monkeypatch)
    seen = run_engine("nixl", {"host": "127.0.0.1", "load_ib_modules": False}, NIXL_ENV)
    assert seen.process, "UCX over TCP opened no listener at all"
    assert {item.address for item in seen.process} == {"127.0.0.1"}
    assert seen.engine_listening == tuple(str(item) for item in sorted(seen.process))
    assert seen.warnings == ()


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_nixl_without_host_names_each_listener_beyond_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without host= UCX listens on every interface, as asked: each listener beyond
    loopback is named at INFO, and nothing is warned about."""
    _without_net_devices(monkeypatch)
    seen = run_engine("nixl", {"load_ib_modules": False}, NIXL_ENV)
    assert seen.process
    assert seen.warnings == ()
    beyond = unconfined(seen.process, ["127.0.0.1", "::1"])
    told = [line for line in seen.infos if "UCX listens on every interface it found" in line]
    if not beyond:  # a host with loopback only: nothing to say
        assert told == []
        return
    assert len(told) == 1
    for item in beyond:
        assert str(item) in told[0]


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_nixl_explicit_net_devices_wins_over_host_and_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """UCX_NET_DEVICES in the environment wins over host=; the warning says so."""
    _without_net_devices(monkeypatch)
    others = [name for name in interface_addresses() if name != "lo"]
    if not any(interface_addresses()[name] for name in others):
        pytest.skip("this host has no network interface besides loopback")
    env = {**NIXL_ENV, "UCX_NET_DEVICES": others[0]}
    seen = run_engine("nixl", {"host": "127.0.0.1", "load_ib_modules": False}, env)
    assert seen.process
    assert all(item.address != "127.0.0.1" for item in seen.process)
    assert len(seen.warnings) == 1
    assert f"UCX_NET_DEVICES={others[0]} in the environment wins over host=" in seen.warnings[0]


@pytest.mark.mooncake
@pytest.mark.skipif(not MOONCAKE_OK, reason=MOONCAKE_WHY)
def test_mooncake_warns_about_every_listener_beyond_its_host() -> None:
    """Mooncake cannot be confined: each listener beyond host is named in one warning.

    Mooncake binds its handshake and TCP data listeners to the wildcard address whatever
    host it is given; should a release bind host, the test asks for no warning instead.
    """
    seen = run_engine(
        "mooncake", {"host": "127.0.0.1", "protocol": "tcp"}, {"MC_LOG_LEVEL": "ERROR"}
    )
    assert seen.process, "Mooncake opened no listener"
    assert seen.engine_listening == tuple(str(item) for item in sorted(seen.process))
    beyond = unconfined(seen.process, ["127.0.0.1"])
    if not beyond:
        assert seen.warnings == ()
        return
    assert len(seen.warnings) == 1
    assert "listens beyond its host '127.0.0.1'" in seen.warnings[0]
    assert "read and write the registered memory" in seen.warnings[0]
    for item in beyond:
        assert str(item) in seen.warnings[0]


def manager_child(env: dict[str, str], report: Connection) -> None:
    """Start a NIXL decode manager on loopback, report once it listens, wait, close it."""
    os.environ.update(env)
    from staging_contracts.backends._common import Role
    from staging_contracts.backends.nixl import NixlKVManager
    from tests.local_cluster import Geometry

    try:
        manager = NixlKVManager(
            Geometry(1, 1, 2).kv_args(1, 0), role=Role.DECODE, attn_tp_size=1, host="127.0.0.1"
        )
        manager.start()
        report.send(("ok", ()))
        report.poll(CHILD_TIMEOUT_S)
        manager.close()
    except Exception as exc:  # reported to the test, which fails with it
        report.send(("error", repr(exc)))
        raise


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_a_nixl_manager_listens_only_on_its_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """NixlKVManager(host=...) passes host to its engine: the control listener and every UCX
    listener of the process are on 127.0.0.1."""
    _without_net_devices(monkeypatch)
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    child = context.Process(target=manager_child, args=(dict(NIXL_ENV), there))
    child.start()
    try:
        assert here.poll(CHILD_TIMEOUT_S), "the NIXL manager did not start"
        status, value = here.recv()
        assert status == "ok", value
        assert child.pid is not None
        process = listening_sockets(child.pid)
        here.send("close")
        child.join(CHILD_TIMEOUT_S)
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
    assert len(process) >= 2, process  # the ZMQ listener and at least one UCX listener
    assert {item.address for item in process} == {"127.0.0.1"}
