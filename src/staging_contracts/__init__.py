"""staging-contracts: the staging path of PD-disaggregated LLM serving, with typed contracts.

The public surface is re-exported here: the contract, its mixin and types, the wire's error.
A backend's building blocks are in :mod:`staging_contracts.backends`, the engines in
:mod:`staging_contracts.engines`, the contract kit and the transfer harness in
:mod:`staging_contracts.testing`; every module or package whose name starts with ``_`` is
internal (its names may change in any release).
"""

from __future__ import annotations

from ._contract.contract import (
    ClassReport,
    Contract,
    MemberKind,
    MemberReport,
    MemberSpec,
    MemberStatus,
)
from ._contract.enforcement import ContractMixin
from ._contract.problems import ContractError, ContractProblem, ProblemKind
from ._contract.witness import HostCheck
from ._control.wire import MalformedMessage
from .mixin import STAGING_CONTRACT, StagingHostCheck, StagingManagerMixin
from .protocols import (
    Allocation,
    ArrivalMode,
    ArrivalOutcome,
    DecodeStagingContext,
    KVArgs,
    KVArgsRecord,
    KVBufferTensors,
    Notification,
    PrefillStagingContext,
    RegionAnswer,
    RegionBook,
    StagingHandler,
    StagingHost,
    StagingHostCore,
    StagingReqOutcome,
    StagingRing,
    Transfer,
    TransferEngine,
    TransferError,
    Watermark,
    WatermarkBook,
)
from .stats import StagingCounters, StagingStats

__all__ = [
    "STAGING_CONTRACT",
    "Allocation",
    "ArrivalMode",
    "ArrivalOutcome",
    "ClassReport",
    "Contract",
    "ContractError",
    "ContractMixin",
    "ContractProblem",
    "DecodeStagingContext",
    "HostCheck",
    "KVArgs",
    "KVArgsRecord",
    "KVBufferTensors",
    "MalformedMessage",
    "MemberKind",
    "MemberReport",
    "MemberSpec",
    "MemberStatus",
    "Notification",
    "PrefillStagingContext",
    "ProblemKind",
    "RegionAnswer",
    "RegionBook",
    "StagingCounters",
    "StagingHandler",
    "StagingHost",
    "StagingHostCheck",
    "StagingHostCore",
    "StagingManagerMixin",
    "StagingReqOutcome",
    "StagingRing",
    "StagingStats",
    "Transfer",
    "TransferEngine",
    "TransferError",
    "Watermark",
    "WatermarkBook",
]

__version__ = "0.1.0"


def _claim_public_names() -> None:
    """Give every public class and function this package as its ``__module__``."""
    for name in __all__:
        obj = globals()[name]
        if isinstance(obj, type) or callable(obj):
            obj.__module__ = __name__


_claim_public_names()
