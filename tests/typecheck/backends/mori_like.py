"""A Mori-like host: the staging members declared (as SGLang's common base does), no `arrival`."""

from __future__ import annotations

from typing import ClassVar

from staging_contracts import (
    DecodeStagingContext,
    PrefillStagingContext,
    StagingHandler,
    StagingHostCheck,
    StagingManagerMixin,
)
from staging_contracts.backends._common import CommonKVManager


class MoriLike(StagingManagerMixin, CommonKVManager):  # expect: plugin runtime
    __contract: ClassVar[StagingHostCheck[MoriLike]]  # expect: all
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
