"""The summaries of ``check``, ``demo`` and ``soak`` as JSON documents (``--json PATH``).

Every document is one JSON object with these keys first (:data:`COMMON_KEYS`):

- ``schema``: :data:`SCHEMA` (an integer, raised when a key changes meaning or goes away;
  new keys may appear without it);
- ``command``: ``"check"``, ``"demo"`` or ``"soak"``;
- ``version``: the package's version (:func:`package_version`);
- ``verdict``: ``"PASS"`` or ``"FAIL"``, as the text summary's last line says;
- ``partial``: ``true`` when a signal stopped the run (``SIGTERM``, ``SIGINT``): the figures
  are what was measured until then, and the verdict is ``"FAIL"``;
- ``interrupted``: the signal's name, or ``null``;
- ``problems``: why the verdict is ``"FAIL"``, one line each (empty when it passed).

``demo`` (:func:`demo_summary`) adds ``config``, ``side``, ``rooms`` (``total``,
``succeeded``, ``failed``, ``unfinished`` and ``by_reason``: failed rooms by the category of
their first reason, as the soak groups them), ``failed_requests``, ``bytes``,
``elapsed_s``, ``gbps``, ``chunks``, ``control_messages``, ``ring_peaks`` and ``memory``.
``soak`` (:func:`soak_summary`) adds ``config``, ``elapsed_s``, ``rooms`` (``started``,
``succeeded``, ``failed``, ``corrupt``, ``hung``, ``prefill_failed``, ``by_reason`` and
``examples``), ``faults_injected``, ``kills``, ``stalls``, ``floods``, ``forges``,
``control``, ``end`` (what was left once idle) and ``memory``. ``check``
(:func:`check_summary`) adds ``exit_status`` and ``classes``. docs/operating.md shows each.

Byte counts are integers (``bytes``, ``*_bytes``), times are seconds (floats).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:  # the run's types; their modules import torch, this one must not
    from .runner import ClusterResult, RankReport
    from .soak_report import SoakResult


SCHEMA: Final = 1
"""The version of the documents' shape."""
COMMON_KEYS: Final = (
    "schema",
    "command",
    "version",
    "verdict",
    "partial",
    "interrupted",
    "problems",
)
"""The keys every document starts with."""
_DISTRIBUTION: Final = "staging-contracts"


def package_version() -> str:
    """The installed distribution's version, from its metadata; ``"unknown"`` when the
    package runs from a source tree that was never installed."""
    try:
        return metadata.version(_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def _head(command: str, problems: Sequence[str], interrupted: str | None) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "command": command,
        "version": package_version(),
        "verdict": "FAIL" if problems else "PASS",
        "partial": interrupted is not None,
        "interrupted": interrupted,
        "problems": list(problems),
    }


def _fields(config: object, names: str) -> dict[str, Any]:
    """``config``'s attributes named in ``names`` (space-separated), in that order."""
    return {name: getattr(config, name) for name in names.split()}


def check_target(path: str | os.PathLike[str]) -> None:
    """Refuse, before a run starts, a ``--json`` path that could not be written after it.

    Raises:
        ValueError: its folder does not exist or is not writable, or the path is a folder.
    """
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ValueError(f"--json {path}: is a folder")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ValueError(f"--json {path}: the folder {folder} does not exist or is not writable")


