"""On CUDA a rank waits for its own device work before an engine touches the memory: every
fill and zeroing of a pool or buffer an engine reads or writes is followed by
``torch.cuda.synchronize`` before the memory is registered, published or opened to the
writers. No GPU is needed: the pools stay on the CPU, the configuration says CUDA, and the
synchronisation is recorded where it is called."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from staging_contracts._cluster import rank as rank_module
from staging_contracts._cluster.bootstrap import RankInfo
from staging_contracts._run import _rank_body as rank_body
from staging_contracts._run import workload
from staging_contracts._run.workload import TransferConfig
from staging_contracts.backends._kv_requests import KVPoll


def cuda_config(**kw: Any) -> TransferConfig:
    """A small run on "cuda", two prefill ranks -> one decode rank, one warm-up request."""
    fields: dict[str, Any] = {
        "backend": "nixl",
        "prefill_tp": 2,
        "decode_tp": 1,
        "kv_heads": 2,
        "layers": 1,
        "head_dim": 8,
        "tokens": 32,
        "page_size": 16,
        "requests": 1,
        "chunk_tokens": 16,
        "warmup_requests": 1,
        "device": "cuda",
    }
    fields.update(kw)
    return TransferConfig(**fields)


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the rank did, in order: synchronisations, fills, zeroings, barriers. Tensors
    stay on the CPU (torch_device), the device calls are recorded or are no-ops."""
    seen: list[str] = []
    monkeypatch.setattr(TransferConfig, "torch_device", property(lambda self: torch.device("cpu")))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    real_fill, real_zero = workload.fill_prefill_pool, workload.zero_pool

    def fill(*args: Any) -> None:
        real_fill(*args)
        seen.append("fill")

    def zero(pool: Any) -> None:
        real_zero(pool)
        seen.append("zero")

    monkeypatch.setattr(rank_body, "fill_prefill_pool", fill)
    monkeypatch.setattr(rank_module, "zero_pool", zero)
    return seen


def test_settle_synchronises_the_ranks_device_on_cuda_only(events: list[str]) -> None:
    """CUDA: one torch.cuda.synchronize of the rank's device; CPU: none."""
    rank_body.settle(cuda_config())
    assert events == ["sync"]
    rank_body.settle(cuda_config(device="cpu"))
    assert events == ["sync"]


def test_a_filled_prefill_pool_is_settled_after_filling(events: list[str]) -> None:
    """The pool is filled, then the device synchronised, before it is handed back."""
    rank_body.filled_prefill_pool(cuda_config(), 0)
    assert events == ["fill", "sync"]


