"""A wrong declared type: `_staging_ctx: int | None`."""

from __future__ import annotations

from typing import ClassVar

from staging_contracts import (
    ArrivalMode,
    StagingHandler,
    StagingHostCheck,
    StagingManagerMixin,
)
from staging_contracts.backends._common import CommonKVManager


class WrongType(StagingManagerMixin, CommonKVManager):  # expect: plugin runtime
    __contract: ClassVar[StagingHostCheck[WrongType]]  # expect: all
    _staging_handler: StagingHandler | None = None
    _staging_ctx: int | None = None
    arrival: ArrivalMode = "zmq"
