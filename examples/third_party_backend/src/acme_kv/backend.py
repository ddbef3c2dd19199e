"""``AcmeKVManager``: a staging backend over the in-process ``LocalEngine``, or any engine.

What a backend needs to satisfy the ``StagingHost`` contract of ``StagingManagerMixin``:

* the mixin listed *before* the common base;
* its witness, ``__contract: ClassVar[StagingHostCheck[AcmeKVManager]]``, the first statement
  of its body: every type checker (mypy, pyright, ty, pyrefly) then reports a broken contract
  on that line, with no plugin;
* the two staging members declared with their types (``kv_args`` and ``attn_tp_size`` come
  from ``CommonKVManager``; ``kv_buffer_tensors`` is optional);
* its staging capability, ``arrival``: how its prefill writers tell decode that a write
  landed (by the engine's notification where the engine has them, else ``CHUNK_READY``);
* staging messages from the control listener handed to ``_dispatch_staging``, and the
  listener's idle work to ``staging_idle``.

Its ranks live in one process over ``LocalEngine`` (the default: the kit and the harness) or in
separate processes over an engine that crosses them: :func:`over_nixl` builds one over a NIXL
agent (``staging-contracts demo --backend
acme_kv.backend:AcmeKVManager=acme_kv.backend:over_nixl``), and :class:`AcmeNixlKVManager`
does the same with the standard constructor (registered as ``acme-nixl``).
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import ClassVar

from staging_contracts import (
    ArrivalMode,
    DecodeStagingContext,
    KVArgs,
    KVBufferTensors,
    PrefillStagingContext,
    StagingHandler,
    StagingHostCheck,
    StagingManagerMixin,
    TransferEngine,
)
from staging_contracts.backends import CommonKVManager, Role, staging_idle
from staging_contracts.engines import load_engine_class
from staging_contracts.engines.local import LocalEngine

__all__ = ["AcmeKVManager", "AcmeNixlKVManager", "over_nixl"]

logger = logging.getLogger(__name__)

_engine_names = itertools.count(1)


class AcmeKVManager(StagingManagerMixin, CommonKVManager):
    """Acme's KV manager: staging over ``LocalEngine`` (prefill and decode in one process),
    or over the engine it is given.

    Args:
        kv_args: this rank's KV arguments (``device`` must be a CPU device).
        role: prefill or decode.
        attn_tp_size: attention TP size of this side.
        pp_size: pipeline-parallel size of this side.
        engine: the transfer engine; ``None`` (the default) makes an in-process
            ``LocalEngine``, whose peers must live in this process.
        host: address the control listener binds (loopback by default).
    """

    __contract: ClassVar[StagingHostCheck[AcmeKVManager]]

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
        engine: TransferEngine | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        if engine is None:
            engine = LocalEngine(f"acme-{os.getpid()}-{next(_engine_names)}")
        super().__init__(
            kv_args,
            role=role,
            attn_tp_size=attn_tp_size,
            engine=engine,
            pp_size=pp_size,
            host=host,
        )
        logger.debug("acme %s manager for rank %d", role.value, kv_args.engine_rank)

    @property
    def arrival(self) -> ArrivalMode:
        """By the engine's notification where it has them (``LocalEngine``, NIXL)."""
        return "notification" if self.engine.supports_notifications else "zmq"

    def _on_message(self, frames: list[bytes]) -> None:
        if not self._dispatch_staging(frames):
            super()._on_message(frames)

    def _on_idle(self) -> None:
        staging_idle(self)


def over_nixl(
    kv_args: KVArgs, *, role: Role, attn_tp_size: int, host: str = "127.0.0.1"
) -> AcmeKVManager:
    """An ``AcmeKVManager`` over a NIXL agent (UCX, CPU memory), so that its peers may live in
    other processes: the factory of ``--backend
    acme_kv.backend:AcmeKVManager=acme_kv.backend:over_nixl``. ``host`` is where the control
    listener binds and UCX listens. Needs ``staging-contracts[nixl]``.
    """
    return AcmeKVManager(
        kv_args, role=role, attn_tp_size=attn_tp_size, engine=_nixl_engine(host), host=host
    )


class AcmeNixlKVManager(AcmeKVManager):
    """``AcmeKVManager`` over a NIXL agent with the standard constructor (registered as
    ``acme-nixl``): what :func:`over_nixl` builds, for ``--backend acme-nixl``."""

    __contract: ClassVar[StagingHostCheck[AcmeNixlKVManager]]

    def __init__(
        self, kv_args: KVArgs, *, role: Role, attn_tp_size: int, host: str = "127.0.0.1"
    ) -> None:
        super().__init__(
            kv_args, role=role, attn_tp_size=attn_tp_size, engine=_nixl_engine(host), host=host
        )


def _nixl_engine(host: str) -> TransferEngine:
    """A NIXL agent on CPU memory that listens on ``host``'s interface, without InfiniBand."""
    engine_class = load_engine_class("nixl")
    engine: TransferEngine = engine_class(None, host=host, load_ib_modules=False)
    return engine
