"""Stubs for the ``mooncake`` package (mooncake-transfer-engine-non-cuda 0.3.13).

Partial: only the transfer engine (``mooncake.engine``) is described; the store and the
buffer pools re-exported by the real ``__init__`` are not used by staging-contracts.
"""
