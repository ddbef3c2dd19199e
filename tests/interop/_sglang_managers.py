"""SGLang's own KV managers, built through their real ``__init__`` on a CPU machine.

The reference's managers are constructed as its schedulers construct them
(``prefill.py`` / ``decode.py`` ``_init_kv_manager``): a ``KVArgs`` filled attribute by
attribute, then ``Manager(kv_args, DisaggregationMode.X, server_args, is_mla_backend)``.
Staging is switched on or off with its own environment variable
(``SGLANG_DISAGG_STAGING_BUFFER``), and its own staging allocations
(``init_staging_buffers``, ``init_staging_allocator``) run for real, on CPU memory.

What needs a server, a GPU or a network is stood in for while a manager is built, and only
that (:func:`sglang_environment`):

* the runtime-context getters ``CommonKVManager.__init__`` and the backends read
  (``get_parallel``, ``get_serving``, ``get_disagg``, ``get_device``, ``get_schedule``,
  ``get_observability``, ``linear_attn_tp_size``, ``get_local_ip_auto``): plain namespaces with
  a single-node TP layout, a loopback address and the CPU as the device;
* bootstrap registration (``register_to_bootstrap``, ``_sync_bootstrap_port_across_nodes``);
* engine set-up: Mooncake's and Ascend's ``init_engine`` get :class:`RecordingEngine`
  (Mooncake's cluster engine needs a metadata service, Ascend's needs NPUs and MemFabric),
  ``register_buffer_to_engine`` registers nothing;
  NIXL's agent is the real one (the ``nixl-cu12`` wheel's ``nixl_cu12`` module, which SGLang
  imports as ``nixl``) with its UCX backend, and its staging memory is registered as CPU
  memory;
* background threads (bootstrap, heartbeat, prefill transfer workers, the decode listener):
  not started while building, so that a test can start the decode listener itself
  (:func:`start_decode_listener`);
* the allocators' device check, which accepts CUDA and XPU only, is widened to the CPU.

Everything else is SGLang's own code: its ``KVArgs``, its contexts, its mixin, its
allocator, its ``DecodeStagingHandler`` and its listener threads.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import torch

from tests.interop._reference import Reference

__all__ = [
    "BACKENDS",
    "MODES",
    "SPECS",
    "ManagerSpec",
    "RecordingEngine",
    "build_manager",
    "kv_args_for",
    "sglang_environment",
    "start_decode_listener",
]

BACKENDS: Final = ("mooncake", "nixl", "ascend")
"""The reference's staging backends (Ascend inherits Mooncake's)."""

MODES: Final = ("prefill", "decode")

STAGING_ENV: Final = "SGLANG_DISAGG_STAGING_BUFFER"
"""The reference's own switch for the staging path."""

POOL_ENV: Final = "SGLANG_DISAGG_STAGING_POOL_SIZE_MB"
"""Its decode ring size; small here."""

LAYERS: Final = 2
PAGE_SIZE: Final = 16
HEADS: Final = 4
HEAD_DIM: Final = 8
POOL_PAGES: Final = 8
ITEM_LEN: Final = PAGE_SIZE * HEADS * HEAD_DIM * 2  # bf16, one page of one layer


@dataclass(frozen=True)
class ManagerSpec:
    """One of the twelve managers: a backend, a side, staging on or off."""

    backend: str
    mode: str
    staging: bool

    @property
    def label(self) -> str:
        """``mooncake-decode-staging`` and the like."""
        return f"{self.backend}-{self.mode}-{'staging' if self.staging else 'plain'}"


SPECS: Final = tuple(
    ManagerSpec(backend, mode, staging)
    for backend, mode, staging in itertools.product(BACKENDS, MODES, (True, False))
)
"""3 backends x prefill/decode x staging on/off."""


