"""A backend module of its own, so that its logger name differs from the tests'."""

from __future__ import annotations

from staging_contracts import (
    ArrivalMode,
    DecodeStagingContext,
    PrefillStagingContext,
    StagingHandler,
    StagingManagerMixin,
)
from tests.hosts import CommonBase


class LoggingBackend(StagingManagerMixin, CommonBase):
    """A conforming backend defined in this module."""

    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"
