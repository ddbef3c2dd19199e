"""The adoption patch of ``integrations/sglang`` on SGLang 0.5.23's own code.

SGLang keeps its own staging code and types; the patch puts ``ContractMixin,
contract=Contract(StagingHost, ...)`` on its ``StagingManagerMixin``, with a Protocol written
in SGLang's own classes. Each test below shows one thing that then holds, on the real code:
the classes are created, the twelve managers built through their real ``__init__`` pass,
its decode listener thread answers a STAGING_REQ exactly as unpatched, its prefill readiness
is unchanged, a Mori given the mixin is refused at its class statement (by the runtime, by
``staging-contracts check`` and by mypy with the plugin, which adds no other error in the 17
files), wrong-typed assignments to a built manager are refused while SGLang's own pass, and
the contract kit runs on its managers built its own way.

SGLang runs in processes of its own (:mod:`._adoption`), the patched and the unpatched one
side by side, so that the two can be compared and neither leaks into this test session.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.interop import _adoption
from tests.interop._reference import ReferenceUnavailable, ensure_installed

STAGING_METHODS = (
    "set_kv_buffer_tensors",
    "register_staging_room_bootstrap",
    "_init_staging_allocator",
    "_init_staging_buffers",
)
"""The staging set-up methods SGLang's staging backends define and Mori lacks."""

pytestmark = pytest.mark.timeout(_adoption.PROBE_TIMEOUT_S * 2)


