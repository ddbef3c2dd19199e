"""acme-kv: an example third-party staging backend for staging-contracts.

``AcmeKVManager`` mixes ``StagingManagerMixin`` into ``CommonKVManager`` and moves bytes with
the in-process ``LocalEngine``; ``tests/test_acme_contract.py`` runs the contract kit on it.
``over_nixl`` (a factory) and ``AcmeNixlKVManager`` build it over a NIXL agent, whose peers may
live in other processes (the demo, the soak, the harness with ``processes=True``).
"""

from __future__ import annotations

from .backend import AcmeKVManager, AcmeNixlKVManager, over_nixl

__all__ = ["AcmeKVManager", "AcmeNixlKVManager", "over_nixl"]
