"""Stubs for the ``nixl_cu12`` package (nixl-cu12 1.5).

The package ships ``py.typed``, but its annotations leave descriptor lists and handles as
``Any`` (the bindings are imported with a blanket ignore) and ``release()`` untyped, and
declare ``add_remote_agent`` as returning ``str`` where it returns ``bytes``. These stubs,
found first through ``mypy_path``, type the parts staging-contracts uses precisely.
"""

from ._api import DEFAULT_COMM_PORT as DEFAULT_COMM_PORT
from ._api import nixl_agent as nixl_agent
from ._api import nixl_agent_config as nixl_agent_config
from ._api import nixl_backend_handle as nixl_backend_handle
from ._api import nixl_prepped_dlist_handle as nixl_prepped_dlist_handle
from ._api import nixl_thread_sync_t as nixl_thread_sync_t
from ._api import nixl_xfer_handle as nixl_xfer_handle

__all__ = [
    "DEFAULT_COMM_PORT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]
