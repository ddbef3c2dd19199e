"""``NixlKVManager``: staging over a NIXL agent with the UCX backend.

**Arrival.** A prefill writer signals that its write landed in one of two ways, chosen per
manager with ``arrival=``: ``"notification"`` (the default), the bulk write's NIXL
notification carrying the ``CHUNK_READY`` fields; or ``"zmq"``, a ``CHUNK_READY`` message to
decode's control listener once the write completed, as the reference's NIXL path does (its
decode never reads NIXL notifications). ``enable_prefill_staging(manager, ...,
arrival=...)`` may override it for the manager's writer: ``"zmq"`` always, ``"notification"``
only where the manager's agent has notifications (it was not created with ``"zmq"``); the
manager's mode is its writer's default. A decode manager accepts both, whatever its own
``arrival`` says: notifications are polled by the listener's idle loop, which also drives the
agent's progress (NIXL runs without its progress thread here), and ``CHUNK_READY`` messages
arrive on the listener like every other staging message. Requires the ``nixl`` extra.
"""

from __future__ import annotations

import logging
from typing import ClassVar, Final, get_args

from ..engines import load_engine_class
from ..mixin import StagingHostCheck, StagingManagerMixin
from ..protocols import (
    ArrivalMode,
    DecodeStagingContext,
    KVArgs,
    KVBufferTensors,
    PrefillStagingContext,
    StagingHandler,
)
from ._common import CommonKVManager, Role
from ._staging_setup import staging_idle

__all__ = ["DEFAULT_ARRIVAL", "NixlKVManager"]

logger = logging.getLogger(__name__)

DEFAULT_ARRIVAL: Final[ArrivalMode] = "notification"
"""The arrival mode of a manager created without ``arrival=``: the notification travels in the
same NIXL request as the bytes, so it cannot overtake them and costs no message of its own."""

DECODE_POLL_S = 0.002
"""Decode: longest wait of the listener before it polls the agent for arrivals again. An
arrival is seen at most this late; each idle poll costs tens of microseconds of CPU (at 1 ms,
the bench's two decode listeners took about 2% of the host's two cores polling)."""
PREFILL_POLL_S = 0.01
"""Prefill: the agent needs driving only while writing, which the writer does itself."""


class NixlKVManager(StagingManagerMixin, CommonKVManager):
    """A staging backend over a NIXL agent.

    Args:
        kv_args: this rank's KV arguments.
        role: prefill or decode.
        attn_tp_size: attention TP size of this side.
        pp_size: pipeline-parallel size of this side.
        host: address the control listener binds and UCX listens on (loopback by default).
        agent_name: the NIXL agent's name (its session id); unique by default.
        load_ib_modules: let UCX load its InfiniBand modules (only where there is an RDMA
            NIC; on hosts without one they can crash the process at exit).
        arrival: how this manager's prefill writers signal arrival: ``"notification"``
            (default) or ``"zmq"``, ``CHUNK_READY`` over ZMQ after each write, for a decode
            that reads no NIXL notifications (the reference's). ``"zmq"`` creates the agent
            without notifications, so ``enable_prefill_staging(..., arrival="notification")``
            is then refused; ``"notification"`` lets it choose either. It changes nothing on
            decode, which accepts both.
        write_timeout_s: how long a write may stay in flight before it is reported failed
            (and, at close, how long close waits for writes still reading this side's
            memory); the engine's ``write_timeout_s``.

    Raises:
        ImportError: NIXL is not installed (names the extra to install).
        ValueError: ``arrival`` is not one of the two modes, or ``kv_args.device`` is not
            ``"cpu"`` or ``"cuda:N"`` (``engines.nixl.memory_kind``: a bare ``"cuda"`` does
            not say which GPU's memory to register).
    """

    __contract: ClassVar[StagingHostCheck[NixlKVManager]]

    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    kv_buffer_tensors: KVBufferTensors | None = None

    def __init__(
        self,
        kv_args: KVArgs,
        *,
        role: Role,
        attn_tp_size: int,
        pp_size: int = 1,
        host: str = "127.0.0.1",
        agent_name: str | None = None,
        load_ib_modules: bool = False,
        arrival: ArrivalMode = DEFAULT_ARRIVAL,
        write_timeout_s: float = 30.0,
    ) -> None:
        if arrival not in get_args(ArrivalMode):
            raise ValueError(f"arrival={arrival!r} must be one of {get_args(ArrivalMode)}")
        self._arrival: ArrivalMode = arrival
        engine_class = load_engine_class("nixl")
        engine = engine_class(
            agent_name,
            # the engine's memory_kind maps the device (one rule: "cpu" is DRAM, "cuda:N"
            # VRAM of GPU N, a bare "cuda" is refused rather than guessed)
            device=kv_args.device,
            load_ib_modules=load_ib_modules,
            host=host,  # UCX listens on the interface holding host only
            # decode keeps notifications on: it accepts both arrivals and polls the agent
            notifications=role is Role.DECODE or arrival == "notification",
            write_timeout_s=write_timeout_s,
        )
        super().__init__(
            kv_args,
            role=role,
            attn_tp_size=attn_tp_size,
            engine=engine,
            pp_size=pp_size,
            host=host,
            poll_interval_s=DECODE_POLL_S if role is Role.DECODE else PREFILL_POLL_S,
        )
        self._nixl = engine
        logger.debug("NIXL %s manager %s: arrival by %s", role.value, engine.session_id, arrival)

    @property
    def arrival(self) -> ArrivalMode:
        """How this manager's prefill writers signal arrival unless
        ``enable_prefill_staging(..., arrival=...)`` chose otherwise (decode accepts both)."""
        return self._arrival

    def _on_message(self, frames: list[bytes]) -> None:
        if not self._dispatch_staging(frames):
            super()._on_message(frames)

    def _on_idle(self) -> None:
        staging_idle(self)
        if not self._nixl.supports_notifications:
            self._nixl.progress()  # what polling notifications does in the other mode
