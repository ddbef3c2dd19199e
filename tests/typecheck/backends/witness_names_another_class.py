"""A witness naming another (conforming) class: no checker can tell, the class check can."""

from __future__ import annotations

from typing import ClassVar

from staging_contracts import (
    ArrivalMode,
    DecodeStagingContext,
    PrefillStagingContext,
    StagingHandler,
    StagingHostCheck,
    StagingManagerMixin,
)
from staging_contracts.backends._common import CommonKVManager


class Original(StagingManagerMixin, CommonKVManager):
    __contract: ClassVar[StagingHostCheck[Original]]
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"


class Copied(Original):  # expect: runtime
    __contract: ClassVar[StagingHostCheck[Original]]
