"""The backend registry: in-tree names, entry-point names, refs without imports, and backend
specs (``NAME``, ``MODULE:CLASS``, ``MODULE:CLASS=MODULE:FACTORY``) resolved to factories."""

from __future__ import annotations

import pickle
import re
import sys
from pathlib import Path

import pytest

from staging_contracts._run.workload import TransferConfig
from staging_contracts.backends import (
    BACKENDS,
    ENTRY_POINT_GROUP,
    backend_names,
    backend_ref,
    load_backend,
    resolve_backend,
)
from staging_contracts.backends._common import Role
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.protocols import KVArgs, KVArgsRecord


@pytest.fixture
def registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A distribution on sys.path whose entry points register 'zeta' and 'notaclass'."""
    info = tmp_path / "zeta_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zeta-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n"
        "zeta = zeta_backend:ZetaKVManager\n"
        "notaclass = zeta_backend:make\n"
        "local = zeta_backend:ZetaKVManager\n"
    )
    (tmp_path / "zeta_backend.py").write_text(
        "from staging_contracts.backends.local import LocalKVManager\n\n\n"
        "class ZetaKVManager(LocalKVManager):\n    pass\n\n\n"
        "def make():\n    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_in_tree_names_come_first_and_resolve_without_imports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """backend_ref turns an in-tree name into MODULE:CLASS without importing the module."""
    assert backend_names()[: len(BACKENDS)] == tuple(BACKENDS)
    # Restored afterwards: later tests compare the module's classes by identity.
    monkeypatch.delitem(sys.modules, "staging_contracts.backends.mori", raising=False)
    assert backend_ref("mori") == "staging_contracts.backends.mori:MoriKVManager"
    assert "staging_contracts.backends.mori" not in sys.modules
    assert load_backend("local") is LocalKVManager


def test_entry_points_are_listed_and_loaded(registered: Path) -> None:
    """Registered names follow the in-tree ones; an in-tree name wins over an entry point."""
    names = backend_names()
    assert names == (*BACKENDS, "notaclass", "zeta")
    assert backend_ref("zeta") == "zeta_backend:ZetaKVManager"
    loaded = load_backend("zeta")
    assert loaded.__name__ == "ZetaKVManager"
    assert load_backend("local") is LocalKVManager


def test_entry_point_that_is_not_a_class_is_refused(registered: Path) -> None:
    """An entry point must name a class."""
    with pytest.raises(
        ValueError,
        match=r"^entry point notaclass = zeta_backend:make of group "
        r".staging_contracts.backends.: names a function, not a class",
    ):
        load_backend("notaclass")


def test_unknown_name_lists_the_known_ones() -> None:
    """An unknown name raises ValueError naming every known backend."""
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; known: ascend, local, mooncake"):
        backend_ref("nope")
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; known: ascend, local, mooncake"):
        load_backend("nope")


SPEC_MODULE = '''
from staging_contracts import StagingManagerMixin
from staging_contracts.backends._common import CommonKVManager
from staging_contracts.backends.local import LocalKVManager


class SpecKVManager(LocalKVManager):
    """A backend without a host parameter."""


class HostedKVManager(LocalKVManager):
    """A backend whose constructor takes host."""

    def __init__(self, kv_args, *, role, attn_tp_size, host="127.0.0.1"):
        self.given_host = host
        super().__init__(kv_args, role=role, attn_tp_size=attn_tp_size)


class AbstractBase(StagingManagerMixin, CommonKVManager, abstract=True):
    pass


def make(kv_args, *, role, attn_tp_size, host="127.0.0.1"):
    manager = SpecKVManager(kv_args, role=role, attn_tp_size=attn_tp_size)
    manager.given_host = host
    return manager


def make_without_host(kv_args, *, role, attn_tp_size):
    return SpecKVManager(kv_args, role=role, attn_tp_size=attn_tp_size)


def make_wrong(kv_args, *, role, attn_tp_size):
    return object()


def make_two(kv_args, other, *, role, attn_tp_size):
    return None


NOT_CALLABLE = 3
'''


@pytest.fixture
def spec_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of backend classes and factories on sys.path; its name."""
    (tmp_path / "spec_backends.py").write_text(SPEC_MODULE)
    (tmp_path / "spec_raises.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("spec_backends", "spec_raises"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return "spec_backends"


def _kv_args() -> KVArgs:
    return KVArgsRecord(
        page_size=4,
        kv_item_lens=(64, 64),
        engine_rank=0,
        device="cpu",
        total_kv_head_num=1,
        kv_head_num=1,
        kv_layer_ids=(0,),
    )


def test_a_name_resolves_to_its_class_and_says_whether_it_takes_host() -> None:
    """In-tree names resolve to their class; host goes only where the constructor takes it."""
    local = resolve_backend("local")
    assert local.backend_class is LocalKVManager
    assert local.build is LocalKVManager
    assert (local.takes_host, local.process_local) == (False, True)
    nixl = resolve_backend("nixl")
    assert nixl.backend_class.__name__ == "NixlKVManager"
    assert (nixl.takes_host, nixl.process_local) == (True, False)


def test_a_class_spec_builds_with_the_standard_constructor(spec_module: str) -> None:
    """MODULE:CLASS: the class is the factory; host is dropped for a class without it."""
    factory = resolve_backend(f"{spec_module}:SpecKVManager")
    assert factory.takes_host is False
    manager = factory(_kv_args(), role=Role.DECODE, attn_tp_size=1, host="10.0.0.9")
    try:
        assert type(manager).__name__ == "SpecKVManager"
    finally:
        manager.close()  # type: ignore[attr-defined]
    assert load_backend(f"{spec_module}:SpecKVManager") is factory.backend_class


def test_host_reaches_a_class_or_factory_that_takes_it(spec_module: str) -> None:
    """host= is passed when the constructor or the factory has a parameter named host."""
    for spec in (
        f"{spec_module}:HostedKVManager",
        f"{spec_module}:SpecKVManager={spec_module}:make",
    ):
        factory = resolve_backend(spec)
        assert factory.takes_host is True, spec
        manager = factory(_kv_args(), role=Role.PREFILL, attn_tp_size=1, host="127.0.0.2")
        try:
            assert vars(manager)["given_host"] == "127.0.0.2", spec
        finally:
            manager.close()  # type: ignore[attr-defined]
    without = resolve_backend(f"{spec_module}:SpecKVManager={spec_module}:make_without_host")
    assert without.takes_host is False
    without(_kv_args(), role=Role.DECODE, attn_tp_size=1, host="127.0.0.2").close()  # type: ignore[attr-defined]


def test_a_factory_must_return_an_instance_of_the_class(spec_module: str) -> None:
    """A factory returning something else fails at the call, naming the spec."""
    factory = resolve_backend(f"{spec_module}:SpecKVManager={spec_module}:make_wrong")
    with pytest.raises(TypeError, match=r"the factory returned an object, not a SpecKVManager"):
        factory(_kv_args(), role=Role.DECODE, attn_tp_size=1)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "is not one of NAME, MODULE:CLASS or MODULE:CLASS=MODULE:FACTORY"),
        ("{m}:SpecKVManager=", "is not one of NAME"),
        ("{m}:SpecKVManager=make", "factory 'make' of"),
        ("no_such_module_y:Cls", "cannot import 'no_such_module_y': No module named"),
        ("spec_raises:Cls", "importing 'spec_raises' raised RuntimeError: boom at import"),
        ("{m}:Missing", "module 'spec_backends' has no attribute 'Missing'"),
        ("{m}:make", "spec_backends:make is a function, not a class"),
        ("{m}:AbstractBase", "AbstractBase is declared abstract=True"),
        ("staging_contracts.backends._common:CommonKVManager", "is not a staging backend"),
        ("{m}:SpecKVManager={m}:NOT_CALLABLE", "is an int, not callable"),
        ("{m}:SpecKVManager={m}:make_two", "cannot be called as (kv_args, *, role=..."),
        ("nope", "unknown backend 'nope'"),
    ],
)
def test_a_spec_that_cannot_build_a_backend_is_refused_in_one_line(
    spec_module: str, spec: str, message: str
) -> None:
    """Every refusal is a one-line ValueError that says what is wrong."""
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        resolve_backend(spec.format(m=spec_module))
    assert "\n" not in str(caught.value)


