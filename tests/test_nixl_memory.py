"""NIXL registers CUDA pools as VRAM of their GPU: the choice of memory type, with stand-ins
for a GPU (no CUDA device is needed; the rule is checked, not a registration)."""

from __future__ import annotations

import pytest
import torch

from staging_contracts._run.workload import TransferConfig
from staging_contracts.engines import engine_available

NIXL_OK, NIXL_WHY = engine_available("nixl")
pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)]


def test_memory_kind_of_each_device() -> None:
    """cpu is DRAM; cuda:N is VRAM of GPU N; a bare cuda (whichever is current) or another
    device type is refused."""
    from staging_contracts.engines.nixl import memory_kind

    assert memory_kind("cpu") == ("DRAM", 0)
    assert memory_kind("cuda:0") == ("VRAM", 0)
    assert memory_kind("cuda:3") == ("VRAM", 3)
    for device in ("cuda", "cuda:", "cuda:x", "mps", "cpu:0", "meta"):
        with pytest.raises(ValueError, match="'cpu' \\(DRAM\\) or 'cuda:N'"):
            memory_kind(device)


def test_cuda_pools_name_their_gpu_so_nixl_registers_its_vram(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stand-in for a GPU: the current CUDA device is 1. The ranks' KV arguments (what the
    NIXL backend builds its engine from) name cuda:1, VRAM of GPU 1; CPU pools are DRAM."""
    from staging_contracts.engines.nixl import memory_kind

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    device = TransferConfig(device="cuda").kv_args(4, 0).device
    assert device == "cuda:1"
    assert memory_kind(device) == ("VRAM", 1)
    assert memory_kind(TransferConfig().kv_args(4, 0).device) == ("DRAM", 0)


def test_an_engine_built_for_a_device_registers_that_memory_type() -> None:
    """NixlEngine(device=...) takes its memory type and GPU from the device, and says so in
    the metadata its peers load; a device that disagrees with an explicit type is refused."""
    from staging_contracts.engines.nixl import NixlEngine, _parse_metadata

    engine = NixlEngine(device="cuda:2", load_ib_modules=False)
    try:
        assert "VRAM" in repr(engine)
        assert _parse_metadata(engine.session_id, engine.metadata())[:2] == ("VRAM", 2)
    finally:
        engine.close()
    with pytest.raises(ValueError, match="were given too"):
        NixlEngine(device="cpu", mem_type="VRAM", load_ib_modules=False)


@pytest.mark.parametrize(
    ("device", "kind"), [("cpu", ("DRAM", 0)), ("cuda:2", ("VRAM", 2)), ("cuda:0", ("VRAM", 0))]
)
def test_the_nixl_backend_registers_the_memory_its_kv_args_name(
    device: str, kind: tuple[str, int]
) -> None:
    """NixlKVManager hands kv_args.device to the engine, whose memory_kind decides: the
    agent registers DRAM for cpu and VRAM of GPU N for cuda:N (no GPU needed: nothing is
    registered)."""
    from dataclasses import replace

    from staging_contracts.backends._common import Role
    from staging_contracts.backends.nixl import NixlKVManager
    from staging_contracts.engines.nixl import _parse_metadata

    kv_args = replace(TransferConfig().kv_args(4, 0), device=device)
    manager = NixlKVManager(kv_args, role=Role.DECODE, attn_tp_size=4)
    try:
        engine = manager.engine
        assert _parse_metadata(engine.session_id, engine.metadata())[:2] == kind
    finally:
        manager.close()


def test_the_nixl_backend_refuses_a_bare_cuda_device() -> None:
    """A bare "cuda" names no GPU: the backend refuses it as the engine's rule does, instead
    of guessing GPU 0."""
    from dataclasses import replace

    from staging_contracts.backends._common import Role
    from staging_contracts.backends.nixl import NixlKVManager

    kv_args = replace(TransferConfig().kv_args(4, 0), device="cuda")
    with pytest.raises(ValueError, match="'cpu' \\(DRAM\\) or 'cuda:N'"):
        NixlKVManager(kv_args, role=Role.PREFILL, attn_tp_size=4)
