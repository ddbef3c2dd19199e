"""The mypy plugin on real code: the in-repo backends, and hosts the runtime also judges."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import pytest
from mypy import api
from mypy.options import Options
from mypy.plugin import ReportConfigContext

from staging_contracts import STAGING_CONTRACT, ContractError, ProblemKind
from staging_contracts.mypy_plugin import (
    MEMBER_TYPE,
    MISSING_MEMBER,
    SHADOWED_METHOD,
    StagingContractsPlugin,
    plugin,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "mypy.ini"

_PRELUDE = """\
from staging_contracts import (
    ArrivalMode,
    DecodeStagingContext,
    PrefillStagingContext,
    StagingHandler,
    StagingManagerMixin,
)
from staging_contracts.backends._common import CommonKVManager
"""

# One module per host, so that each raises its own ContractError when imported.
_BROKEN_HOSTS = {
    "mori_host": """
class MoriKVManager(StagingManagerMixin, CommonKVManager):
    pass
""",
    "str_tp_host": """
class StrTp(StagingManagerMixin, CommonKVManager):
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"
    attn_tp_size: str  # type: ignore[assignment]
""",
    "reordered_host": """
class LegacyManager(CommonKVManager):
    def attach_staging_handler(self, handler: object) -> None:
        pass

class Reordered(LegacyManager, StagingManagerMixin):
    _staging_handler: StagingHandler | None = None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None
    arrival: ArrivalMode = "zmq"
""",
}

_ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: (?P<text>.*)  \[(?P<code>[a-z-]+)\]$")


@pytest.fixture(scope="module")
def mypy_cache(request: pytest.FixtureRequest) -> Path:
    """A mypy cache private to these tests, kept between runs so that they stay fast."""
    return request.config.cache.mkdir("mypy-plugin-cache")


@pytest.fixture
def host_dir(request: pytest.FixtureRequest) -> Path:
    """Where the tests write host modules: a fixed folder, as mypy's cache is keyed by module.

    (A module found at a new path with unchanged content would replay its cached errors with
    the old path.)
    """
    return request.config.cache.mkdir("mypy-plugin-hosts")


def run_mypy(cache: Path, *paths: Path | str) -> tuple[str, int]:
    """Run mypy with the repository's configuration (plugin on) over ``paths``."""
    stdout, stderr, status = api.run(
        [
            "--config-file",
            str(CONFIG),
            "--cache-dir",
            str(cache),
            "--no-sqlite-cache",
            "--no-error-summary",
            *(str(p) for p in paths),
        ]
    )
    return stdout + stderr, status


