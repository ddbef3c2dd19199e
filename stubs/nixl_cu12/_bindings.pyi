"""Stubs for ``nixl_cu12._bindings`` (pybind11 module of nixl-cu12 1.5), partial.

Descriptor lists, memory kinds, status codes and the exceptions the agent raises (each a
direct subclass of ``Exception``).
"""

from collections.abc import Sequence
from typing import ClassVar
import numpy as np
import numpy.typing as npt

DEFAULT_COMM_PORT: int
HAVE_UCX_GPU_DEVICE_API: bool
NIXL_INIT_AGENT: str

class nixl_mem_t:
    """A pybind11 enum (not an ``enum.Enum``)."""

    DRAM_SEG: ClassVar[nixl_mem_t]
    VRAM_SEG: ClassVar[nixl_mem_t]
    BLK_SEG: ClassVar[nixl_mem_t]
    OBJ_SEG: ClassVar[nixl_mem_t]
    FILE_SEG: ClassVar[nixl_mem_t]
    def __init__(self, value: int) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

DRAM_SEG: nixl_mem_t
VRAM_SEG: nixl_mem_t
BLK_SEG: nixl_mem_t
OBJ_SEG: nixl_mem_t
FILE_SEG: nixl_mem_t

class nixl_status_t:
    """A pybind11 enum (not an ``enum.Enum``)."""

    NIXL_IN_PROG: ClassVar[nixl_status_t]
    NIXL_SUCCESS: ClassVar[nixl_status_t]
    NIXL_ERR_NOT_POSTED: ClassVar[nixl_status_t]
    NIXL_ERR_INVALID_PARAM: ClassVar[nixl_status_t]
    NIXL_ERR_BACKEND: ClassVar[nixl_status_t]
    NIXL_ERR_NOT_FOUND: ClassVar[nixl_status_t]
    NIXL_ERR_MISMATCH: ClassVar[nixl_status_t]
    NIXL_ERR_NOT_ALLOWED: ClassVar[nixl_status_t]
    NIXL_ERR_REPOST_ACTIVE: ClassVar[nixl_status_t]
    NIXL_ERR_UNKNOWN: ClassVar[nixl_status_t]
    NIXL_ERR_NOT_SUPPORTED: ClassVar[nixl_status_t]
    def __init__(self, value: int) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

NIXL_SUCCESS: nixl_status_t
NIXL_IN_PROG: nixl_status_t

class nixl_thread_sync_t:
    """A pybind11 enum (not an ``enum.Enum``)."""

    NIXL_THREAD_SYNC_NONE: ClassVar[nixl_thread_sync_t]
    NIXL_THREAD_SYNC_STRICT: ClassVar[nixl_thread_sync_t]
    NIXL_THREAD_SYNC_RW: ClassVar[nixl_thread_sync_t]
    NIXL_THREAD_SYNC_DEFAULT: ClassVar[nixl_thread_sync_t]
    def __init__(self, value: int) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

NIXL_THREAD_SYNC_NONE: nixl_thread_sync_t
NIXL_THREAD_SYNC_STRICT: nixl_thread_sync_t
NIXL_THREAD_SYNC_RW: nixl_thread_sync_t
NIXL_THREAD_SYNC_DEFAULT: nixl_thread_sync_t

class nixlXferDList:
    def __init__(
        self,
        type: nixl_mem_t,
        descs: Sequence[tuple[int, int, int]] | npt.NDArray[np.uint64] = ...,
    ) -> None: ...

class nixlRegDList:
    def __init__(
        self,
        type: nixl_mem_t,
        descs: Sequence[tuple[int, int, int, str]] | npt.NDArray[np.uint64] = ...,
    ) -> None: ...

class nixlRemoteDList:
    def __init__(
        self, type: nixl_mem_t, descs: Sequence[tuple[int, int, int, str]] = ...
    ) -> None: ...

class nixlXferTelemetry:
    @property
    def startTime(self) -> int: ...
    @property
    def postDuration(self) -> int: ...
    @property
    def xferDuration(self) -> int: ...
    @property
    def totalBytes(self) -> int: ...
    @property
    def descCount(self) -> int: ...

class nixlAgent:
    """The raw agent (``nixl_agent.agent``); partial: the Python API is the typed surface."""

    def getAvailPlugins(self) -> list[str]: ...
    def getLocalMD(self) -> bytes: ...
    def loadRemoteMD(self, metadata: bytes, /) -> bytes: ...
    def invalidateRemoteMD(self, agent: str, /) -> nixl_status_t: ...
    def getNotifs(
        self, notif_map: dict[str, list[bytes]], backends: Sequence[int] = ...
    ) -> dict[str, list[bytes]]: ...
    def releaseXferReq(self, handle: int, /) -> nixl_status_t: ...

class nixlBackendError(Exception): ...
class nixlCancelledError(Exception): ...
class nixlInvalidParamError(Exception): ...
class nixlMismatchError(Exception): ...
class nixlNoTelemetryError(Exception): ...
class nixlNotAllowedError(Exception): ...
class nixlNotFoundError(Exception): ...
class nixlNotPostedError(Exception): ...
class nixlNotSupportedError(Exception): ...
class nixlRemoteDisconnectError(Exception): ...
class nixlRepostActiveError(Exception): ...
class nixlUnknownError(Exception): ...
