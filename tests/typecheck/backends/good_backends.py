"""Conforming backends, in every way the runtime check accepts."""

from __future__ import annotations

from typing import ClassVar

from staging_contracts import (
    ArrivalMode,
    DecodeStagingContext,
    KVArgs,
    PrefillStagingContext,
    StagingHandler,
    StagingHostCheck,
    StagingManagerMixin,
)
from staging_contracts._decode.handler import DecodeStagingHandler
from staging_contracts.backends._common import CommonKVManager, Role
from staging_contracts.engines.local import LocalEngine


class Annotated(StagingManagerMixin, CommonKVManager):
    """Each member annotated on the class, ``arrival`` a property (as our backends)."""

    __contract: ClassVar[StagingHostCheck[Annotated]]
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None

    @property
    def arrival(self) -> ArrivalMode:
        """By ZMQ."""
        return "zmq"


class OwnWitness(Annotated):
    """A subclass stating its own witness (as Ascend under Mooncake): nothing is overridden."""

    __contract: ClassVar[StagingHostCheck[OwnWitness]]


class Narrower(StagingManagerMixin, CommonKVManager):
    """Narrower declared types, and ``arrival`` a plain attribute."""

    __contract: ClassVar[StagingHostCheck[Narrower]]
    _staging_handler: DecodeStagingHandler | None = None
    _staging_ctx: DecodeStagingContext | None = None
    arrival: ArrivalMode = "notification"


class AssignedInInit(StagingManagerMixin, CommonKVManager):
    """The staging members assigned in ``__init__`` only, without annotations."""

    __contract: ClassVar[StagingHostCheck[AssignedInInit]]
    arrival: ArrivalMode = "zmq"

    def __init__(self, kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> None:
        super().__init__(kv_args, role=role, attn_tp_size=attn_tp_size, engine=LocalEngine())
        self._staging_handler = None
        self._staging_ctx = None


class SharedBase(StagingManagerMixin, CommonKVManager, abstract=True):
    """An intermediate base (``abstract=True``): no witness, its subclasses state theirs."""


class FromSharedBase(SharedBase):
    """Declares what its base leaves out."""

    __contract: ClassVar[StagingHostCheck[FromSharedBase]]
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"
