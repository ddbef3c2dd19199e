"""``StagingManagerMixin``: the staging logic shared by every transfer backend.

A backend mixes it in *before* its common base::

    class MooncakeKVManager(StagingManagerMixin, CommonKVManager):
        _staging_handler: StagingHandler | None
        _staging_ctx: DecodeStagingContext | PrefillStagingContext | None
        ...

and must satisfy :class:`~staging_contracts.protocols.StagingHost`. That is enforced by mypy
(the methods below take ``self: StagingHostCore``), at class creation, and once per instance
after construction — never on the hot path.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Final

from .contract import Contract
from .enforcement import ContractMixin
from .protocols import StagingHandler, StagingHost, StagingHostCore

__all__ = ["STAGING_CONTRACT", "StagingManagerMixin", "host_logger"]

STAGING_CONTRACT: Final = Contract(StagingHost, optional=("kv_buffer_tensors",))
"""The :class:`StagingHost` contract, as enforced by :class:`StagingManagerMixin`."""


def host_logger(host: object) -> logging.Logger:
    """The logger of a staging host's concrete class (its module's logger)."""
    logger: logging.Logger = getattr(type(host), "_staging_logger")  # noqa: B009 - `host` is typed `object`
    return logger


class StagingManagerMixin(ContractMixin, contract=STAGING_CONTRACT):
    """Shared staging logic for KV-transfer managers; enforces :class:`StagingHost`.

    Class keywords:
        abstract: ``True`` for an intermediate base that does not itself satisfy the
            contract; the check then applies to its subclasses only.

    Raises:
        ContractError: at class creation, when the class (with its bases) does not declare
            every required member, declares one with an incompatible type, or lists a base
            that shadows a mixin method before the mixin; after construction, when a member
            holds a value of the wrong type.
    """

    _staging_logger: ClassVar[logging.Logger]
    """``logging.getLogger(cls.__module__)`` of the concrete backend, fixed at class creation,
    so that filters keyed on backend logger names see the mixin's records."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        cls._staging_logger = logging.getLogger(cls.__module__)
        super().__init_subclass__(**kwargs)

    def attach_staging_handler(self: StagingHostCore, handler: StagingHandler) -> None:
        """Attach the decode-side staging handler once the scheduler has created it.

        **Side:** decode. **Called by:** the scheduler, after the manager is constructed.
        **When:** before the prefill ranks are told about this decode (messages that arrive
        earlier are dropped and counted). **Blocking:** no.

        Raises:
            ContractError: ``handler`` does not satisfy :class:`StagingHandler`.
        """
        STAGING_CONTRACT.check_member(self, "_staging_handler", handler)
        host: StagingHostCore = self  # assign through the Protocol, not as a mixin attribute
        host._staging_handler = handler
        host_logger(self).debug("staging handler attached: %r", handler)

    def detach_staging_handler(self: StagingHostCore) -> None:
        """Detach the handler; later staging messages are dropped and counted.

        **Side:** decode. **Called by:** the scheduler at shutdown.
        """
        host: StagingHostCore = self
        host._staging_handler = None
