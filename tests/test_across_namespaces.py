"""A P=4 -> D=2 transfer between two network namespaces, as between two machines.

The test makes two network namespaces joined by a veth pair, each end with its own address
in a /30 of 10.123.0.0/16, and removes them afterwards. ``staging-contracts demo`` runs the
bootstrap server and the prefill ranks in one namespace (``--ranks prefill --host A``) and
the decode ranks in the other (``--ranks decode --bootstrap tcp://A:PORT --host B``), with
the cluster secret set, so CURVE is on. Nothing can take a loopback shortcut: each namespace
has its own loopback, and NIXL runs with ``UCX_TLS=tcp`` (UCX's shared-memory and CMA
transports would otherwise cross namespaces of one host). Needs root and iproute2's ``ip``.
"""

from __future__ import annotations

import os
import queue
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

from staging_contracts._control.security import SECRET_ENV, SECRET_FILE_ENV
from staging_contracts.engines import engine_available

IP = shutil.which("ip")
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
MOONCAKE_OK, MOONCAKE_WHY = engine_available("mooncake")
NIXL_OK, NIXL_WHY = engine_available("nixl")
SCRIPT = Path(sys.executable).with_name("staging-contracts")
REPO = Path(__file__).resolve().parents[1]

SIDE_TIMEOUT_S = 150.0
"""Bound on each side's whole run (start-up of six rank processes on two cores included)."""
ENDPOINT_TIMEOUT_S = 60.0
"""Bound on the prefill side printing its bootstrap endpoint."""
IP_TIMEOUT_S = 15.0
SMALL = (
    "--layers", "2", "--head-dim", "32", "--tokens", "96", "--requests", "3",
    "--chunk-tokens", "32", "--timeout", "120",
)  # fmt: skip
"""A run of three multi-chunk requests over four prefill and two decode ranks."""
REQUESTS = 3

pytestmark = [
    pytest.mark.skipif(IP is None, reason="iproute2's ip is missing (apt-get install iproute2)"),
    pytest.mark.skipif(not ROOT, reason="making network namespaces needs root"),
]


def ip(*args: str) -> None:
    """Run ``ip ARGS``; raise with its output when it fails."""
    assert IP is not None  # the module is skipped without it
    done = subprocess.run(
        [IP, *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


@dataclass(frozen=True, slots=True)
class Link:
    """Two network namespaces joined by a veth pair, an address at each end."""

    prefill_ns: str
    decode_ns: str
    prefill_addr: str
    decode_addr: str


def _kill_namespace_processes(namespace: str) -> None:
    """Kill what a failed run left inside one of the test's own namespaces."""
    assert IP is not None
    listed = subprocess.run(
        [IP, "netns", "pids", namespace],
        capture_output=True,
        text=True,
        timeout=IP_TIMEOUT_S,
        check=False,
    )
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            continue


@pytest.fixture
def link() -> Iterator[Link]:
    """Make two namespaces with a veth pair between them (10.123.N.1 and .2, a /30); remove
    them, and anything left running in them, afterwards."""
    tag = f"{os.getpid() % 100_000:05d}{secrets.token_hex(2)}"
    subnet = secrets.randbelow(256)
    made = Link(f"sc-{tag}-p", f"sc-{tag}-d", f"10.123.{subnet}.1", f"10.123.{subnet}.2")
    ends = (f"vsc{tag}p", f"vsc{tag}d")
    created: list[str] = []
    try:
        for namespace in (made.prefill_ns, made.decode_ns):
            ip("netns", "add", namespace)
            created.append(namespace)
        ip("link", "add", ends[0], "netns", made.prefill_ns, "type", "veth",
           "peer", "name", ends[1], "netns", made.decode_ns)  # fmt: skip
        for namespace, end, address in (
            (made.prefill_ns, ends[0], made.prefill_addr),
            (made.decode_ns, ends[1], made.decode_addr),
        ):
            ip("-n", namespace, "addr", "add", f"{address}/30", "dev", end)
            ip("-n", namespace, "link", "set", end, "up")
            ip("-n", namespace, "link", "set", "lo", "up")  # each driver's own inbox
        yield made
    finally:
        for namespace in created:
            _kill_namespace_processes(namespace)
            ip("netns", "del", namespace)  # takes the veth pair with it


@dataclass
class Side:
    """One side's ``staging-contracts demo``, its output read as it comes."""

    name: str
    process: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    readers: list[threading.Thread] = field(default_factory=list)
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)

    def read(self) -> None:
        """Collect stdout (also queued, line by line) and stderr on threads of their own."""
        for stream, sink, live in (
            (self.process.stdout, self.stdout, True),
            (self.process.stderr, self.stderr, False),
        ):
            thread = threading.Thread(target=self._pump, args=(stream, sink, live), daemon=True)
            thread.start()
            self.readers.append(thread)

    def _pump(self, stream: IO[str] | None, sink: list[str], live: bool) -> None:
        if stream is None:
            return
        for line in stream:
            sink.append(line)
            if live:
                self.lines.put(line)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """The first stdout line matching ``pattern``, within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                if self.process.poll() is not None and self.lines.empty():
                    break
                continue
            found = re.search(pattern, line)
            if found is not None:
                return found
        pytest.fail(f"{self.name} printed no {pattern!r} within {timeout_s} s:\n{self.text}")

    def finish(self, deadline: float) -> int:
        """Wait for the process (killing it at ``deadline``) and its output; its status."""
        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
        return self.stop()

    def stop(self) -> int:
        """Kill the process if it still runs; collect its output; close its pipes."""
        if self.process.poll() is None:
            self.process.kill()
        status = self.process.wait(10)
        for thread in self.readers:
            thread.join(10)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
        return status

    @property
    def text(self) -> str:
        """Everything the side printed so far."""
        return f"--- {self.name} stdout\n{''.join(self.stdout)}--- stderr\n{''.join(self.stderr)}"


def start(name: str, namespace: str, args: list[str], env: Mapping[str, str]) -> Side:
    """Start ``staging-contracts demo ARGS`` inside ``namespace``."""
    assert IP is not None
    process = subprocess.Popen(
        [IP, "netns", "exec", namespace, str(SCRIPT), "demo", *SMALL, *args],
        cwd=REPO,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    side = Side(name, process)
    side.read()
    return side


def side_env(backend: str) -> dict[str, str]:
    """The environment of both sides: a fresh cluster secret (CURVE on), and for NIXL the
    TCP transport only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "MC_"))}
    env.pop(SECRET_FILE_ENV, None)
    env[SECRET_ENV] = secrets.token_hex(32)
    env["PYTHONUNBUFFERED"] = "1"
    if backend == "nixl":
        env["UCX_TLS"] = "tcp"
    return env