def test_in_repo_backends_type_check_with_the_plugin_on(
    mypy_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every backend in src/staging_contracts/backends passes mypy --strict with the plugin."""
    monkeypatch.chdir(ROOT)
    output, status = run_mypy(mypy_cache, "src/staging_contracts/backends")
    assert output == ""
    assert status == 0


def test_broken_hosts_get_the_runtime_problems_at_the_class_line(
    mypy_cache: Path, host_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each static error is a runtime ContractError problem, at the class line, with its code."""
    monkeypatch.chdir(ROOT)
    paths = {}
    for name, body in _BROKEN_HOSTS.items():
        paths[name] = host_dir / f"{name}.py"
        paths[name].write_text(_PRELUDE + body)
    output, status = run_mypy(mypy_cache, *paths.values())
    assert status == 1

    found: dict[str, list[tuple[int, str, str]]] = {name: [] for name in paths}
    for line in output.splitlines():
        match = _ERROR.match(line)
        assert match is not None, line
        name = Path(match["file"]).stem
        found[name].append((int(match["line"]), match["code"], match["text"]))

    codes = {
        ProblemKind.MISSING: MISSING_MEMBER.code,
        ProblemKind.MISMATCHED: MEMBER_TYPE.code,
        ProblemKind.SHADOWED: SHADOWED_METHOD.code,
    }
    for name, path in paths.items():
        error = _runtime_error(name, path)
        class_line = _class_line(path, error.cls.__name__)
        header = f"{error.cls.__name__} does not satisfy the StagingHost contract of "
        header += "StagingManagerMixin: "
        expected = [
            (class_line, codes[p.kind], _unquoted(header + p.describe(instance=False)))
            for p in error.problems
        ]
        actual = [(line, code, _unquoted(text)) for line, code, text in found[name]]
        assert actual == expected


def test_static_messages_name_the_runtime_members_in_contract_order(
    mypy_cache: Path, host_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host declaring nothing is told of every required member, in the contract's order."""
    monkeypatch.chdir(ROOT)
    path = host_dir / "bare_host.py"
    path.write_text(
        "from staging_contracts import StagingManagerMixin\n\n"
        "class Bare(StagingManagerMixin):\n    pass\n"
    )
    output, status = run_mypy(mypy_cache, path)
    assert status == 1
    named = re.findall(r'has no declaration of "(\w+)"', output)
    assert tuple(named) == STAGING_CONTRACT.required
    located = {
        (Path(m["file"]).name, m["line"]) for m in map(_ERROR.match, output.splitlines()) if m
    }
    assert located == {("bare_host.py", "3")}


def test_plugin_entry_point_and_config_data() -> None:
    """mypy's entry point returns the plugin; its cache key is JSON with version and source."""
    assert plugin("2.4.1") is StagingContractsPlugin
    instance = StagingContractsPlugin(Options())
    data = instance.report_config_data(ReportConfigContext("m", "m.py", is_check=True))
    assert json.loads(json.dumps(data)) == data
    assert data["plugin"] == "staging_contracts.mypy_plugin"
    assert set(data) == {"plugin", "version", "source"}  # contracts come from the code itself
    assert {MISSING_MEMBER.code, MEMBER_TYPE.code, SHADOWED_METHOD.code} == {
        "staging-missing-member",
        "staging-member-type",
        "staging-shadowed-method",
    }


def _runtime_error(name: str, path: Path) -> ContractError:
    spec = importlib.util.spec_from_file_location(f"_static_twin_{name}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        with pytest.raises(ContractError) as info:
            spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return info.value


def _class_line(path: Path, name: str) -> int:
    lines = path.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.startswith(f"class {name}("))


def _unquoted(text: str) -> str:
    """Drop quotes: the runtime quotes names with ``'``, mypy names and types with ``"``."""
    return text.replace("'", "").replace('"', "")


_CACHE_PROTOCOL = """\
from typing import Protocol

from staging_contracts import Contract


class XmodCacheHost(Protocol):
    cache_dir: {type}


XMOD_CONTRACT = Contract(XmodCacheHost)
"""

_CACHE_MIXINS = """\
from staging_contracts import Contract, ContractMixin
from xmod_protocol import XMOD_CONTRACT, XmodCacheHost


class BoundElsewhere(ContractMixin, contract=XMOD_CONTRACT):
    pass


class CalledHere(ContractMixin, contract=Contract(XmodCacheHost)):
    pass
"""

_CACHE_HOSTS = """\
from xmod_mixins import BoundElsewhere, CalledHere


class StrHostOfBound(BoundElsewhere):
    cache_dir: str = "/tmp"


class StrHostOfCalled(CalledHere):
    cache_dir: str = "/tmp"
"""


def _write_cross_module(host_dir: Path, cache_dir_type: str) -> list[Path]:
    files = {
        "xmod_protocol": _CACHE_PROTOCOL.format(type=cache_dir_type),
        "xmod_mixins": _CACHE_MIXINS,
        "xmod_hosts": _CACHE_HOSTS,
    }
    paths = []
    for name, text in files.items():
        path = host_dir / f"{name}.py"
        _write_newer(path, text)
        paths.append(path)
    return paths


def _write_newer(path: Path, text: str) -> None:
    """Write ``path`` with a modification time a whole second past its last one.

    mypy takes a file whose size and whole-second mtime match its cache as unchanged: "int"
    and "str" are of one length, so an edit within the second of mypy's last read would
    replay a stale verdict (it did, on a warm cache). Written every time, so that a cache
    left stale by an earlier run is mended too.
    """
    last = path.stat().st_mtime if path.exists() else 0.0
    path.write_text(text)
    stamp = max(time.time(), math.floor(last) + 1.0)
    os.utime(path, (stamp, stamp))


def test_contracts_bound_and_protocols_defined_in_other_modules_are_read_and_stay_fresh(
    mypy_cache: Path, host_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mixin naming a contract bound in another module is checked (mypy has freed that
    module's tree by then, or read it from the cache); editing the Protocol there re-checks
    the hosts of both mixins with the warm cache, with no stale verdict."""
    monkeypatch.chdir(ROOT)
    paths = _write_cross_module(host_dir, "str")
    output, status = run_mypy(mypy_cache, *paths)
    assert (output, status) == ("", 0)
    output, status = run_mypy(mypy_cache, *paths)  # from the cache: still read
    assert (output, status) == ("", 0)

    paths = _write_cross_module(host_dir, "int")
    output, status = run_mypy(mypy_cache, *paths)
    assert status == 1
    failing = sorted(re.findall(r"error: (\w+) does not satisfy the XmodCacheHost", output))
    assert failing == ["StrHostOfBound", "StrHostOfCalled"]
    assert "cannot be read statically" not in output
    _write_cross_module(host_dir, "str")  # back, for the next run's cache
