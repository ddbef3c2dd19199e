"""acme-kv: an example third-party staging backend for staging-contracts.

``AcmeKVManager`` mixes ``StagingManagerMixin`` into ``CommonKVManager`` and moves bytes with
the in-process ``LocalEngine``; ``tests/test_acme_contract.py`` runs the contract kit on it.
"""

from __future__ import annotations

from .backend import AcmeKVManager

__all__ = ["AcmeKVManager"]