class RecordingEngine:
    """Stands in for Mooncake's transfer engine (its cluster engine needs a metadata
    service): records the memory registered with it; moves no bytes."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []

    def batch_register(self, ptrs: list[int], lengths: list[int]) -> int:
        """Record the registrations (Mooncake's API); 0 means success."""
        self.registered.extend(zip(ptrs, lengths, strict=True))
        return 0

    def batch_deregister(self, ptrs: list[int]) -> int:
        """Forget the registrations."""
        self.registered = [r for r in self.registered if r[0] not in ptrs]
        return 0

    def get_session_id(self) -> str:
        """A session id as Mooncake's engine reports one."""
        return "127.0.0.1:12345"


def _namespace(**fields: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**fields)


def _parallel(tp_size: int) -> types.SimpleNamespace:
    return _namespace(
        dist_init_addr=None,
        attn_tp_size=tp_size,
        attn_tp_rank=0,
        attn_cp_size=1,
        attn_cp_rank=0,
        attn_dcp_size=1,
        attn_dcp_rank=0,
        attn_dp_size=1,
        attn_dp_rank=0,
        dp_size=1,
        dp_rank=0,
        pp_size=1,
        enable_kv_cache_sharding=False,
        enable_dsa_cache_layer_split=False,
        enable_cp_tp_group_sharing=False,
        enable_cp_tp_group_sharding=False,
        pp_group=None,
    )


_GETTERS: Final = (
    "get_parallel",
    "get_serving",
    "get_disagg",
    "get_device",
    "get_schedule",
    "get_observability",
    "linear_attn_tp_size",
    "get_local_ip_auto",
)
"""Runtime-context getters the managers read, in the modules that import them."""

_QUIET_METHODS: Final = {
    "register_to_bootstrap": None,
    "_sync_bootstrap_port_across_nodes": "port",
    "register_buffer_to_engine": None,
    "start_prefill_thread": None,
    "start_decode_thread": None,
    "_start_bootstrap_thread": None,
    "_start_decode_listener_thread": None,
    "_start_heartbeat_checker_thread": None,
    "_failed_session_probe_loop": None,
    "transfer_worker": None,
}
"""Methods that need a server or start a background thread: done nothing while building
(``port``: hand the port back unchanged)."""


def _getters(tp_size: int) -> dict[str, Any]:
    device = _namespace(device="cpu", gpu_id=0)
    return {
        "get_parallel": lambda: _parallel(tp_size),
        "get_serving": lambda: _namespace(host="127.0.0.1"),
        "get_disagg": lambda: _namespace(
            disaggregation_bootstrap_port=8998,
            disaggregation_decode_allocation_policy="default",
            disaggregation_ib_device=None,
            disaggregation_decode_host_receive_threshold=1,
        ),
        "get_device": lambda: device,
        "get_schedule": lambda: _namespace(chunked_prefill_size=64, max_prefill_tokens=256),
        "get_observability": lambda: _namespace(enable_trace=False),
        "linear_attn_tp_size": lambda: tp_size,
        "get_local_ip_auto": lambda fallback=None: "127.0.0.1",
    }


def _alias_nixl() -> None:
    """SGLang imports NIXL as ``nixl``; the wheel here installs it as ``nixl_cu12``."""
    if "nixl" in sys.modules:
        return
    package = importlib.import_module("nixl_cu12")
    api = importlib.import_module("nixl_cu12._api")
    sys.modules["nixl"] = package
    sys.modules["nixl._api"] = api


@contextlib.contextmanager
def sglang_environment(reference: Reference, *, staging: bool, tp_size: int = 2) -> Iterator[None]:
    """Stand in for the server around building managers (see the module docstring); every
    change is undone on leaving."""
    _alias_nixl()
    undo: list[tuple[object, str, object]] = []

    def replace(owner: object, name: str, value: object) -> None:
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    modules = [
        reference.common_conn,
        reference.mooncake_conn,
        reference.nixl_conn,
        reference.ascend_conn,
        reference.staging_handler,
        importlib.import_module("sglang.srt.disaggregation.mooncake.utils"),
    ]
    for module in modules:
        for name, value in _getters(tp_size).items():
            if hasattr(module, name):
                replace(module, name, value)
    classes = [
        reference.common_conn.CommonKVManager,
        reference.mooncake_conn.MooncakeKVManager,
        reference.nixl_conn.NixlKVManager,
        reference.ascend_conn.AscendKVManager,
    ]
    for cls in classes:
        for name, keep in _QUIET_METHODS.items():
            if name in vars(cls):
                replace(cls, name, _port_back if keep == "port" else _do_nothing)
    for cls in (reference.mooncake_conn.MooncakeKVManager, reference.ascend_conn.AscendKVManager):
        replace(cls, "init_engine", _recording_engine)
    buffers = reference.staging_buffer
    allowed = buffers._STAGING_SUPPORTED_DEVICE_TYPES
    replace(buffers, "_STAGING_SUPPORTED_DEVICE_TYPES", (*allowed, "cpu"))
    replace(reference.nixl_conn.NixlKVManager, "_register_staging_memory", _nixl_register_dram)
    saved = {key: os.environ.get(key) for key in (STAGING_ENV, POOL_ENV)}
    os.environ[STAGING_ENV] = "1" if staging else "0"
    os.environ[POOL_ENV] = "4"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)


def _do_nothing(self: object, *args: object, **kwargs: object) -> None:
    del self, args, kwargs


def _port_back(self: object, port: int) -> int:
    del self
    return port


def _recording_engine(self: Any) -> None:
    self.engine = RecordingEngine()


