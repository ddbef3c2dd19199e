"""Which device's memory each backend's engine can move, known before any rank starts: the
engine a spec uses (from its class, without building a manager), the refusal of Mooncake on
CUDA where the installed build moves host memory only, and the engine's own refusal to
register CUDA memory then. No GPU is needed: CUDA memory is a stand-in where it must be."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from staging_contracts._cluster.preflight import backend_engine, check_device, preflight
from staging_contracts._run.workload import TransferConfig
from staging_contracts.engines import engine_available
from staging_contracts.protocols import TransferError

MOONCAKE_OK, MOONCAKE_WHY = engine_available("mooncake")
NIXL_OK, NIXL_WHY = engine_available("nixl")

SUBCLASS = (
    "from staging_contracts.backends.nixl import NixlKVManager\n\n\n"
    "class MyNixl(NixlKVManager):\n"
    "    pass\n"
)


@pytest.mark.skipif(not (MOONCAKE_OK and NIXL_OK), reason=f"{MOONCAKE_WHY} {NIXL_WHY}")
def test_the_engine_of_a_spec_is_told_by_its_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-tree names, a subclass of an in-tree backend given as MODULE:CLASS, and nothing for
    a spec that does not resolve or a class of another family."""
    (tmp_path / "my_nixl_spec.py").write_text(SUBCLASS)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert backend_engine("nixl") == "nixl"
    assert backend_engine("mooncake") == "mooncake"
    assert backend_engine("ascend") == "mooncake"
    assert backend_engine("local") == "local"
    assert backend_engine("my_nixl_spec:MyNixl") == "nixl"
    assert backend_engine("mori") is None
    assert backend_engine("no_such_module_x:Cls") is None


@pytest.mark.mooncake
@pytest.mark.skipif(not MOONCAKE_OK, reason=MOONCAKE_WHY)
def test_mooncake_on_cuda_is_refused_where_the_build_moves_host_memory_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--device cuda with Mooncake (and ascend, over Mooncake) is one line naming both
    options and why; cpu passes; a CUDA build of Mooncake is not refused."""
    from staging_contracts.engines import mooncake

    monkeypatch.setattr(mooncake, "host_memory_only", lambda: "built without CUDA")
    for spec in ("mooncake", "ascend"):
        with pytest.raises(ValueError, match=f"^--backend {spec} --device cuda: built without"):
            check_device(spec, "cuda")
        check_device(spec, "cpu")
    with pytest.raises(ValueError, match="--device cuda: built without CUDA"):
        preflight(TransferConfig(backend="mooncake", device="cuda"), ignore_memory=True)
    monkeypatch.setattr(mooncake, "host_memory_only", lambda: None)
    check_device("mooncake", "cuda")


@pytest.mark.mooncake
@pytest.mark.skipif(not MOONCAKE_OK, reason=MOONCAKE_WHY)
def test_the_installed_non_cuda_wheel_is_recognised() -> None:
    """The wheel installed here is the non-CUDA one, and it is named in the reason."""
    import importlib.metadata

    from staging_contracts.engines.mooncake import NON_CUDA_DISTRIBUTION, host_memory_only

    names = importlib.metadata.packages_distributions().get("mooncake", [])
    if names != [NON_CUDA_DISTRIBUTION]:
        pytest.skip(f"Mooncake here comes from {names}")
    reason = host_memory_only()
    assert reason is not None
    assert NON_CUDA_DISTRIBUTION in reason


@pytest.mark.nixl
@pytest.mark.skipif(not NIXL_OK, reason=NIXL_WHY)
def test_nixl_on_cuda_passes_the_device_check() -> None:
    """NIXL moves VRAM: nothing to refuse."""
    check_device("nixl", "cuda")


@pytest.mark.mooncake
@pytest.mark.skipif(not MOONCAKE_OK, reason=MOONCAKE_WHY)
def test_the_mooncake_engine_refuses_to_register_cuda_memory_without_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stand-in: the driver says the range is device memory. Under a host-only build the
    engine refuses it with a clear error (and registers nothing); host memory registers."""
    from staging_contracts.engines import mooncake

    engine = mooncake.MooncakeEngine("127.0.0.1")
    host = torch.zeros(4096, dtype=torch.uint8)
    try:
        monkeypatch.setattr(mooncake, "host_memory_only", lambda: "built without CUDA")
        monkeypatch.setattr(mooncake, "is_cuda_memory", lambda ptr: ptr == host.data_ptr())
        with pytest.raises(TransferError, match="is CUDA device memory, and built without CUDA"):
            engine.register(host.data_ptr(), host.numel())
        assert engine.registered_regions == 0
        monkeypatch.setattr(mooncake, "is_cuda_memory", lambda ptr: False)
        engine.register(host.data_ptr(), host.numel())
        assert engine.registered_regions == 1
    finally:
        engine.close()


@pytest.mark.mooncake
@pytest.mark.skipif(not MOONCAKE_OK, reason=MOONCAKE_WHY)
def test_host_memory_is_not_cuda_memory() -> None:
    """A CPU tensor is never CUDA device memory (without a driver, nothing is)."""
    from staging_contracts.engines.mooncake import is_cuda_memory

    assert not is_cuda_memory(torch.zeros(16).data_ptr())
