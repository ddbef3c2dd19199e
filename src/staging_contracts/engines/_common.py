"""Pieces the engines share: registered-range bookkeeping and an in-flight gate.

:class:`RegionTable` is not thread-safe by itself (each engine guards it with its own lock);
:class:`InflightGate` is.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..protocols import Transfer, TransferError

__all__ = [
    "InflightGate",
    "RegionTable",
    "check_range_args",
    "format_problems",
    "transfer_problems",
]

logger = logging.getLogger(__name__)


def check_range_args(ptr: int, length: int) -> None:
    """Reject an address or length that cannot describe memory.

    Raises:
        ValueError: ``ptr`` is not positive or ``length`` is below 1.
    """
    if ptr <= 0:
        raise ValueError(f"address {ptr:#x} must be positive")
    if length < 1:
        raise ValueError(f"length {length} must be >= 1")


class RegionTable:
    """Registered ranges ``[ptr, ptr + length)``, keyed by their start address."""

    __slots__ = ("_regions",)

    def __init__(self) -> None:
        self._regions: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._regions)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(list(self._regions.items()))

    def add(self, ptr: int, length: int) -> bool:
        """Record a range; returns ``False`` if exactly this range was already recorded.

        Raises:
            ValueError: bad address or length, or ``ptr`` is recorded with another length.
        """
        check_range_args(ptr, length)
        known = self._regions.get(ptr)
        if known == length:
            return False
        if known is not None:
            raise ValueError(
                f"address {ptr:#x} is already registered with length {known}, not {length};"
                " deregister it first"
            )
        self._regions[ptr] = length
        return True

    def remove(self, ptr: int) -> int | None:
        """Forget the range starting at ``ptr``; returns its length, ``None`` if unknown."""
        return self._regions.pop(ptr, None)

    def clear(self) -> list[tuple[int, int]]:
        """Forget every range; returns them."""
        regions = list(self._regions.items())
        self._regions.clear()
        return regions

    def covers(self, ptr: int, length: int) -> bool:
        """Does one registered range contain all of ``[ptr, ptr + length)``?"""
        end = ptr + length
        return any(start <= ptr and end <= start + size for start, size in self._regions.items())

    def describe_miss(self, ptr: int, length: int) -> str:
        """Why ``[ptr, ptr + length)`` is not covered, for an error message."""
        if length < 1:
            return f"length {length} must be >= 1"
        end = ptr + length
        for start, size in self._regions.items():
            if start <= ptr < start + size:
                return (
                    f"[{ptr:#x}, {end:#x}) runs {end - start - size} bytes past the end of"
                    f" the registered range [{start:#x}, {start + size:#x})"
                )
        return f"[{ptr:#x}, {end:#x}) is not in any registered range ({len(self._regions)} known)"


def transfer_problems(
    transfers: Sequence[Transfer], *, local: RegionTable | None, remote: RegionTable | None
) -> list[str]:
    """Every range of ``transfers`` that the given tables do not cover, one line each.

    A table passed as ``None`` is not checked (the engine checks that side itself).
    """
    problems: list[str] = []
    for index, transfer in enumerate(transfers):
        if transfer.length < 1:
            problems.append(f"transfer {index}: length {transfer.length} must be >= 1")
            continue
        for side, table, ptr in (
            ("local", local, transfer.local),
            ("remote", remote, transfer.remote),
        ):
            if table is not None and not table.covers(ptr, transfer.length):
                problems.append(
                    f"transfer {index}: {side} {table.describe_miss(ptr, transfer.length)}"
                )
    return problems


def format_problems(header: str, problems: Sequence[str]) -> str:
    """A header line, then one indented line per problem."""
    return header + "".join(f"\n  - {problem}" for problem in problems)


class InflightGate:
    """Counts operations that use a native engine, so ``close`` never frees it under them.

    **Thread-safety:** every method may be called from any thread.

    Args:
        what: How errors name the engine, e.g. ``"mooncake engine '10.0.0.1:15000'"``.
    """

    __slots__ = ("_closed", "_cond", "_count", "_what")

    def __init__(self, what: str) -> None:
        self._cond = threading.Condition()
        self._count = 0
        self._closed = False
        self._what = what

    @property
    def closed(self) -> bool:
        """Has ``close`` been called?"""
        return self._closed

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Hold the engine open for the ``with`` block.

        Raises:
            TransferError: the engine is closed (or closing).
        """
        with self._cond:
            if self._closed:
                raise TransferError(f"{self._what} is closed")
            self._count += 1
        try:
            yield
        finally:
            with self._cond:
                self._count -= 1
                if self._count == 0:
                    self._cond.notify_all()

    def close(self, timeout: float) -> bool | None:
        """Refuse new operations and wait for the running ones.

        **Blocking:** up to ``timeout`` seconds.

        Returns:
            ``None`` if already closed, ``True`` once no operation runs, ``False`` if some
            still ran after ``timeout`` seconds (the caller must then leak the native engine
            rather than free it under them).
        """
        with self._cond:
            if self._closed:
                return None
            self._closed = True
            return self._cond.wait_for(lambda: self._count == 0, timeout)
