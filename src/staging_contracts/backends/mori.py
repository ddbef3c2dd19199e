"""``MoriKVManager``: a backend without staging support.

It is a plain :class:`CommonKVManager`. Mixing the staging logic into it fails at class
creation: it declares neither ``_staging_handler`` nor ``_staging_ctx``, so
``class MoriWithStaging(StagingManagerMixin, MoriKVManager)`` raises ``ContractError``.
Heterogeneous-TP transfers on Mori go the per-token way; staging messages sent to it are
rejected as malformed (counted by its listener, which keeps serving).
"""

from __future__ import annotations

from ..protocols import KVArgs, TransferEngine
from ._common import CommonKVManager, Role

__all__ = ["MoriKVManager"]


class MoriKVManager(CommonKVManager):
    """A KV manager over a Mori-style engine, with no staging.

    Args:
        kv_args: this rank's KV arguments.
        role: prefill or decode.
        attn_tp_size: attention TP size of this side.
        engine: the transfer engine (Mori's own on AMD clusters; any engine here).
        pp_size: pipeline-parallel size of this side.
        host: address the control listener binds.
    """

    def __init__(
        self,
        kv_args: KVArgs,
        *,
        role: Role,
        attn_tp_size: int,
        engine: TransferEngine,
        pp_size: int = 1,
        host: str = "127.0.0.1",
    ) -> None:
        super().__init__(
            kv_args, role=role, attn_tp_size=attn_tp_size, engine=engine, pp_size=pp_size, host=host
        )
