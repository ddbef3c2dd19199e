"""Modules whose classes are created at import, for tests that need real module namespaces."""