@pytest.fixture(scope="module")
def installed() -> Path:
    """The reference's install folder (installed into the cache on first use)."""
    try:
        return ensure_installed()
    except ReferenceUnavailable as exc:
        reason = str(exc)
    pytest.fail(reason, pytrace=False)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Scratch space for the overlays, the probes' reports and mypy's caches."""
    return tmp_path_factory.mktemp("sglang-adoption")


@pytest.fixture(scope="module")
def patched_overlay(installed: Path, work: Path) -> Path:
    """The reference with the patch applied."""
    return _adoption.patched(installed, work / "patched")


@pytest.fixture(scope="module")
def mori_overlay(installed: Path, work: Path) -> Path:
    """The patched reference whose Mori also lists the mixin (the mistake)."""
    return _adoption.patched(installed, work / "mori-with-mixin", mori_mixin=True)


@pytest.fixture(scope="module")
def patched_report(patched_overlay: Path, work: Path) -> dict[str, Any]:
    """What the patched SGLang did (:mod:`._adoption_probe`)."""
    return _adoption.run_probe(work / "patched.json", patched_overlay)


@pytest.fixture(scope="module")
def plain_report(work: Path) -> dict[str, Any]:
    """What the unpatched SGLang did, the same way."""
    return _adoption.run_probe(work / "plain.json")


# --------------------------------------------------------------------------- the patch


def test_the_patch_is_small_and_applies_to_the_installed_release(installed: Path) -> None:
    """At most 40 changed lines, upstream paths, and every hunk applies exactly."""
    text = _adoption.PATCH.read_text()
    assert _adoption.changed_lines(text) <= 40
    files = _adoption.parse(text)
    assert [f.path for f in files] == [_adoption.STAGING_HANDLER]
    assert "+++ b/python/sglang/srt/disaggregation/common/staging_handler.py" in text
    patched = _adoption.patched_files(installed)[_adoption.STAGING_HANDLER]
    original = (installed / _adoption.STAGING_HANDLER).read_text()
    assert "class StagingManagerMixin(ContractMixin, contract=STAGING_CONTRACT):" in patched
    assert "class StagingManagerMixin:" in original
    # SGLang keeps its own staging code: every function of the original is still there
    for line in original.splitlines():
        if line.startswith(("def ", "class ")) and line != "class StagingManagerMixin:":
            assert line in patched


def test_a_patch_that_does_not_match_the_release_is_refused(installed: Path) -> None:
    """The applier is strict: a hunk whose context differs raises, naming the file."""
    (file_patch,) = _adoption.parse(_adoption.PATCH.read_text())
    original = (installed / _adoption.STAGING_HANDLER).read_text()
    with pytest.raises(ValueError, match=r"staging_handler.py: hunk at line \d+ does not apply"):
        _adoption.apply(original.replace("import struct\n", "import structure\n"), file_patch)


# --------------------------------------------------------------------------- classes, managers


@pytest.mark.parametrize("name", ["MooncakeKVManager", "NixlKVManager", "AscendKVManager"])
def test_its_staging_backends_are_created_with_the_enforcing_mixin(
    patched_report: dict[str, Any], plain_report: dict[str, Any], name: str
) -> None:
    """Mooncake, NIXL and Ascend (through Mooncake) use the enforcing mixin and conform."""
    row = patched_report["classes"][name]
    assert row == {"enforced": True, "conforms": True, "problems": [], "missing": []}
    assert plain_report["classes"][name] == {"enforced": False}


def test_its_mori_without_the_mixin_lacks_exactly_the_staging_methods(
    patched_report: dict[str, Any],
) -> None:
    """Held to the contract, its Mori (which takes no mixin) misses the four set-up methods,
    and nothing else: its base declares every data member."""
    row = patched_report["classes"]["MoriKVManager"]
    assert row["enforced"] is False
    assert row["missing"] == list(STAGING_METHODS)


def test_the_twelve_managers_built_through_their_init_pass(
    patched_report: dict[str, Any], plain_report: dict[str, Any]
) -> None:
    """3 backends x prefill/decode x staging on/off, each built as its scheduler builds it:
    construction (which runs the instance check) succeeds and no member is wrong."""
    managers = patched_report["managers"]
    assert len(managers) == 12
    for label, row in managers.items():
        assert row["built"], f"{label}: {row.get('error')}\n{row.get('trace')}"
        assert row["instance_problems"] == [], label
        assert row["context"] == plain_report["managers"][label]["context"]
    assert {label for label, row in managers.items() if row["context"] == "NoneType"} == {
        label for label in managers if label.endswith("-plain")
    }


# --------------------------------------------------------------------------- behaviour unchanged


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_its_decode_listener_answers_staging_req_exactly_as_unpatched(
    patched_report: dict[str, Any], plain_report: dict[str, Any], backend: str
) -> None:
    """Its own decode listener thread, fed real frames over ZMQ, sends the same STAGING_RSP
    (and WATERMARK) frames patched as unpatched, and survives them all."""
    patched = patched_report["listener"][backend]
    plain = plain_report["listener"][backend]
    assert "failed" not in patched_report["listener"], patched_report["listener"]
    assert patched == plain
    answers = patched["answers"]
    rsp = [a for a in answers if a[0] == "STAGING_RSP"]
    assert [a[2] for a in rsp] == ["0", "0", "1", "2"]  # chunk 0 twice, oversized, last
    assert rsp[2][3] == "-2"  # the chunk that can never fit
    assert patched["alive"] == [True]


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_its_prefill_readiness_is_unchanged(
    patched_report: dict[str, Any], plain_report: dict[str, Any], backend: str
) -> None:
    """_is_watermark_ready over a grid of regions, after the same watermarks, agrees."""
    assert "failed" not in patched_report["readiness"], patched_report["readiness"]
    patched = patched_report["readiness"][backend]
    assert patched == plain_report["readiness"][backend]
    assert any(any(row) for row in patched["grid"])
    assert not all(all(row) for row in patched["grid"])


# --------------------------------------------------------------------------- assignments


@pytest.mark.parametrize("member", ["_staging_handler", "kv_buffer_tensors"])
def test_a_wrong_typed_assignment_to_a_built_manager_is_refused(
    patched_report: dict[str, Any], plain_report: dict[str, Any], member: str
) -> None:
    """Assigned a wrong-typed value after construction, the member is refused and keeps its
    value; unpatched, the same assignment goes through silently."""
    found = patched_report["assignments"][member]
    assert found["error"] == "ContractError"
    assert found["kept"] is True
    assert f"attribute {member!r} is " in found["text"]
    assert "(assignment refused; the member is unchanged)" in found["text"]
    assert plain_report["assignments"][member] == {"error": None, "kept": False}


def test_sglang_s_own_assignments_pass(patched_report: dict[str, Any]) -> None:
    """set_kv_buffer_tensors, attaching its DecodeStagingHandler, detaching it: all pass."""
    found = patched_report["assignments"]
    assert found["own"] == "passed"
    assert found["detach"] is True
    assert found["prefill_pool"] is True


def test_a_mock_handler_passes_only_with_the_handler_s_spec(patched_report: dict[str, Any]) -> None:
    """A test double for the handler must be one: ``MagicMock(spec=DecodeStagingHandler)``
    passes the assignment check, a bare ``MagicMock()`` is refused (integrations README)."""
    assert patched_report["assignments"]["mocks"] == {"bare": "ContractError", "spec": "passed"}


# --------------------------------------------------------------------------- Mori with the mixin


def test_mori_with_the_mixin_is_rejected_at_its_class_statement(mori_overlay: Path) -> None:
    """Given the patched mixin, Mori's class statement raises ContractError naming the four
    set-up methods, and staging-contracts check on it exits 1 saying so."""
    done = _adoption.run_check(
        mori_overlay, "check", "sglang.srt.disaggregation.mori.conn:MoriKVManager"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "the contract rejected a class while importing" in out
    assert "MoriKVManager does not satisfy the StagingHost contract of StagingManagerMixin:" in out
    for method in STAGING_METHODS:
        assert f"has no declaration of {method!r} (expected a method {method}(" in out


def test_check_holds_its_classes_to_their_own_mixin_contract(
    patched_report: dict[str, Any],
) -> None:
    """check exits 0 on its staging backends (against their mixin's contract) and 1 on its
    Mori held to that contract, for the missing capability."""
    checks = patched_report["checks"]
    for backend in ("mooncake", "nixl", "ascend"):
        row = checks[backend]
        assert row["status"] == 0, row
        assert "against the StagingHost contract of StagingManagerMixin" in row["out"]
        verdict = [line for line in row["out"].splitlines() if line.startswith("verdict: ")]
        assert verdict, row["out"]
        assert verdict[0].startswith("verdict: conforms"), row["out"]
    mori = checks["mori-against-the-mixin"]
    assert mori["status"] == 1
    assert "verdict: does not conform: 4 problem(s)" in mori["out"]


def test_mypy_with_the_plugin_reports_mori_and_adds_nothing_else(
    installed: Path, mori_overlay: Path, work: Path
) -> None:
    """Over the 17 files of disaggregation/{common,mooncake,nixl,ascend,mori}: the patched
    code with Mori given the mixin has exactly the unpatched code's errors plus one per
    missing set-up method, all at Mori's class statement."""
    plain = _adoption.mypy_errors(_adoption.copy_tree(installed, work / "plain-tree"), work / "c1")
    tree = _adoption.copy_tree(mori_overlay, work / "mori-tree")
    mori = _adoption.mypy_errors(tree, work / "c2")

    def key(error: _adoption.MypyError) -> tuple[str, str, str]:
        return error.file, error.code, error.text

    added = Counter(map(key, mori)) - Counter(map(key, plain))
    removed = Counter(map(key, plain)) - Counter(map(key, mori))
    assert removed == Counter()
    class_line = 1 + (tree / _adoption.MORI).read_text().splitlines().index(
        "class MoriKVManager(StagingManagerMixin, CommonKVManager):"
    )
    new = [e for e in mori if key(e) in added]
    assert sorted((e.file, e.line, e.code) for e in new) == [
        (_adoption.MORI, class_line, "staging-missing-member")
    ] * len(STAGING_METHODS)
    for method in STAGING_METHODS:
        assert any(f'has no declaration of "{method}"' in e.text for e in new), method


def test_the_kit_runs_on_its_managers_built_its_own_way(patched_overlay: Path, work: Path) -> None:
    """The contract kit with a host factory: the class, explanation and instance checks pass
    on the four Mooncake managers; the checks of our own staging path skip, saying why."""
    done = _adoption.run_kit(
        patched_overlay,
        work / "kit",
        "sglang.srt.disaggregation.mooncake.conn:MooncakeKVManager"
        "=tests.interop._sglang_kit:mooncake_managers",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed, 10 skipped" in done.stdout
    assert "is held to the StagingHost contract of " in done.stdout
    assert "sglang.srt.disaggregation.common.staging_handler.StagingManagerMixin" in done.stdout
