"""``LocalKVManager``: the staging backend over ``engines.local.LocalEngine``.

Prefill and decode ranks live in one process (threads) and the bulk writes are memory copies;
the control plane is the real one (ZMQ on loopback). The embedded default for single-process
use, tests and examples.
"""

from __future__ import annotations

from typing import ClassVar

from .._control.security import FROM_ENV
from ..engines.local import LocalEngine
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

__all__ = ["LocalKVManager"]


class LocalKVManager(StagingManagerMixin, CommonKVManager):
    """A staging backend whose ranks share one process.

    Args:
        kv_args: this rank's KV arguments (``device`` must be a CPU device).
        role: prefill or decode.
        attn_tp_size: attention TP size of this side.
        pp_size: pipeline-parallel size of this side.
        engine_name: the engine's session id (default: a unique name).
    """

    __contract: ClassVar[StagingHostCheck[LocalKVManager]]

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
        engine_name: str | None = None,
        secret: bytes | str | None = FROM_ENV,
    ) -> None:
        super().__init__(
            kv_args,
            role=role,
            attn_tp_size=attn_tp_size,
            pp_size=pp_size,
            engine=LocalEngine(engine_name),
            secret=secret,
        )

    @property
    def arrival(self) -> ArrivalMode:
        """``"notification"``: the local engine delivers notifications, so arrival travels
        with the copy."""
        return "notification"

    def _on_message(self, frames: list[bytes]) -> None:
        if not self._dispatch_staging(frames):
            super()._on_message(frames)

    def _on_idle(self) -> None:
        staging_idle(self)
