"""Stubs for ``nixl_cu12._api`` (nixl-cu12 1.5): the Python agent API, partial.

Typed from the module's source and its bindings' signatures. Descriptor inputs are the
forms the API documents; strings that name a memory kind or an operation are ``Literal``.
"""

from collections.abc import Sequence
from enum import Enum
from typing import Literal, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from . import _bindings as nixlBind

DEFAULT_COMM_PORT: int

_MemType: TypeAlias = Literal["DRAM", "VRAM", "FILE", "BLOCK", "OBJ", "cpu", "cuda"]
_XferOp: TypeAlias = Literal["WRITE", "READ"]
_XferState: TypeAlias = Literal["DONE", "PROC", "ERR"]
_XferDescs: TypeAlias = (
    Sequence[tuple[int, int, int]]
    | npt.NDArray[np.uint64]
    | torch.Tensor
    | Sequence[torch.Tensor]
    | nixlBind.nixlXferDList
)
_RegDescs: TypeAlias = (
    Sequence[tuple[int, int, int, str]]
    | npt.NDArray[np.uint64]
    | torch.Tensor
    | Sequence[torch.Tensor]
    | nixlBind.nixlRegDList
)

nixl_backend_handle = int

class nixl_prepped_dlist_handle:
    def __init__(self, agent: nixlBind.nixlAgent, value: int) -> None: ...
    def release(self) -> None: ...

class nixl_xfer_handle:
    def __init__(self, agent: nixlBind.nixlAgent, value: int) -> None: ...
    def release(self) -> None:
        """Free the request; cancels an active transfer, raising if it cannot."""

class nixl_thread_sync_t(Enum):
    NIXL_THREAD_SYNC_NONE = nixlBind.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = nixlBind.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = nixlBind.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = nixlBind.NIXL_THREAD_SYNC_DEFAULT

class nixl_agent_config:
    backends: list[str]
    enable_pthread: bool
    enable_listen: bool
    port: int
    capture_telemetry: bool
    num_threads: int
    sync_mode: nixl_thread_sync_t | None
    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = ...,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list[str] = ...,
        sync_mode: nixl_thread_sync_t | None = None,
    ) -> None: ...

class nixl_agent:
    name: str
    agent: nixlBind.nixlAgent
    backends: dict[str, int]
    def __init__(
        self,
        agent_name: str,
        nixl_conf: nixl_agent_config | None = None,
        instantiate_all: bool = False,
    ) -> None: ...
    def get_plugin_list(self) -> list[str]: ...
    def get_plugin_mem_types(self, backend: str) -> list[str]: ...
    def get_plugin_params(self, backend: str) -> dict[str, str]: ...
    def get_backend_mem_types(self, backend: str) -> list[str]: ...
    def get_backend_params(self, backend: str) -> dict[str, str]: ...
    def create_backend(self, backend: str, initParams: dict[str, str] = ...) -> None: ...
    def register_memory(
        self, reg_list: _RegDescs, mem_type: _MemType | None = None, backends: list[str] = ...
    ) -> nixlBind.nixlRegDList: ...
    def deregister_memory(
        self, dereg_list: nixlBind.nixlRegDList, backends: list[str] = ...
    ) -> None: ...
    def make_connection(self, remote_agent: str, backends: list[str] = ...) -> None: ...
    def prep_xfer_dlist(
        self,
        agent_name: str,
        xfer_list: _XferDescs,
        mem_type: _MemType | None = None,
        backends: list[str] = ...,
    ) -> nixl_prepped_dlist_handle: ...
    def make_prepped_xfer(
        self,
        operation: _XferOp,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices: list[int] | npt.NDArray[np.int32],
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices: list[int] | npt.NDArray[np.int32],
        notif_msg: bytes = b"",
        backends: list[str] = ...,
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle: ...
    def initialize_xfer(
        self,
        operation: _XferOp,
        local_descs: nixlBind.nixlXferDList,
        remote_descs: nixlBind.nixlXferDList,
        remote_agent: str,
        notif_msg: bytes = b"",
        backends: list[str] = ...,
    ) -> nixl_xfer_handle: ...
    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> _XferState: ...
    def check_xfer_state(self, handle: nixl_xfer_handle) -> _XferState: ...
    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlBind.nixlXferTelemetry: ...
    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str: ...
    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None: ...
    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None: ...
    def get_new_notifs(self, backends: list[str] = ...) -> dict[str, list[bytes]]: ...
    def update_notifs(self, backends: list[str] = ...) -> dict[str, list[bytes]]: ...
    def check_remote_xfer_done(
        self,
        remote_agent_name: str,
        lookup_tag: bytes,
        backends: list[str] = ...,
        tag_is_prefix: bool = True,
    ) -> bool: ...
    def send_notif(
        self, remote_agent_name: str, notif_msg: bytes, backend: str | None = None
    ) -> None: ...
    def get_agent_metadata(self) -> bytes: ...
    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Load a peer's metadata; returns its agent name (``bytes``, though the API says str)."""
    def remove_remote_agent(self, agent: str) -> None: ...
    def get_xfer_descs(
        self, descs: _XferDescs, mem_type: _MemType | None = None
    ) -> nixlBind.nixlXferDList | None:
        """``None`` (after logging) when the input is malformed."""
    def get_reg_descs(
        self, descs: _RegDescs, mem_type: _MemType | None = None
    ) -> nixlBind.nixlRegDList | None:
        """``None`` (after logging) when the input is malformed."""
