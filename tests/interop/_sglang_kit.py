"""Host factories for the contract kit: SGLang's managers, built its own way.

``--staging-backend sglang.srt.disaggregation.mooncake.conn:MooncakeKVManager=
tests.interop._sglang_kit:mooncake_managers`` makes the kit check the four Mooncake managers
(prefill and decode, staging on and off) built through their real ``__init__``; the same for
``nixl_managers`` and ``ascend_managers``. The reference must be importable in that process
(:mod:`._adoption` runs the kit with the patched reference first on ``sys.path``).
"""

from __future__ import annotations

from typing import Any

from tests.interop import _sglang_managers as sg
from tests.interop._reference import ensure_installed, load_reference

__all__ = ["ascend_managers", "mooncake_managers", "nixl_managers"]


def _managers(backend: str) -> list[Any]:
    reference = load_reference(ensure_installed())
    built = []
    for spec in sg.SPECS:
        if spec.backend == backend:
            manager, _pool = sg.build_manager(reference, spec)  # kept alive by sg.ALIVE
            built.append(manager)
    return built


def mooncake_managers() -> list[Any]:
    """SGLang's four Mooncake managers."""
    return _managers("mooncake")


def nixl_managers() -> list[Any]:
    """SGLang's four NIXL managers (real NIXL agents, UCX)."""
    return _managers("nixl")


def ascend_managers() -> list[Any]:
    """SGLang's four Ascend managers."""
    return _managers("ascend")
