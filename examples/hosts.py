"""Example hosts for ``staging-contracts check`` (see ``make demo``).

``ExampleKVManager`` mixes the staging logic into a common base and declares what the
contract asks for; ``MoriStyleKVManager`` is a backend without staging support: it declares
only what the common base has, so it could not be defined with the mixin (as
``examples/mori_with_staging.py`` shows with the in-tree Mori backend).
"""

from __future__ import annotations

from typing import ClassVar

from staging_contracts import (
    ArrivalMode,
    DecodeStagingContext,
    KVArgs,
    KVArgsRecord,
    PrefillStagingContext,
    StagingHandler,
    StagingHostCheck,
    StagingManagerMixin,
)


class ExampleCommonKVManager:
    """Stands in for a serving stack's common manager: KV arguments and TP size, no staging."""

    kv_args: KVArgs
    attn_tp_size: int

    def __init__(self, kv_args: KVArgs, attn_tp_size: int) -> None:
        self.kv_args = kv_args
        self.attn_tp_size = attn_tp_size


class ExampleKVManager(StagingManagerMixin, ExampleCommonKVManager):
    """A staging backend: the mixin first, then the common base; the staging members declared."""

    __contract: ClassVar[StagingHostCheck[ExampleKVManager]]
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"


class MoriStyleKVManager(ExampleCommonKVManager):
    """A backend without staging (like Mori): it must not use the mixin."""


def example_kv_args() -> KVArgsRecord:
    """KV arguments for a rank of a 2-way TP decode with 8 KV heads."""
    return KVArgsRecord(
        page_size=16,
        kv_item_lens=(16 * 4 * 128 * 2,) * 4,
        engine_rank=0,
        device="cpu",
        total_kv_head_num=8,
        kv_head_num=4,
        kv_layer_ids=(0, 1),
    )
