"""``MooncakeKVManager``: staging over Mooncake's transfer engine (TCP here, RDMA on clusters).

Arrival is signalled with ``CHUNK_READY`` over ZMQ after each bulk write (Mooncake writes
carry no notification in this design). Requires the ``mooncake`` extra.
"""

from __future__ import annotations

from typing import ClassVar

from ..engines import load_engine_class
from ..mixin import StagingHostCheck, StagingManagerMixin
from ..protocols import (
    ArrivalMode,
    DecodeStagingContext,
    KVArgs,
    KVBufferTensors,
    PrefillStagingContext,
    StagingHandler,
)
from ._common import CommonKVManager, Role
from ._staging_setup import staging_idle

__all__ = ["MooncakeKVManager"]


class MooncakeKVManager(StagingManagerMixin, CommonKVManager):
    """A staging backend over ``mooncake.engine.TransferEngine``.

    Args:
        kv_args: this rank's KV arguments.
        role: prefill or decode.
        attn_tp_size: attention TP size of this side.
        pp_size: pipeline-parallel size of this side.
        host: address the engine and the control listener bind (loopback by default).
        protocol: Mooncake transport: ``"tcp"`` (here) or ``"rdma"`` (clusters with NICs).
        device_name: RDMA device(s) for ``protocol="rdma"``.

    Raises:
        ImportError: the Mooncake engine is not installed (names the extra to install).
    """

    __contract: ClassVar[StagingHostCheck[MooncakeKVManager]]

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
        protocol: str = "tcp",
        device_name: str = "",
    ) -> None:
        engine_class = load_engine_class("mooncake")
        engine = engine_class(host, protocol=protocol, device_name=device_name)
        super().__init__(
            kv_args,
            role=role,
            attn_tp_size=attn_tp_size,
            engine=engine,
            pp_size=pp_size,
            host=host,
        )

    @property
    def arrival(self) -> ArrivalMode:
        """``"zmq"``: Mooncake writes carry no notification, so arrival is ``CHUNK_READY``
        over ZMQ."""
        return "zmq"

    def _on_message(self, frames: list[bytes]) -> None:
        if not self._dispatch_staging(frames):
            super()._on_message(frames)

    def _on_idle(self) -> None:
        staging_idle(self)
