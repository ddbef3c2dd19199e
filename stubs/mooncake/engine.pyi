"""Stubs for ``mooncake.engine`` (pybind11 module, mooncake-transfer-engine 0.3.13).

Written from the module's own signatures (``help(mooncake.engine.TransferEngine)``).
Status-returning methods return 0 on success and a negative value on failure.
"""

from typing import ClassVar, overload

SUPPORT_CUDA: bool
SUPPORT_HIP: bool
SUPPORT_MUSA: bool
SUPPORT_EFA: bool
SUPPORT_INTRA_NVLINK: bool
SUPPORT_MNNVL: bool

class TransferOpcode:
    """A pybind11 enum (not an ``enum.Enum``)."""

    Read: ClassVar[TransferOpcode]
    Write: ClassVar[TransferOpcode]
    def __init__(self, value: int) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class TransferNotify:
    name: str
    msg: str
    @overload
    def __init__(self) -> None: ...
    @overload
    def __init__(self, name: str, msg: str) -> None: ...

class TransferEngine:
    def __init__(self) -> None: ...
    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, /
    ) -> int: ...
    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str,
        /,
    ) -> int: ...
    def get_rpc_port(self) -> int: ...
    def get_local_topology(self, device_name: str | None = None) -> str: ...
    def get_engine_ptr(self) -> int: ...
    def get_first_buffer_address(self, segment_name: str, /) -> int: ...
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int: ...
    def unregister_memory(self, buffer_addr: int, /) -> int: ...
    def batch_register_memory(
        self, buffer_addresses: list[int], capacities: list[int], location: str = "*"
    ) -> int: ...
    def batch_unregister_memory(self, buffer_addresses: list[int], /) -> int: ...
    def allocate_managed_buffer(self, length: int, /) -> int: ...
    def free_managed_buffer(self, buffer_addr: int, length: int, /) -> int: ...
    def transfer_sync_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int: ...
    def transfer_sync_read(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int: ...
    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: TransferOpcode,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_sync(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        opcode: TransferOpcode,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        """Returns a batch id (negative on failure) for ``get_batch_transfer_status``."""
    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int: ...
    def get_batch_transfer_status(self, batch_ids: list[int], /) -> int: ...
    def transfer_submit_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int: ...
    def transfer_check_status(self, batch_id: int, /) -> int: ...
    def get_notifies(self) -> list[TransferNotify]: ...
    def send_probe(self, peer_server_name: str) -> int: ...
    def write_bytes_to_buffer(self, buffer_addr: int, data: str, length: int, /) -> int: ...
    def read_bytes_from_buffer(self, buffer_addr: int, length: int, /) -> bytes: ...
