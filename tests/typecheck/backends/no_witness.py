"""No witness: a member missing, and only the mypy plugin sees it before run time."""

from __future__ import annotations

from staging_contracts import (
    ArrivalMode,
    StagingHandler,
    StagingManagerMixin,
)
from staging_contracts.backends._common import CommonKVManager


class Unwitnessed(StagingManagerMixin, CommonKVManager):  # expect: plugin runtime
    _staging_handler: StagingHandler | None = None
    arrival: ArrivalMode = "zmq"
