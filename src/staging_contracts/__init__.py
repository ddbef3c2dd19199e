"""staging-contracts: the staging path of PD-disaggregated LLM serving, with typed contracts.

The public surface is re-exported here; import from ``staging_contracts`` only.
"""

from __future__ import annotations

from .contract.contract import (
    ClassReport,
    Contract,
    MemberKind,
    MemberReport,
    MemberSpec,
    MemberStatus,
)
from .contract.enforcement import ContractMixin
from .contract.problems import ContractError, ContractProblem, ProblemKind
from .contract.witness import HostCheck
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
