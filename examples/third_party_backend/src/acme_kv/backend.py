"""``AcmeKVManager``: a staging backend over the in-process ``LocalEngine``.

What a backend needs to satisfy the ``StagingHost`` contract of ``StagingManagerMixin``:

* the mixin listed *before* the common base;
* the two staging members declared with their types (``kv_args`` and ``attn_tp_size`` come
  from ``CommonKVManager``; ``kv_buffer_tensors`` is optional);
* staging messages from the control listener handed to ``_dispatch_staging``, and the
  listener's idle work to ``staging_idle``.
"""

from __future__ import annotations

import itertools
import logging
import os

from staging_contracts import (
    DecodeStagingContext,
    KVArgs,
    KVBufferTensors,
    PrefillStagingContext,
    StagingHandler,
    StagingManagerMixin,
)
from staging_contracts.backends.common import CommonKVManager, Role
from staging_contracts.backends.staging_setup import staging_idle
from staging_contracts.engines.local import LocalEngine

__all__ = ["AcmeKVManager"]

logger = logging.getLogger(__name__)

_engine_names = itertools.count(1)


class AcmeKVManager(StagingManagerMixin, CommonKVManager):
    """Acme's KV manager: staging over ``LocalEngine``, prefill and decode in one process.

    Args:
        kv_args: this rank's KV arguments (``device`` must be a CPU device).
        role: prefill or decode.
        attn_tp_size: attention TP size of this side.
        pp_size: pipeline-parallel size of this side.
    """

    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    kv_buffer_tensors: KVBufferTensors | None = None

    def __init__(self, kv_args: KVArgs, *, role: Role, attn_tp_size: int, pp_size: int = 1) -> None:
        engine = LocalEngine(f"acme-{os.getpid()}-{next(_engine_names)}")
        super().__init__(
            kv_args, role=role, attn_tp_size=attn_tp_size, engine=engine, pp_size=pp_size
        )
        logger.debug("acme %s manager for rank %d", role.value, kv_args.engine_rank)

    def _on_message(self, frames: list[bytes]) -> None:
        if not self._dispatch_staging(frames):
            super()._on_message(frames)

    def _on_idle(self) -> None:
        staging_idle(self)
