"""The serving-stack objects the reference's staging functions take, as small test doubles.

The reference's functions are called for real; what they are handed here stands in for the
parts of its server that a CPU test does not run (its KV receivers, bootstrap sockets, transfer
infos, managers). Each double has exactly the attributes those functions read.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

__all__ = [
    "ArrivalLog",
    "ChunkReadySender",
    "PrefillInfo",
    "Receiver",
    "RecordingSocket",
    "TransferInfo",
    "ZmqSocket",
]


class RecordingSocket:
    """A ZMQ socket that records the multipart messages sent on it."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes]) -> None:
        """Record one message (copied)."""
        self.sent.append([bytes(frame) for frame in frames])

    def take(self) -> list[list[bytes]]:
        """The messages sent since the last call."""
        out, self.sent = self.sent, []
        return out


class ZmqSocket:
    """A real PUSH socket to ``endpoint`` with the one method the reference calls on it."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self._socket: zmq.Socket[bytes] = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(endpoint)
        self.endpoint = endpoint

    def send_multipart(self, frames: list[bytes]) -> None:
        """Send one message."""
        self._socket.send_multipart(frames)

    def close(self) -> None:
        """Close the socket (pending messages get a second to leave)."""
        self._socket.close()


@dataclass
class PrefillInfo:
    """What the reference's decode knows of a request's prefill side."""

    attn_tp_size: int
    pp_size: int = 1


@dataclass
class Receiver:
    """A decode-side KV receiver of one room, as the reference's staging code reads it.

    ``bootstrap_infos`` name the room's prefill ranks; each answer to one of them goes to
    ``sockets[info["rank"]]``.
    """

    bootstrap_infos: list[dict[str, int]]
    sockets: dict[int, Any]
    prefill_info: PrefillInfo
    chunk_staging_infos: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    locks: dict[int, threading.Lock] = field(default_factory=dict)

    def _connect_to_bootstrap_server(self, info: dict[str, int]) -> tuple[Any, threading.Lock]:
        rank = info["rank"]
        return self.sockets[rank], self.locks.setdefault(rank, threading.Lock())


@dataclass
class TransferInfo:
    """A prefill-side transfer info of one (room, decode session)."""

    endpoint: str = "127.0.0.1"
    dst_port: int = 0
    dst_kv_indices: list[int] = field(default_factory=list)
    is_dummy: bool = False
    staging: Any = None
    agent_name: str = ""
    mooncake_session_id: str = ""
    room: int = 0


class ChunkReadySender:
    """``self`` for the reference's ``CommonKVManager.send_chunk_ready``: its unique rank,
    and a send that hands each message to ``deliver(endpoint, frames)``."""

    def __init__(self, unique_rank: int, deliver: Callable[[str, list[bytes]], None]) -> None:
        self._unique_rank = unique_rank
        self._deliver = deliver

    def _prefill_unique_rank(self) -> int:
        return self._unique_rank

    def _send_multipart_locked(
        self, endpoint: str, parts: list[bytes], is_ipv6: bool = False
    ) -> None:
        del is_ipv6
        self._deliver(endpoint, [bytes(part) for part in parts])


class ArrivalLog:
    """``self`` for the reference's ``CommonKVManager.handle_chunk_ready``: the rooms it
    knows, and a staging handler that records each arrival."""

    def __init__(self, rooms: set[int]) -> None:
        self.request_status = dict.fromkeys(rooms, 0)
        self.arrivals: list[tuple[int, int, int, int, str]] = []
        self._staging_handler = types.SimpleNamespace(handle_chunk_arrived=self._arrived)

    def _arrived(
        self, room: int, chunk_idx: int, page_start: int, num_pages: int, writer_id: str
    ) -> bool:
        self.arrivals.append((room, chunk_idx, page_start, num_pages, writer_id))
        return False
