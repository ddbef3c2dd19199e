"""Hosts that state their witness without postponed annotations: quoted, as Python requires
(the class name is not bound while its body runs)."""

from typing import ClassVar

from staging_contracts import (
    ArrivalMode,
    DecodeStagingContext,
    PrefillStagingContext,
    StagingHandler,
    StagingHostCheck,
    StagingManagerMixin,
)
from tests.hosts import CommonBase


class WholeQuoted(StagingManagerMixin, CommonBase):
    """The whole annotation quoted."""

    __contract: "ClassVar[StagingHostCheck[WholeQuoted]]"
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"


class NameQuoted(StagingManagerMixin, CommonBase):
    """Only the class name quoted (a forward reference inside the witness)."""

    __contract: ClassVar[StagingHostCheck["NameQuoted"]]
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"
