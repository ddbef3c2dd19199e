"""Suite-wide hooks: the exit guard, and fork safety under mutmut.

The transfer engines' native libraries (UCX under NIXL, Mooncake) start threads of their own in
the processes that load them, and several tests load them in this process. Once, a full run
crashed with SIGSEGV in such a native thread (no Python frame) while the interpreter was
tearing down, after every test had passed and the summary was printed: ``make test`` then
failed with status 139 for nothing a test had found. The outermost pytest process therefore
ends with ``os._exit`` and the session's own exit status once its summary is written and every
other plugin has unconfigured; an inner session (pytester), and pytest run inside another
program (mutmut calls ``pytest.main``), are left alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import zmq

_outer: list[pytest.Config] = []
_status: list[int] = []


def _pytest_is_the_program() -> bool:
    """``pytest ...`` or ``python -m pytest ...``, not ``pytest.main`` inside another tool."""
    program = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return program.name in {"pytest", "py.test"} or program.parent.name == "pytest"


def pytest_configure(config: pytest.Config) -> None:
    if not _outer and _pytest_is_the_program():
        _outer.append(config)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _outer and session.config is _outer[0]:
        _status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if _outer and config is _outer[0] and _status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status[-1])


_INHERITED_CONTEXTS: list[object] = []


def _fork_safe_under_mutmut() -> None:
    """Make the suite survive mutmut's workers, which it forks from a process that already
    ran the tests: torch's OpenMP pool does not survive a fork (a parallel op then waits
    forever on the parent's threads) and pyzmq replaces its process-wide context in the
    child, whose destruction of the inherited one warns (an error under
    ``filterwarnings = error``). So: one intra-op thread, and the inherited context is kept."""

    def keep_inherited_context() -> None:
        inherited = getattr(zmq.Context, "_instance", None)
        if inherited is not None:
            _INHERITED_CONTEXTS.append(inherited)

    torch.set_num_threads(1)
    os.register_at_fork(after_in_child=keep_inherited_context)


if "MUTANT_UNDER_TEST" in os.environ:
    _fork_safe_under_mutmut()
