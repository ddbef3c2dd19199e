"""Recommendations the kit collects during a run and its plugin prints after it.

Light (pytest only), so that the plugin may import it at load time.
"""

from __future__ import annotations

from typing import Final

import pytest

WITNESS_GUIDE: Final = "docs/writing-a-backend.md, section 7"
"""Where the guide documents the witness (the notes that recommend it name it)."""

WITNESS_NOTES: Final = pytest.StashKey[dict[str, str]]()
"""Backend (qualified name) -> the note recommending its witness, filled by the kit's class
check and printed by the plugin at the end of the run."""
