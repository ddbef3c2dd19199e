"""``NixlKVManager``: staging over a NIXL agent with the UCX backend.

Arrival is signalled by the bulk write's notification (it carries the ``CHUNK_READY``
fields), polled by the listener's idle loop, which also drives the agent's progress: NIXL
runs without its progress thread here. Requires the ``nixl`` extra.
"""

from __future__ import annotations

from ..engines import load_engine_class
from ..mixin import StagingManagerMixin
from ..protocols import (
    DecodeStagingContext,
    KVArgs,
    KVBufferTensors,
    PrefillStagingContext,
    StagingHandler,
)
from .common import CommonKVManager, Role
from .staging_setup import staging_idle

__all__ = ["NixlKVManager"]

DECODE_POLL_S = 0.002
"""Decode: longest wait of the listener before it polls the agent for arrivals again. An
arrival is seen at most this late; each idle poll costs tens of microseconds of CPU (at 1 ms,
the bench's two decode listeners took about 2% of the host's two cores polling)."""
PREFILL_POLL_S = 0.01
"""Prefill: the agent needs driving only while writing, which the writer does itself."""


class NixlKVManager(StagingManagerMixin, CommonKVManager):
    """A staging backend over a NIXL agent.

    Args:
        kv_args: this rank's KV arguments.
        role: prefill or decode.
        attn_tp_size: attention TP size of this side.
        pp_size: pipeline-parallel size of this side.
        host: address the control listener binds (loopback by default).
        agent_name: the NIXL agent's name (its session id); unique by default.
        load_ib_modules: let UCX load its InfiniBand modules (only where there is an RDMA
            NIC; on hosts without one they can crash the process at exit).

    Raises:
        ImportError: NIXL is not installed (names the extra to install).
    """

    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    kv_buffer_tensors: KVBufferTensors | None = None

    def __init__(
        self,
        kv_args: KVArgs,
        *,
        role: Role,
        attn_tp_size: int,
        pp_size: int = 1,
        host: str = "127.0.0.1",
        agent_name: str | None = None,
        load_ib_modules: bool = False,
    ) -> None:
        engine_class = load_engine_class("nixl")
        on_gpu = kv_args.device.startswith("cuda")
        device_id = int(kv_args.device.partition(":")[2] or 0) if on_gpu else 0
        engine = engine_class(
            agent_name,
            mem_type="VRAM" if on_gpu else "DRAM",
            device_id=device_id,
            load_ib_modules=load_ib_modules,
        )
        super().__init__(
            kv_args,
            role=role,
            attn_tp_size=attn_tp_size,
            engine=engine,
            pp_size=pp_size,
            host=host,
            poll_interval_s=DECODE_POLL_S if role is Role.DECODE else PREFILL_POLL_S,
        )

    def _on_message(self, frames: list[bytes]) -> None:
        if not self._dispatch_staging(frames):
            super()._on_message(frames)

    def _on_idle(self) -> None:
        staging_idle(self)
