"""The log lines of every process of a run: when, who, what, and which room.

Each process of ``demo``, ``soak`` and ``bench`` (the driver, and every rank process it
starts) writes its log lines to stderr through :func:`install` in one of two formats:

- ``text`` (the default): ``2026-12-03T06:09:03.123+00:00 [soak decode0 pid 4242] WARNING
  staging_contracts._decode.handler: room 17 failed: ... [room 17]``
- ``json``: one JSON object per line, with the keys of :data:`JSON_KEYS` (``time``,
  ``level``, ``logger``, ``message``, ``room``, ``rank``, ``role``, ``pid``), and ``exc``
  (the formatted traceback) when the line carries one. ``room``, ``rank`` and ``role`` are
  ``null`` where they do not apply (the driver has no rank).

The time is the record's, in UTC, ISO 8601 with milliseconds. The room is the structured
field the library passes with every log call about one room (``extra={"room": room}``); the
text format shows it at the end of the line.

The format is chosen by ``--log-format`` on the command line, or by
:data:`LOG_FORMAT_ENV` (``STAGING_CONTRACTS_LOG_FORMAT=json|text``), which the CLI sets for
the rank processes it starts (they inherit its environment).

**Threads:** the handler may be called from any thread (``logging`` holds its lock).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Final

LOG_FORMAT_ENV: Final = "STAGING_CONTRACTS_LOG_FORMAT"
"""``text`` (default) or ``json``: the format of every process's log lines."""
LOG_FORMATS: Final = ("text", "json")
JSON_KEYS: Final = ("time", "level", "logger", "message", "room", "rank", "role", "pid")
"""The keys of every JSON log line, in this order (``exc`` follows, when there is one)."""


def log_format(environ: Mapping[str, str] | None = None) -> str:
    """The format :data:`LOG_FORMAT_ENV` asks for (``text`` when it is unset or empty).

    Raises:
        ValueError: it names neither ``text`` nor ``json``.
    """
    env = os.environ if environ is None else environ
    value = env.get(LOG_FORMAT_ENV, "").strip().lower() or "text"
    if value not in LOG_FORMATS:
        raise ValueError(
            f"{LOG_FORMAT_ENV}={env.get(LOG_FORMAT_ENV)!r}: choose {' or '.join(LOG_FORMATS)}"
        )
    return value


def _time(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")


def _room(record: logging.LogRecord) -> Any:
    room = getattr(record, "room", None)
    return room if room is None or isinstance(room, int | str) else str(room)


class TextFormatter(logging.Formatter):
    """``TIME [WHO] LEVEL LOGGER: MESSAGE [room N]``, then the traceback, if any."""

    def __init__(self, who: str) -> None:
        super().__init__()
        self._who = who

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_time(record)} [{self._who}] {record.levelname} {record.name}: "
        line += record.getMessage()
        room = _room(record)
        if room is not None:
            line += f" [room {room}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (:data:`JSON_KEYS`, ``exc`` if any)."""

    def __init__(self, role: str | None, rank: int | None) -> None:
        super().__init__()
        self._role = role
        self._rank = rank

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": _time(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "room": _room(record),
            "rank": self._rank,
            "role": self._role,
            "pid": record.process,
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, default=str)


def json_line(
    message: str, *, logger: str, level: int = logging.INFO, role: str | None = "driver"
) -> str:
    """``message`` as one JSON log line of this process (the keys of :data:`JSON_KEYS`):
    for the lines a command prints itself (its progress), so that they read as its logs do.

    **Called by:** the CLI, with ``--log-format json``.
    """
    record = logging.LogRecord(logger, level, "", 0, message, None, None)
    return JsonFormatter(role, None).format(record)


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is when a record comes (so a test's capture, or a
    replaced stream, sees the lines)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's own convention: report, never raise
            self.handleError(record)


def install(
    *,
    role: str | None = None,
    rank: int | None = None,
    label: str | None = None,
    level: int | None = None,
    fmt: str | None = None,
) -> logging.Handler:
    """Send the root logger's records to stderr in the run's format; returns the handler.

    Replaces a handler an earlier call installed, leaves every other handler alone.

    Args:
        role: ``"prefill"``, ``"decode"`` or ``"driver"`` (the JSON ``role``).
        rank: the rank (the JSON ``rank``); ``None`` for the driver.
        label: who the text format names in brackets (default ``ROLE RANK pid PID``).
        level: the root logger's level; ``None`` leaves it as it is.
        fmt: ``"text"`` or ``"json"``; ``None``: as :func:`log_format` says (``text`` when
            the environment names neither; a warning says so).

    **Called by:** each rank process's entry point, and the CLI around one command.
    """
    bad_env: str | None = None
    if fmt is None:
        try:
            fmt = log_format()
        except ValueError as exc:
            fmt, bad_env = "text", str(exc)
    if label is None:
        who = role or "process"
        label = f"{who}{'' if rank is None else rank} pid {os.getpid()}"
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter(role, rank) if fmt == "json" else TextFormatter(label))
    root.addHandler(handler)
    if level is not None:
        root.setLevel(level)
    if bad_env is not None:
        logging.getLogger(__name__).warning("%s; writing text", bad_env)
    return handler


@contextmanager
def installed(*, fmt: str, role: str = "driver") -> Iterator[logging.Handler]:
    """:func:`install` for the length of a block, with :data:`LOG_FORMAT_ENV` set to ``fmt``
    for the processes started in it; both undone after (the root level is left alone).

    **Called by:** the CLI, around one command.
    """
    before = os.environ.get(LOG_FORMAT_ENV)
    os.environ[LOG_FORMAT_ENV] = fmt
    handler = install(role=role, label=role, fmt=fmt)
    try:
        yield handler
    finally:
        logging.getLogger().removeHandler(handler)
        if before is None:
            os.environ.pop(LOG_FORMAT_ENV, None)
        else:
            os.environ[LOG_FORMAT_ENV] = before
