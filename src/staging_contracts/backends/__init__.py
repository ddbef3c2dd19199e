"""KV-transfer backends: what a backend is built from, and the backends, loaded lazily by name.

A backend author imports from here: :class:`CommonKVManager` (the sockets, the listener and
the engine; its ``secret`` default :data:`FROM_ENV`, the :class:`SecurityError` it raises,
the :data:`Authorizer` it takes) and :class:`Role`; :func:`enable_decode_staging` and
:func:`enable_prefill_staging` (with what they return, :class:`DecodeStagingHandler` and
:class:`StagingWriter`), :func:`staging_idle` and the :class:`StagingBackend` Protocol they
take; the per-request API a
scheduler calls (:class:`KVSender`, :class:`KVReceiver`, :class:`KVPoll`,
:class:`PrefillTransfers`, :class:`DecodeTransfers`, with :class:`DecodeTarget` and
:class:`PrefillTimeouts`); what ``health()`` and ``close(drain_s=...)`` return
(:class:`ManagerHealth`, :class:`DrainResult`). The modules whose names start with ``_`` are
internal.

===========  ===============================================  ==========================
name         class                                            needs
===========  ===============================================  ==========================
``local``    :class:`~.local.LocalKVManager`                  nothing (one process)
``mooncake`` :class:`~.mooncake.MooncakeKVManager`            the ``mooncake`` extra
``nixl``     :class:`~.nixl.NixlKVManager`                    the ``nixl`` extra
``ascend``   :class:`~.ascend.AscendKVManager`                the ``mooncake`` extra
``mori``     :class:`~.mori.MoriKVManager` (no staging)       nothing
===========  ===============================================  ==========================

Importing this package imports torch and pyzmq but no engine SDK; :func:`load_backend`
imports a backend's module on first use and checks that its engine can be imported, raising
an ``ImportError`` that names the backend and the extra to install otherwise.

Backends outside the package register under the entry-point group
``staging_contracts.backends`` (:data:`ENTRY_POINT_GROUP`), one ``NAME = "MODULE:CLASS"`` per
backend, in their ``pyproject.toml``::

    [project.entry-points."staging_contracts.backends"]
    acme = "acme_kv.backend:AcmeKVManager"

:func:`backend_names` lists both kinds, :func:`backend_ref` turns a name into
``MODULE:CLASS`` without importing anything, and :func:`load_backend` loads either kind (an
in-tree name wins over an entry point of the same name).

**Backend specs.** Wherever a backend is chosen by text (``staging-contracts demo --backend``,
``bench transfer --backend``, ``soak --backend``, ``TransferConfig.backend``), the text is a
*spec*: a registry name (``nixl``, ``acme``), ``MODULE:CLASS``, or
``MODULE:CLASS=MODULE:FACTORY`` (the class part may also be a name). :func:`resolve_backend`
turns a spec into a :class:`BackendFactory` that builds one manager per call; a spec is a
plain string, so it travels to spawned rank processes, which resolve it again. Without a
factory the class is called with its standard constructor, ``Class(kv_args, role=...,
attn_tp_size=...)``; with one, the factory is called the same way and must return an
instance of the class. ``host`` (the address a rank binds and advertises) is passed as
``host=...`` only when the class or factory has a parameter named ``host``; one without it
builds managers that keep their own defaults (loopback for the in-tree backends).

May import: ``_decode``, ``_prefill``, ``mixin``, ``engines`` and everything below them;
never ``testing``, ``_cluster``, ``_bench`` or ``cli``.
Imported by: ``testing``, ``_cluster``, ``_bench``, ``cli`` and backends outside the package.
"""

from __future__ import annotations

from .._control.security import FROM_ENV, SecurityError
from .._decode.handler import DecodeStagingHandler
from .._prefill.writer import DecodeTarget, PrefillTimeouts, StagingWriter
from ._common import Authorizer, CommonKVManager, Role
from ._drain import DrainResult
from ._health import ManagerHealth
from ._kv_requests import DecodeTransfers, KVPoll, KVReceiver, KVSender, PrefillTransfers
from ._registry import (
    BACKENDS,
    ENTRY_POINT_GROUP,
    BackendSpec,
    backend_names,
    backend_ref,
)
from ._resolve import (
    SPEC_FORMS,
    BackendFactory,
    load_backend,
    process_local_reason,
    resolve_backend,
)
from ._staging_setup import (
    StagingBackend,
    enable_decode_staging,
    enable_prefill_staging,
    staging_idle,
)

__all__ = [
    "BACKENDS",
    "ENTRY_POINT_GROUP",
    "FROM_ENV",
    "SPEC_FORMS",
    "Authorizer",
    "BackendFactory",
    "BackendSpec",
    "CommonKVManager",
    "DecodeStagingHandler",
    "DecodeTarget",
    "DecodeTransfers",
    "DrainResult",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "ManagerHealth",
    "PrefillTimeouts",
    "PrefillTransfers",
    "Role",
    "SecurityError",
    "StagingBackend",
    "StagingWriter",
    "backend_names",
    "backend_ref",
    "enable_decode_staging",
    "enable_prefill_staging",
    "load_backend",
    "process_local_reason",
    "resolve_backend",
    "staging_idle",
]