def test_a_class_that_fails_its_contract_at_import_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ContractError raised by the module's class statement becomes one line."""
    (tmp_path / "spec_broken.py").write_text(
        "from staging_contracts import StagingManagerMixin\n"
        "from staging_contracts.backends._common import CommonKVManager\n\n\n"
        "class Broken(StagingManagerMixin, CommonKVManager):\n"
        "    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "spec_broken", raising=False)
    with pytest.raises(ValueError, match="does not satisfy") as caught:
        resolve_backend("spec_broken:Broken")
    text = str(caught.value)
    assert "\n" not in text
    assert "Broken does not satisfy the StagingHost contract: has no declaration of " in text
    assert "staging-contracts check spec_broken:Broken explains" in text


def test_a_spec_string_survives_pickling_and_resolves_again(spec_module: str) -> None:
    """What travels to a spawned rank is the spec string; the factory itself is not sent."""
    spec = f"{spec_module}:SpecKVManager={spec_module}:make"
    config = TransferConfig(backend=spec)
    assert pickle.loads(pickle.dumps(config)).backend == spec
    assert resolve_backend(spec).build.__name__ == "make"


@pytest.fixture
def odd_entry_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A distribution registering a CLASS=FACTORY value and a module that does not exist."""
    info = tmp_path / "odd_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: odd-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n"
        "withfactory = zeta_backend:ZetaKVManager=zeta_backend:make\n"
        "gone = no_such_zeta_module:ZetaKVManager\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "withfactory",
            "entry point withfactory = zeta_backend:ZetaKVManager=zeta_backend:make of group "
            "'staging_contracts.backends': the value must be MODULE:CLASS (a factory cannot be "
            "registered; give it in the spec instead: withfactory=MODULE:FACTORY)",
        ),
        (
            "gone",
            "entry point gone = no_such_zeta_module:ZetaKVManager of group "
            "'staging_contracts.backends': cannot import 'no_such_zeta_module': No module named",
        ),
    ],
)
def test_a_bad_entry_point_is_named_in_one_line(
    odd_entry_points: Path, name: str, message: str
) -> None:
    """load_backend, backend_ref and resolve_backend say which entry point is wrong and why,
    in one ValueError line (no AttributeError from a value that is not MODULE:CLASS, no raw
    ModuleNotFoundError)."""
    calls = [load_backend, resolve_backend]
    if name == "withfactory":
        calls.append(backend_ref)
    for call in calls:
        with pytest.raises(ValueError, match=re.escape(message)) as caught:
            call(name)
        assert "\n" not in str(caught.value)


def test_mori_is_marked_in_the_known_list() -> None:
    """mori, which has no staging and is always refused, is marked among the known names."""
    with pytest.raises(ValueError, match=r"known: .*mooncake, mori \(no staging\), nixl"):
        resolve_backend("nope")


class _LocalBacked(LocalKVManager):
    """An outside class over the in-process engine (LocalKVManager builds a LocalEngine)."""


def test_an_outside_class_over_local_engine_is_process_local() -> None:
    """resolve_backend's verdict agrees with the harness's: a class whose manager's engine is
    a LocalEngine is process-local, with the same reason process_local_reason gives."""
    factory = resolve_backend(_LocalBacked)
    assert factory.process_local
    assert factory.process_local_reason is not None
    assert "LocalEngine moves bytes within one process only" in factory.process_local_reason
    assert resolve_backend(f"{__name__}:_LocalBacked").process_local
