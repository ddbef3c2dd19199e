"""What happens when the staging mixin is given to a backend without staging support.

Importing this module raises ``ContractError`` at the ``class`` statement, naming the staging
members Mori does not declare: the mistake surfaces at import, not when the first STAGING_REQ
arrives on a listener thread. Run it from anywhere to see the error:
``python examples/mori_with_staging.py`` (it imports only the installed package).
"""

from __future__ import annotations

from staging_contracts import StagingManagerMixin
from staging_contracts.backends.mori import MoriKVManager


class MoriWithStaging(StagingManagerMixin, MoriKVManager):  # type: ignore[staging-missing-member]  # the mistake this example shows
    """Rejected: Mori declares neither ``_staging_handler``, ``_staging_ctx`` nor ``arrival``."""
