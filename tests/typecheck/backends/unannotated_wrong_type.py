"""A wrong type assigned, unannotated, in the class body: `_staging_ctx = 0`."""

from __future__ import annotations

from typing import ClassVar

from staging_contracts import (
    ArrivalMode,
    StagingHandler,
    StagingHostCheck,
    StagingManagerMixin,
)
from staging_contracts.backends._common import CommonKVManager


class Unannotated(StagingManagerMixin, CommonKVManager):  # expect: plugin runtime
    __contract: ClassVar[StagingHostCheck[Unannotated]]  # expect: all
    _staging_handler: StagingHandler | None = None
    _staging_ctx = 0
    arrival: ArrivalMode = "zmq"
