"""The lockstep between ``run_transfer(..., processes=True)`` and its rank processes, typed:
each step's event (rank → harness) and command (harness → rank), frozen
:class:`~staging_contracts._run._codec.Message` values on the run layer's one codec, sent
over the rank's pipe (:mod:`~staging_contracts.testing._processes`).

The steps, in order: :class:`Joined` → :class:`Wire`, :class:`Wired` → :class:`Arm`,
:class:`Armed` → :class:`Go`, :class:`Settled` → :class:`Finish`, :class:`Finished` →
:class:`Close`, then the rank's report (:class:`DecodeReported` or :class:`PrefillReported`).
A rank that cannot go on sends a :class:`~staging_contracts.testing._processes.Failure`
instead (:class:`ProcessLocal` when its engine stays within one process).

**Threads:** messages are immutable values (any thread).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from .._run._codec import Message
from .._run._rank_info import RankInfo
from ..backends._kv_requests import KVPoll
from ..stats import StagingStats
from ._processes import Failure

Outcome: TypeAlias = tuple[KVPoll, str | None]
"""A rank's final state of a room and its failure text."""


@dataclass(frozen=True, slots=True)
class DecodeReport:
    """What a decode rank reports once its manager is closed (no arrival or scatter is late)."""

    chunks_ok: list[list[bool]]
    """Per room, per chunk: it landed bit for bit here."""
    arrivals: list[int]
    """Per room: writer arrivals this rank's handler accepted."""
    stray: set[int]
    """Pages outside every room written here."""
    stats: StagingStats


# ---------------------------------------------------------------- a rank's events


@dataclass(frozen=True, slots=True)
class Joined(Message):
    """The rank's manager is built: what it publishes, and whether its engine notifies
    arrivals (prefill)."""

    info: RankInfo
    notifies: bool


@dataclass(frozen=True, slots=True)
class Wired(Message):
    """The rank trusts every peer and its listener runs."""


@dataclass(frozen=True, slots=True)
class Armed(Message):
    """Decode registered every room (prefill: nothing to do)."""


@dataclass(frozen=True, slots=True)
class Settled(Message):
    """Every room ended here, or the run's time ran out: each room's final state."""

    outcomes: tuple[Outcome, ...]


@dataclass(frozen=True, slots=True)
class Finished(Message):
    """The rooms still running were failed (decode) or heard so (prefill)."""


@dataclass(frozen=True, slots=True)
class DecodeReported(Message):
    """A decode rank closed; its report."""

    report: DecodeReport


@dataclass(frozen=True, slots=True)
class PrefillReported(Message):
    """A prefill rank closed; its staging counters."""

    stats: StagingStats


@dataclass(frozen=True, slots=True)
class ProcessLocal(Failure):
    """The rank's engine stays within one process (``error`` says why): it cannot run here."""


# ---------------------------------------------------------------- the harness's commands


@dataclass(frozen=True, slots=True)
class Wire(Message):
    """Every rank's :class:`Joined` info: trust the peers, start the listener."""

    ranks: tuple[RankInfo, ...]


@dataclass(frozen=True, slots=True)
class Arm(Message):
    """Every rank is wired: decode registers the rooms."""


@dataclass(frozen=True, slots=True)
class Go(Message):
    """Every rank is armed: prefill stages the rooms."""


@dataclass(frozen=True, slots=True)
class Finish(Message):
    """Every rank settled: end the rooms still running."""


@dataclass(frozen=True, slots=True)
class Close(Message):
    """Close the manager and report."""
