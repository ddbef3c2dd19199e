"""Hosts declared with postponed annotations and forward references."""

from __future__ import annotations

from typing import TYPE_CHECKING

from staging_contracts import (
    ArrivalMode,
    DecodeStagingContext,
    PrefillStagingContext,
    StagingManagerMixin,
)
from tests.hosts import CommonBase, RecordingHandler

if TYPE_CHECKING:
    from staging_contracts import StagingHandler as HandlerOnlyForTypeCheckers


class ForwardRefHost(StagingManagerMixin, CommonBase):
    """Names a handler class that this module defines only further down."""

    _staging_handler: LaterHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"


class TypeCheckingOnlyHost(StagingManagerMixin, CommonBase):
    """Names a type imported only under TYPE_CHECKING."""

    _staging_handler: HandlerOnlyForTypeCheckers | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"


class LaterHandler(RecordingHandler):
    """A handler defined after the host that names it."""
