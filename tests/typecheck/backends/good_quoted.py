"""Conforming backends without postponed annotations: the witness quoted."""

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


class WholeQuoted(StagingManagerMixin, CommonKVManager):
    """The whole annotation quoted."""

    __contract: "ClassVar[StagingHostCheck[WholeQuoted]]"
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"


class NameQuoted(StagingManagerMixin, CommonKVManager):
    """Only the class name quoted."""

    __contract: ClassVar[StagingHostCheck["NameQuoted"]]
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"