def _nixl_register_dram(self: Any, ptr: int, size: int) -> None:
    """Register a staging buffer with the real NIXL agent as CPU memory."""
    descs = self.agent.get_reg_descs([(ptr, size, 0, "")], "DRAM")
    if not self.agent.register_memory(descs):
        raise RuntimeError(f"NIXL could not register {size} bytes at {ptr:#x}")


def kv_args_for(reference: Reference, spec: ManagerSpec, pool: list[torch.Tensor]) -> Any:
    """A ``KVArgs`` filled as the reference's scheduler fills it, over ``pool`` (one tensor
    per layer for K, then V)."""
    del reference  # imported: its modules are in sys.modules
    kv_args = importlib.import_module("sglang.srt.disaggregation.base.conn").KVArgs()
    kv_args.engine_rank = 0
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    kv_args.kv_cache_dtype_str = "bfloat16"
    kv_args.kv_layout = None
    kv_args.kv_data_ptrs = [t.data_ptr() for t in pool]
    kv_args.kv_data_lens = [t.numel() * t.element_size() for t in pool]
    kv_args.kv_item_lens = [ITEM_LEN] * len(pool)
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = list(range(LAYERS)) * 2
    if spec.backend == "nixl":
        kv_args.kv_data_mem_kinds = ["DRAM"] * len(pool)
    kv_args.page_size = PAGE_SIZE
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = [], [], []
    kv_args.state_types = []
    kv_args.state_data_ptrs = []
    kv_args.state_data_lens = []
    kv_args.state_item_lens = []
    kv_args.state_layer_ids = []
    kv_args.state_dim_per_tensor = []
    kv_args.state_slice_outer_counts = []
    kv_args.state_conv_shard_groups = []
    kv_args.is_hybrid_mla_backend = False
    kv_args.swa_kv_cache_layout = None
    kv_args.ib_device = None
    kv_args.gpu_id = 0
    kv_args.kv_head_num = HEADS
    kv_args.total_kv_head_num = HEADS * 2
    return kv_args


def kv_pool() -> list[torch.Tensor]:
    """A KV pool of bf16 tensors, one per layer for K and for V."""
    return [
        torch.zeros(POOL_PAGES * PAGE_SIZE, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        for _ in range(2 * LAYERS)
    ]


def manager_class(reference: Reference, backend: str) -> type:
    """The reference's manager class of ``backend``."""
    module = {
        "mooncake": reference.mooncake_conn,
        "nixl": reference.nixl_conn,
        "ascend": reference.ascend_conn,
    }[backend]
    cls: type = getattr(module, f"{backend.capitalize()}KVManager")
    return cls


ALIVE: Final[list[object]] = []
"""Every manager built, with its pool, kept for the life of the process: a manager's ZMQ
context that is garbage-collected while its sockets are open blocks in ``term()`` forever."""

SERVER_ARGS: Final = types.SimpleNamespace(enable_pd_role_switch=False)
"""What the managers read of the server's arguments (its ``ServerArgs`` needs a model)."""


def build_manager(reference: Reference, spec: ManagerSpec) -> tuple[Any, list[torch.Tensor]]:
    """One manager built through its real ``__init__``, and the pool it refers to (both kept
    alive in :data:`ALIVE`: its process should end with ``os._exit``, as the managers have
    no way to be closed)."""
    mode = importlib.import_module("sglang.srt.disaggregation.utils").DisaggregationMode
    pool = kv_pool()
    kv_args = kv_args_for(reference, spec, pool)
    cls = manager_class(reference, spec.backend)
    with sglang_environment(reference, staging=spec.staging):
        manager = cls(kv_args, getattr(mode, spec.mode.upper()), SERVER_ARGS)
    ALIVE.append((manager, pool))
    return manager, pool


def start_decode_listener(reference: Reference, manager: Any) -> None:
    """Start the reference's own decode listener thread of ``manager`` (not started while
    building): NIXL's ``_start_decode_listener_thread``, Mooncake's ``start_decode_thread``."""
    cls = type(manager)
    common = reference.common_conn.CommonKVManager
    heartbeat = common._start_heartbeat_checker_thread
    # the heartbeat checker polls prefill bootstrap servers over HTTP: not started
    common._start_heartbeat_checker_thread = _unstarted_thread
    try:
        for owner in cls.__mro__:
            for name in ("_start_decode_listener_thread", "start_decode_thread"):
                method = vars(owner).get(name)
                if method is not None:
                    method(manager)
                    return
    finally:
        common._start_heartbeat_checker_thread = heartbeat
    raise AttributeError(f"{cls.__name__} has no decode listener thread")


def _unstarted_thread(self: object) -> threading.Thread:
    del self
    return threading.Thread(target=_do_nothing, args=(None,))