class _Buffer:
    """A raw buffer that records its zeroing."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def zero_(self) -> None:
        self.events.append("zero buffer")


def test_zeroing_for_the_timed_requests_is_settled_after_zeroing(events: list[str]) -> None:
    """Pool and raw buffer alike: zeroed, then synchronised."""
    config = cuda_config()
    pool = config.empty_pool(1, 0)
    rank_module._zero_for_timed(config, pool, None)
    rank_module._zero_for_timed(config, None, _Buffer(events))  # type: ignore[arg-type]
    assert events == ["zero", "sync", "zero buffer", "sync"]


class _Engine:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.session_id = "fake"
        self.registered_regions = 0

    def metadata(self) -> bytes:
        return b"fake"

    def register(self, ptr: int, length: int) -> None:
        self.events.append("register")

    def deregister(self, ptr: int) -> None:
        pass

    def add_peer(self, session_id: str, metadata: bytes) -> None:
        pass

    def write(self, peer: str, transfers: Any, notify: bytes | None = None) -> None:
        self.events.append("write")


class _Manager:
    """The parts of a backend manager the plain paths use."""

    endpoint = "tcp://127.0.0.1:1"
    curve_key = None

    def __init__(self, events: list[str]) -> None:
        self.engine = _Engine(events)

    def register_control(self, kind: bytes, handler: Any) -> None:
        pass

    def add_authorizer(self, authorize: Any) -> None:
        pass

    def start(self) -> None:
        pass

    def trust_peer(self, endpoint: str, key: bytes | None) -> None:
        pass

    def send(self, endpoint: str, frames: Any) -> bool:
        return True

    def close(self) -> None:
        pass


@pytest.fixture
def fake_cluster(events: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank's peers, bootstrap and backend, as stand-ins that record the barriers."""
    config = cuda_config(mode="per-token")
    decode_pool = tuple(range(2 * config.layers))

    def query(bootstrap: str, role: str, count: int, timeout: float) -> list[RankInfo]:
        pool = decode_pool if role == "decode" else ()
        return [
            RankInfo(role, r, f"tcp://{role}{r}", "fake", b"fake", pool_ptrs=pool)
            for r in range(count)
        ]

    def wait_all(requests: Mapping[int, Any], report: Any, timeout_s: float = 0.0) -> Any:
        return {i: KVPoll.Success for i in requests}, {i: 0.0 for i in requests}

    monkeypatch.setattr(rank_body, "resolve_backend", lambda spec: lambda *a, **k: _Manager(events))
    monkeypatch.setattr(rank_module, "register_rank", lambda b, info: events.append("publish"))
    monkeypatch.setattr(rank_module, "query_ranks", query)
    monkeypatch.setattr(rank_module, "arrive", lambda b, name, who: events.append(name))
    monkeypatch.setattr(
        rank_module, "wait_barrier", lambda b, name, count, timeout: events.append(name)
    )
    monkeypatch.setattr(rank_module, "_wait_all", wait_all)
    monkeypatch.setattr(rank_module, "freeze_heap", lambda: None)
    monkeypatch.setattr(rank_module, "verify_decode_pool", lambda *args: [])
    monkeypatch.setattr(rank_module, "verify_raw", lambda *args: [])


def _ordered(events: list[str]) -> list[str]:
    """The events that matter for the order, consecutive repeats (writes) folded."""
    kept = [e for e in events if e in ORDERED]
    return [e for i, e in enumerate(kept) if i == 0 or e != kept[i - 1] or e != "write"]


ORDERED = {"sync", "fill", "zero", "zero buffer", "register", "publish", "warm-rooms"}
ORDERED |= {"rooms", "done", "write"}


@pytest.mark.usefixtures("fake_cluster")
@pytest.mark.parametrize("mode", ["per-token", "raw"])
def test_a_plain_decode_rank_settles_its_zeros_before_the_writers_may_write(
    events: list[str], mode: str
) -> None:
    """Allocated zeroed, synchronised, then registered and published; after the warm-up,
    zeroed, synchronised, then the writers are let in (barrier 'rooms')."""
    rank_module._run_plain_decode(_run(mode))
    # the raw buffer is a real tensor: its zeroing is not recorded (the helper's test has it)
    zero = ["zero"] if mode == "per-token" else []
    expected = ["sync", "register", "publish", "warm-rooms", *zero, "sync", "rooms", "done"]
    assert _ordered(events) == expected


@pytest.mark.usefixtures("fake_cluster")
@pytest.mark.parametrize("mode", ["per-token", "raw"])
def test_a_plain_prefill_rank_settles_its_source_before_the_engine_reads_it(
    events: list[str], mode: str
) -> None:
    """The pool filled (or the raw source copied), synchronised, then registered; writes
    only after the barriers."""
    rank_module._run_plain_prefill(_run(mode))
    source = ["fill", "sync"] if mode == "per-token" else ["sync"]
    expected = [*source, "register", "publish", "warm-rooms", "write", "rooms", "write", "done"]
    assert _ordered(events) == expected


def _run(mode: str) -> Any:
    """Rank 0's run of ``mode`` on "cuda", its events dropped."""
    return rank_module._RankRun(0, cuda_config(mode=mode), "tcp://b", lambda event: None)
