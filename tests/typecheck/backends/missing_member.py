"""A member missing: no `_staging_ctx`."""

from __future__ import annotations

from typing import ClassVar

from staging_contracts import (
    ArrivalMode,
    StagingHandler,
    StagingHostCheck,
    StagingManagerMixin,
)
from staging_contracts.backends._common import CommonKVManager


class HalfDone(StagingManagerMixin, CommonKVManager):  # expect: plugin runtime
    __contract: ClassVar[StagingHostCheck[HalfDone]]  # expect: all
    _staging_handler: StagingHandler | None = None
    arrival: ArrivalMode = "zmq"
