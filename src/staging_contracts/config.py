"""Every timeout and size an operator may set from the environment, in one table.

Each :class:`Setting` names a ``STAGING_CONTRACTS_*`` variable, its type and default, and the
constructor argument it feeds. The precedence is fixed: an explicit argument wins over the
variable, the variable over the default (:meth:`Setting.value`). A variable that is set but
unusable (not a number, negative, out of range, an unknown word) raises :class:`ConfigError`,
naming the variable and its value, where the object it configures is built (at start, never
on the hot path). An unset or blank variable means the default.

The table (:data:`SETTINGS`) is what ``docs/operating.md`` shows (:func:`markdown_table`; a
test keeps the page equal to it). Variables that are not constructor arguments (the cluster
secret, the CLI's debug switch) are documented there too, but live with their code.

**Threads:** pure; the environment is read when a setting is resolved, any thread.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

__all__ = [
    "EARLY_META_PER_PEER",
    "FENCE_TIMEOUT_S",
    "INTEGRITY",
    "LIVENESS_INTERVAL_S",
    "LIVENESS_TIMEOUT_S",
    "MAX_ROOMS_PER_PEER",
    "META_TIMEOUT_S",
    "PREFILL_ANSWER_S",
    "PREFILL_DEADLINE_S",
    "PREFILL_READY_S",
    "RING_BYTES",
    "RING_SHARE",
    "ROOM_TIMEOUT_S",
    "SETTINGS",
    "STALL_TIMEOUT_S",
    "ConfigError",
    "Setting",
    "markdown_table",
]

_T = TypeVar("_T", int, float, bool)


class ConfigError(ValueError):
    """A ``STAGING_CONTRACTS_*`` variable holds a value that cannot be used; the message names
    the variable, its value and what it must be."""

    def __init__(self, name: str, raw: str, why: str) -> None:
        super().__init__(f"{name}={raw!r}: {why}")
        self.name = name
        """The variable."""
        self.raw = raw
        """Its value, as set."""


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(name, raw, "not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(name, raw, "must be a finite number of seconds > 0")
    return value


def _count(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(name, raw, "not a whole number") from None
    if value < 1:
        raise ConfigError(name, raw, "must be >= 1")
    return value


def _fraction(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(name, raw, "not a number") from None
    if not 0 < value <= 1:
        raise ConfigError(name, raw, "must be in (0, 1]")
    return value


_ON: Final = frozenset({"1", "on", "true", "yes"})
_OFF: Final = frozenset({"0", "off", "false", "no"})


def _switch(name: str, raw: str) -> bool:
    word = raw.strip().lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise ConfigError(name, raw, "use 1/on/true or 0/off/false")


_KINDS: Final[dict[str, Callable[[str, str], Any]]] = {
    "seconds": _seconds,
    "count": _count,
    "bytes": _count,
    "fraction": _fraction,
    "switch": _switch,
}
"""How each kind of value is read (and what it must be)."""


@dataclass(frozen=True, slots=True)
class Setting(Generic[_T]):
    """One variable of the table: where it goes and how it is read."""

    name: str
    """The environment variable."""
    kind: str
    """``seconds`` (> 0), ``count`` and ``bytes`` (whole, >= 1), ``fraction`` (in (0, 1]) or
    ``switch`` (1/on/true, 0/off/false)."""
    default: _T
    """The value when neither the argument nor the variable is given."""
    argument: str
    """The constructor argument it feeds (``Class(name=...)``)."""
    description: str
    """What it bounds, in one line (the docs table's)."""

    def from_env(self, environ: Mapping[str, str] | None = None) -> _T | None:
        """The variable's value (``None`` when unset or blank).

        Raises:
            ConfigError: the variable is set to something unusable.
        """
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or not raw.strip():
            return None
        value: _T = _KINDS[self.kind](self.name, raw.strip())
        return value

    def value(self, explicit: _T | None = None, environ: Mapping[str, str] | None = None) -> _T:
        """``explicit`` if given, else the variable's value, else :attr:`default`.

        **Called by:** the constructor :attr:`argument` names, once. **Blocking:** no.

        Raises:
            ConfigError: ``explicit`` is ``None`` and the variable is unusable.
        """
        if explicit is not None:
            return explicit
        found = self.from_env(environ)
        return self.default if found is None else found

    def value_or(self, default: _T, environ: Mapping[str, str] | None = None) -> _T:
        """The variable's value, else ``default``: a command's own default, for a command
        that passes the argument explicitly (the command line's option, when given, goes
        first and never reaches here).

        **Called by:** ``demo`` and ``soak`` (the driver), at start. **Blocking:** no.

        Raises:
            ConfigError: the variable is unusable.
        """
        found = self.from_env(environ)
        return default if found is None else found

    def source(self, explicit: object = None, environ: Mapping[str, str] | None = None) -> str:
        """Where :meth:`value` takes the value from, for an error message: ``argument=...``
        when ``explicit`` is given, else ``NAME=RAW`` when the variable is set, else
        ``argument default``."""
        if explicit is not None:
            return f"{self.argument.split('(')[-1].rstrip('.)')}{explicit!r}"
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is not None and raw.strip():
            return f"{self.name}={raw.strip()}"
        return f"the default {self.default!r}"


LIVENESS_TIMEOUT_S: Final[Setting[float]] = Setting(
    "STAGING_CONTRACTS_LIVENESS_TIMEOUT_S",
    "seconds",
    5.0,
    "PeerLiveness(timeout_s=...)",
    "a watched peer silent this long is declared dead and its rooms fail",
)
LIVENESS_INTERVAL_S: Final[Setting[float]] = Setting(
    "STAGING_CONTRACTS_LIVENESS_INTERVAL_S",
    "seconds",
    0.5,
    "PeerLiveness(interval_s=...)",
    "how often watched peers are sent PING (must stay below the liveness timeout)",
)
STALL_TIMEOUT_S: Final[Setting[float]] = Setting(
    "STAGING_CONTRACTS_STALL_TIMEOUT_S",
    "seconds",
    10.0,
    "DecodeStagingHandler(stall_timeout_s=...)",
    "a room holding a writable ring region with no arrival this long fails",
)
ROOM_TIMEOUT_S: Final[Setting[float]] = Setting(
    "STAGING_CONTRACTS_ROOM_TIMEOUT_S",
    "seconds",
    30.0,
    "DecodeStagingHandler(room_timeout_s=...)",
    "a registered room with no region and no STAGING_REQ this long fails",
)
FENCE_TIMEOUT_S: Final[Setting[float]] = Setting(
    "STAGING_CONTRACTS_FENCE_TIMEOUT_S",
    "seconds",
    10.0,
    "DecodeStagingHandler(fence_timeout_s=...)",
    "a fence live writers leave unanswered this long frees its regions anyway",
)
MAX_ROOMS_PER_PEER: Final[Setting[int]] = Setting(
    "STAGING_CONTRACTS_MAX_ROOMS_PER_PEER",
    "count",
    1024,
    "DecodeStagingHandler(max_rooms_per_peer=...)",
    "most rooms one prefill instance may have registered at once on a decode rank",
)
RING_SHARE: Final[Setting[float]] = Setting(
    "STAGING_CONTRACTS_RING_SHARE",
    "fraction",
    1.0,
    "DecodeStagingHandler(ring_share=...)",
    "largest share of the ring one prefill instance may hold at once",
)
RING_BYTES: Final[Setting[int]] = Setting(
    "STAGING_CONTRACTS_RING_BYTES",
    "bytes",
    64 << 20,
    "enable_decode_staging(ring_bytes=...)",
    "size of each decode rank's staging ring",
)
INTEGRITY: Final[Setting[bool]] = Setting(
    "STAGING_CONTRACTS_INTEGRITY",
    "switch",
    False,
    "StagingWriter(integrity=...), DecodeStagingHandler(integrity=...)",
    "digests of staged chunks, computed by writers and checked by decode",
)
PREFILL_DEADLINE_S: Final[Setting[float]] = Setting(
    "STAGING_CONTRACTS_PREFILL_DEADLINE_S",
    "seconds",
    30.0,
    "PrefillTimeouts(deadline_s=...)",
    "a prefill chunk without progress (no answer, no ring movement) this long fails its room",
)
PREFILL_ANSWER_S: Final[Setting[float]] = Setting(
    "STAGING_CONTRACTS_PREFILL_ANSWER_S",
    "seconds",
    0.5,
    "PrefillTimeouts(answer_s=...)",
    "a chunk waits this long for STAGING_RSP before asking again",
)
PREFILL_READY_S: Final[Setting[float]] = Setting(
    "STAGING_CONTRACTS_PREFILL_READY_S",
    "seconds",
    0.5,
    "PrefillTimeouts(ready_s=...)",
    "a chunk waits this long for the watermark before asking again",
)
META_TIMEOUT_S: Final[Setting[float]] = Setting(
    "STAGING_CONTRACTS_META_TIMEOUT_S",
    "seconds",
    30.0,
    "PrefillTransfers(meta_timeout_s=...)",
    "a prefill room waits this long for decode's ROOM_META (and holds an early one as long)",
)
EARLY_META_PER_PEER: Final[Setting[int]] = Setting(
    "STAGING_CONTRACTS_EARLY_META_PER_PEER",
    "count",
    256,
    "PrefillTransfers(early_meta_per_peer=...)",
    "most ROOM_META for rooms not opened yet held per sender",
)

SETTINGS: Final[tuple[Setting[Any], ...]] = (
    LIVENESS_TIMEOUT_S,
    LIVENESS_INTERVAL_S,
    STALL_TIMEOUT_S,
    ROOM_TIMEOUT_S,
    FENCE_TIMEOUT_S,
    MAX_ROOMS_PER_PEER,
    RING_SHARE,
    RING_BYTES,
    INTEGRITY,
    PREFILL_DEADLINE_S,
    PREFILL_ANSWER_S,
    PREFILL_READY_S,
    META_TIMEOUT_S,
    EARLY_META_PER_PEER,
)
"""The table, in the docs' order."""


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return repr(value)


def markdown_table() -> str:
    """:data:`SETTINGS` as the Markdown table of ``docs/operating.md`` (header included)."""
    lines = [
        "| variable | kind | default | argument | what it bounds |",
        "|---|---|---|---|---|",
    ]
    lines.extend(
        f"| `{s.name}` | {s.kind} | `{_shown(s.default)}` | `{s.argument}` | {s.description} |"
        for s in SETTINGS
    )
    return "\n".join(lines)