def write_summary(doc: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``doc`` to ``path`` as indented JSON, whole or not at all (a temporary file in
    the same folder, renamed over ``path``); returns the path.

    Raises:
        OSError: the folder cannot be written.
    """
    target = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(doc, out, indent=2, sort_keys=False)
            out.write("\n")
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


# --------------------------------------------------------------------------- check


@dataclass
class CheckRecord:
    """One ``MODULE:CLASS`` that ``check`` looked at."""

    target: str
    exit_status: int = 0
    """0: conforms; 1: does not; 2: it could not be imported (or is not a class)."""
    contracts: list[dict[str, Any]] = field(default_factory=list)
    """Per contract it was held to: ``{"protocol": NAME, "conforms": BOOL, "error": TEXT
    or null}``."""
    notes: list[str] = field(default_factory=list)
    """The notes printed under it (not failures)."""


_CHECK_STATUS: Final = {0: "conforms", 1: "does not conform", 2: "not importable"}


def check_summary(records: Sequence[CheckRecord], exit_status: int) -> dict[str, Any]:
    """``check``'s document: the common keys, ``exit_status`` and ``classes`` (each record,
    with ``status`` in words)."""
    problems = [
        f"{record.target}: {_CHECK_STATUS.get(record.exit_status, 'error')}"
        for record in records
        if record.exit_status
    ]
    return {
        **_head("check", problems, None),
        "exit_status": exit_status,
        "classes": [
            {**asdict(record), "status": _CHECK_STATUS.get(record.exit_status, "error")}
            for record in records
        ],
    }


# --------------------------------------------------------------------------- demo


def _room_marks(report: RankReport) -> dict[int, bool]:
    """Request index -> succeeded, as one rank reported it (in full, or what it had done
    when it stopped)."""
    fields = report.fields
    marks = dict(fields.rooms)
    marks.update(dict.fromkeys(fields.succeeded, True))
    marks.update(dict.fromkeys(fields.failed, False))
    return marks


def _demo_rooms(result: ClusterResult) -> dict[str, Any]:
    from .soak_report import reason_group  # noqa: PLC0415 - its module imports torch

    judge = "prefill" if result.side == "prefill" else "decode"
    reports = result.ranks(judge)
    marks = [_room_marks(r) for r in reports]
    reasons: dict[int, str] = {}
    for report in sorted(result.reports, key=lambda r: (r.role != judge, r.rank)):
        for index, reason in report.fields.failed.items():
            reasons.setdefault(index, str(reason))
    total = result.config.requests
    failed = set(result.failed_requests) | {i for m in marks for i, ok in m.items() if not ok}
    succeeded = {
        i
        for i in range(total)
        if i not in failed and marks and all(m.get(i) is True for m in marks)
    }
    by_reason = Counter(
        reason_group(reasons[index]) if index in reasons else "rank died"
        for index in sorted(failed)
    )
    return {
        "total": total,
        "succeeded": len(succeeded),
        "failed": len(failed),
        "unfinished": total - len(succeeded) - len(failed),
        "by_reason": dict(by_reason),
    }


def _demo_problems(result: ClusterResult) -> list[str]:
    if result.verified and result.interrupted is None:
        return []
    out = [f"interrupted by {result.interrupted}: a partial run"] if result.interrupted else []
    return out + result.errors() + result.problems() or ["not every page verified"]


def demo_summary(result: ClusterResult) -> dict[str, Any]:
    """``demo``'s document (see the module's docstring): what :func:`~.demo.format_summary`
    prints, as data. ``bytes``, ``gbps`` and ``ring_peaks`` are ``null`` on the side that
    does not measure them (``bytes`` and ``gbps`` on decode, ``ring_peaks`` on prefill)."""
    config = result.config
    prefill_here = result.side != "decode"
    decode_here = result.side != "prefill"
    sides = [role for role in ("prefill", "decode") if result.side in ("all", role)]
    return {
        **_head("demo", _demo_problems(result), result.interrupted),
        "config": _fields(
            config,
            "backend device prefill_tp decode_tp kv_heads layers head_dim dtype requests tokens "
            "page_size chunk_pages host",
        ),
        "side": result.side,
        "rooms": _demo_rooms(result),
        "failed_requests": sorted(result.failed_requests),
        "bytes": result.bytes_moved if prefill_here else None,
        "elapsed_s": result.elapsed_s,
        "gbps": result.gbps if prefill_here else None,
        "chunks": result.chunks if decode_here else None,
        "control_messages": result.control_messages,
        "ring_peaks": {
            str(rank): {"reserved_peak_bytes": peak, "ring_bytes": size}
            for rank, (peak, size) in sorted(result.ring_peaks().items())
        }
        if decode_here
        else None,
        "memory": {
            role: {
                str(rank): asdict(memory)
                for rank, memory in sorted(result.transfer_memory(role).items())
            }
            for role in sides
        },
        "first_failure": None
        if result.first_death is None
        else {
            "role": result.first_death.role,
            "rank": result.first_death.rank,
            "reason": result.first_death.reason,
        },
    }


# --------------------------------------------------------------------------- soak


def soak_summary(result: SoakResult) -> dict[str, Any]:
    """``soak``'s document (see the module's docstring): what
    :func:`~.soak_report.format_summary` prints, as data. Times in the fault records
    (``at_s``) are seconds since the soak started, as in the text."""
    config = result.config
    memory = result.memory
    return {
        **_head("soak", result.problems, result.interrupted),
        "config": {
            **_fields(
                config,
                "backend duration_s faults prefill_tp decode_tp prefill_instances "
                "rooms_in_flight seed host",
            ),
            "faults": list(config.faults),  # keeps its place, third
        },
        "elapsed_s": result.elapsed_s,
        "rooms": {
            "started": result.rooms_started,
            "succeeded": result.rooms_succeeded,
            "failed": result.rooms_failed,
            "corrupt": result.corrupt,
            "hung": result.hung,
            "prefill_failed": result.rooms_prefill_failed,
            "by_reason": dict(result.failed_by_reason),
            "examples": dict(result.failure_examples),
            "corrupt_details": list(result.corrupt_details),
            "hung_details": list(result.hung_details),
        },
        "bytes": result.bytes_verified,
        "faults_injected": dict(result.faults_injected),
        "kills": [asdict(kill) for kill in result.kills],
        "stalls": [asdict(stall) for stall in result.stalls],
        "floods": [asdict(flood) for flood in result.floods],
        "forges": [asdict(forge) for forge in result.forges],
        "unauthorized": result.unauthorized,
        "control": {"sent": result.control_sent, "dropped": result.control_dropped},
        "end": {
            "idle": result.idle_reached,
            "ring_live_bytes": result.ring_live_bytes_end,
            "ring_live_regions": result.ring_live_regions_end,
            "fenced_rooms": result.fenced_rooms_end,
            "open_rooms": result.open_rooms_end,
            "listener_restarts": result.listener_restarts,
            "listener_errors": result.listener_errors,
            "unexpected_exits": list(result.unexpected_exits),
            "rank_errors": list(result.rank_errors),
        },
        "memory": {
            "flat": memory.flat,
            "judged": memory.judged,
            "warmup_s": memory.warmup_s,
            "processes": [asdict(process) for process in memory.processes],
        },
    }
