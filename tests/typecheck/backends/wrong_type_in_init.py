"""A wrong type assigned, unannotated, in `__init__`: `self._staging_ctx = 0`."""

from __future__ import annotations

from typing import ClassVar

from staging_contracts import (
    ArrivalMode,
    StagingHandler,
    StagingHostCheck,
    StagingManagerMixin,
)
from staging_contracts.backends._common import CommonKVManager


class WrongInInit(StagingManagerMixin, CommonKVManager):  # expect: plugin
    __contract: ClassVar[StagingHostCheck[WrongInInit]]  # expect: pyright ty pyrefly
    _staging_handler: StagingHandler | None = None
    arrival: ArrivalMode = "zmq"

    def __init__(self) -> None:
        self._staging_ctx = 0
