"""What happens when the staging mixin is given to a backend without staging support.

Importing this module raises ``ContractError`` at the ``class`` statement, naming the staging
members Mori does not declare: the mistake surfaces at import, not when the first STAGING_REQ
arrives on a listener thread. Run it from anywhere to see the error:
``python examples/mori_with_staging.py`` (it imports only the installed package). Before
anything runs, every type checker reports its witness line (mypy, with our plugin, also its
class line).
"""

from __future__ import annotations

from typing import ClassVar

from staging_contracts import StagingHostCheck, StagingManagerMixin
from staging_contracts.backends.mori import MoriKVManager


class MoriWithStaging(StagingManagerMixin, MoriKVManager):  # type: ignore[staging-missing-member]  # the mistake this example shows
    """Rejected: Mori declares neither ``_staging_handler``, ``_staging_ctx`` nor ``arrival``."""

    __contract: ClassVar[StagingHostCheck[MoriWithStaging]]  # type: ignore[type-var]  # the same mistake
