"""The guide's failure messages are the ones the kit prints (they cannot go stale)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_testing_plugin import kit_dir, run

__all__ = ["kit_dir"]

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "writing-a-backend.md"
SECONDS = re.compile(r"\d+\.\d+s")


def guide_step_output(step: str) -> list[str]:
    """The lines of the first bare code block after the guide's heading ``step``."""
    text = GUIDE.read_text(encoding="utf-8")
    after = text.split(f"### {step}", 1)[1]
    for info, body in re.findall(r"^```([^\n]*)\n(.*?)^```$", after, re.S | re.M):
        if not info.strip():
            return str(body).splitlines()
    raise LookupError(f"no output block after {step!r} in {GUIDE.name}")


def test_step_3_room_failure_is_the_one_the_kit_prints(kit_dir: pytest.Pytester) -> None:
    """Step 3's backend routes no staging message: with the kit's default waits its staged
    transfer ends at the stall bound, and the guide shows that room line (seconds aside)."""
    shown = [line for line in guide_step_output("Step 3: the kit") if line.startswith("room ")]
    result = run(kit_dir, "--staging-backend", "backends:Deaf", "-k", "P2-D1")
    printed = {SECONDS.sub("Ns", line) for line in result.stdout.lines if line.startswith("room ")}
    assert shown, "step 3 shows no room line"
    assert printed, result.stdout.str()
    for line in shown:
        assert SECONDS.sub("Ns", line) in printed, (line, printed)
