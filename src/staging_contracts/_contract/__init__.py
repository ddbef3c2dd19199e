"""The contract engine: a ``typing.Protocol`` turned into a contract that a mixin enforces.

Domain-free: it knows nothing about KV caches, staging or transfer engines. It holds
:class:`~.contract.Contract` (the class, instance and explain checks),
:class:`~.enforcement.ContractMixin` (enforcement at class creation and once per instance),
the declaration rule (:mod:`.declarations`), the problems and
:class:`~.problems.ContractError` (:mod:`.problems`), type expressions (:mod:`.typeforms`),
compiled value checks (:mod:`.valuecheck`) and, for the mypy plugin only, the same analysis
over mypy's types (:mod:`.mypy_analysis`, which imports mypy).

May import: nothing of ``staging_contracts`` outside this package (a test holds it to that).
Imported by: ``mixin``, ``mypy_plugin``, ``testing``, ``cli`` and the public surface.
"""
