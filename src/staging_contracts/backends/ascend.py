"""``AscendKVManager``: staging on Ascend NPUs, through Mooncake's transfer engine.

It inherits the staging logic through :class:`MooncakeKVManager`; its own class statement is
checked by the contract like any other. On Ascend clusters Mooncake runs its ``ascend``
transport; elsewhere any Mooncake protocol can be chosen (tests use ``tcp``).
"""

from __future__ import annotations

from typing import ClassVar

from ..mixin import StagingHostCheck
from ..protocols import KVArgs
from ._common import Role
from .mooncake import MooncakeKVManager

__all__ = ["AscendKVManager"]


class AscendKVManager(MooncakeKVManager):
    """Mooncake staging with Ascend's defaults.

    Args:
        kv_args: this rank's KV arguments (``device`` like ``"npu:0"`` on Ascend).
        role: prefill or decode.
        attn_tp_size: attention TP size of this side.
        pp_size: pipeline-parallel size of this side.
        host: address the engine and the control listener bind.
        protocol: Mooncake transport; ``"ascend"`` on Ascend clusters.
        device_name: the NPU device(s) for Mooncake.
    """

    __contract: ClassVar[StagingHostCheck[AscendKVManager]]

    def __init__(
        self,
        kv_args: KVArgs,
        *,
        role: Role,
        attn_tp_size: int,
        pp_size: int = 1,
        host: str = "127.0.0.1",
        protocol: str = "ascend",
        device_name: str = "",
    ) -> None:
        super().__init__(
            kv_args,
            role=role,
            attn_tp_size=attn_tp_size,
            pp_size=pp_size,
            host=host,
            protocol=protocol,
            device_name=device_name,
        )