ENGINES = [
    pytest.param(
        "mooncake",
        marks=[pytest.mark.mooncake, pytest.mark.skipif(not MOONCAKE_OK, reason=MOONCAKE_WHY)],
        id="mooncake-tcp",
    ),
    pytest.param(
        "nixl",
        marks=[pytest.mark.nixl, pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)],
        id="nixl-ucx-tcp",
    ),
]


@pytest.mark.timeout(2 * SIDE_TIMEOUT_S)
@pytest.mark.parametrize("backend", ENGINES)
def test_prefill_and_decode_in_two_namespaces_move_every_page(link: Link, backend: str) -> None:
    """The prefill side serves the bootstrap on its own address; the decode side joins it
    from the other namespace; decode verifies every page bit for bit, prefill sent every
    request, and both sides exit 0."""
    env = side_env(backend)
    prefill = start(
        "prefill side",
        link.prefill_ns,
        ["--backend", backend, "--ranks", "prefill", "--host", link.prefill_addr],
        env,
    )
    decode: Side | None = None
    try:
        found = prefill.wait_for(r"bootstrap server at (tcp://\S+):", ENDPOINT_TIMEOUT_S)
        endpoint = found.group(1)
        assert endpoint.startswith(f"tcp://{link.prefill_addr}:"), endpoint
        decode = start(
            "decode side",
            link.decode_ns,
            [
                "--backend",
                backend,
                "--ranks",
                "decode",
                "--bootstrap",
                endpoint,
                "--host",
                link.decode_addr,
            ],
            env,
        )
        deadline = time.monotonic() + SIDE_TIMEOUT_S
        decode_status = decode.finish(deadline)
        prefill_status = prefill.finish(deadline)
    finally:
        for side in (prefill, decode):
            if side is not None:
                side.stop()
    report = prefill.text + decode.text
    assert decode_status == 0, report
    assert prefill_status == 0, report
    decode_out, prefill_out = "".join(decode.stdout), "".join(prefill.stdout)
    assert f"{2 * REQUESTS}/{2 * REQUESTS} rooms done" in decode_out, report
    assert f"PASS: every page of {REQUESTS} requests on 2 decode ranks" in decode_out, report
    assert f"ranks here               decode on {link.decode_addr}" in decode_out, report
    assert f"{4 * REQUESTS}/{4 * REQUESTS} rooms done" in prefill_out, report
    assert f"PASS: every one of {REQUESTS} requests sent by 4 prefill ranks" in prefill_out
    if backend == "nixl":  # UCX was confined to each side's veth end: nothing to warn about
        assert "UCX listens beyond" not in report, report
    else:  # Mooncake cannot be confined, and each rank says so
        assert "listens beyond its host" in "".join(decode.stderr), report


def test_a_side_without_the_secret_refuses_a_non_loopback_host(link: Link) -> None:
    """Without the cluster secret a side refuses to bind its namespace's address (exit 2)."""
    env = side_env("nixl")
    del env[SECRET_ENV]
    side = start(
        "prefill side", link.prefill_ns, ["--ranks", "prefill", "--host", link.prefill_addr], env
    )
    status = side.finish(time.monotonic() + 60)
    assert status == 2, side.text
    assert f"refusing to bind '{link.prefill_addr}' without authentication" in side.text
