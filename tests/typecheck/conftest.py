"""Defaults for the YAML type-checking cases (pytest-mypy-plugins) in this folder.

Each case runs this environment's ``mypy`` with ``mypy.ini`` beside this file as its base
configuration (options given on the command line win). pytest-mypy-plugins shares one mypy
cache between the cases, so after the first case each takes about a second.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Generator
from pathlib import Path

import pytest

_BASE_CONFIG = Path(__file__).with_name("mypy.ini")


def pytest_configure(config: pytest.Config) -> None:
    """Point pytest-mypy-plugins at the base configuration of the cases."""
    option = config.option
    if not (
        getattr(option, "mypy_ini_file", None) or getattr(option, "mypy_pyproject_toml_file", None)
    ):
        option.mypy_ini_file = str(_BASE_CONFIG)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """Put this interpreter's scripts folder first on ``PATH`` while a case runs.

    pytest-mypy-plugins runs the ``mypy`` it finds on ``PATH``; ``.venv/bin/pytest`` may be
    run without the virtual environment active, and another ``mypy`` would lack this package.
    (Its in-process mode replaces ``sys.modules`` wholesale, which breaks later imports.)
    """
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), saved])
    try:
        return (yield)
    finally:
        os.environ["PATH"] = saved
