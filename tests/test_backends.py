"""The backend classes: registry, the contract on each class, Mori without staging."""

from __future__ import annotations

import time

import pytest

from staging_contracts import (
    STAGING_CONTRACT,
    ContractError,
    DecodeStagingContext,
    PrefillStagingContext,
    StagingHandler,
    StagingManagerMixin,
)
from staging_contracts._control.transport import PeerSockets
from staging_contracts._control.wire import StagingReq
from staging_contracts.backends import BACKENDS, load_backend
from staging_contracts.backends._common import CommonKVManager, Role
from staging_contracts.backends.local import LocalKVManager
from staging_contracts.backends.mori import MoriKVManager
from staging_contracts.engines import engine_available
from staging_contracts.engines.local import LocalEngine
from tests.hosts import make_kv_args

MOONCAKE = engine_available("mooncake")


def test_registry_names_every_backend() -> None:
    """The registry knows the five backends and loads the ones whose engines import."""
    assert sorted(BACKENDS) == ["ascend", "local", "mooncake", "mori", "nixl"]
    assert load_backend("local") is LocalKVManager
    assert load_backend("mori") is MoriKVManager


def test_unknown_backend_lists_the_known_ones() -> None:
    """An unknown name is a ValueError naming the choices."""
    with pytest.raises(ValueError, match=r"^unknown backend 'ucx'; known: ascend, local, mooncake"):
        load_backend("ucx")


def test_missing_engine_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend whose engine cannot be imported raises ImportError naming the extra."""
    from staging_contracts.backends import _registry

    monkeypatch.setattr(_registry, "engine_available", lambda name: (False, "No module named 'x'"))
    with pytest.raises(ImportError, match=r"pip install 'staging-contracts\[mooncake\]'$"):
        load_backend("ascend")


@pytest.mark.parametrize("name", ["local", "mooncake", "nixl", "ascend"])
def test_staging_backends_conform_at_class_level(name: str) -> None:
    """Every in-tree staging backend class satisfies the StagingHost contract."""
    spec = BACKENDS[name]
    module = __import__(spec.module, fromlist=[spec.class_name])
    cls = getattr(module, spec.class_name)
    assert StagingManagerMixin in cls.__mro__
    assert STAGING_CONTRACT.inspect_class(cls).conforms


def test_mori_given_the_mixin_fails_at_class_creation() -> None:
    """Mixing staging into Mori fails at its class statement, naming the missing members."""
    with pytest.raises(ContractError, match=r"^MoriWithStaging does not satisfy") as info:

        class MoriWithStaging(StagingManagerMixin, MoriKVManager):  # type: ignore[staging-missing-member]  # the mistake under test
            pass

    assert info.value.missing == ("_staging_handler", "_staging_ctx", "arrival")


def test_mori_on_a_base_declaring_the_staging_members_is_rejected_for_its_capability() -> None:
    """As on SGLang's real base, a common base may declare the staging members for every
    backend: Mori given the mixin then still fails, for lacking the staging capability."""

    class DeclaringCommon(CommonKVManager):
        _staging_handler: StagingHandler | None = None
        _staging_ctx: DecodeStagingContext | PrefillStagingContext | None = None

    class DeclaringMori(DeclaringCommon):
        pass

    with pytest.raises(ContractError, match=r"^MoriWithStaging does not satisfy") as info:

        class MoriWithStaging(StagingManagerMixin, DeclaringMori):  # type: ignore[staging-missing-member]  # the mistake under test
            pass

    assert info.value.missing == ("arrival",)
    assert "has no declaration of 'arrival' (expected Literal['notification', 'zmq'])" in str(
        info.value
    )


def test_common_manager_given_the_mixin_fails_at_class_creation() -> None:
    """Mixing staging into the common base fails the same way."""
    with pytest.raises(ContractError, match=r"^StagingCommon does not satisfy") as info:

        class StagingCommon(StagingManagerMixin, CommonKVManager):  # type: ignore[staging-missing-member]  # the mistake under test
            pass

    assert info.value.missing == ("_staging_handler", "_staging_ctx", "arrival")


def test_mori_rejects_staging_messages_and_keeps_serving() -> None:
    """Mori counts a STAGING_REQ as malformed; its listener stays up."""
    manager = MoriKVManager(make_kv_args(), role=Role.DECODE, attn_tp_size=2, engine=LocalEngine())
    peers = PeerSockets()
    try:
        manager.start()
        peers.send(manager.endpoint, StagingReq(1, 0, 1, "d").to_frames())
        deadline = time.monotonic() + 5
        while manager.listener.stats().malformed < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert manager.listener.stats().malformed == 1
        assert manager.listener.alive
    finally:
        peers.close()
        manager.close()


def test_control_handlers_route_by_type_and_refuse_duplicates() -> None:
    """register_control routes a message type to its handler; a second one is refused."""
    manager = MoriKVManager(make_kv_args(), role=Role.DECODE, attn_tp_size=2, engine=LocalEngine())
    seen: list[list[bytes]] = []
    try:
        manager.register_control(b"HELLO", seen.append)
        with pytest.raises(ValueError, match=r"^control message b'HELLO' already has a handler$"):
            manager.register_control(b"HELLO", seen.append)
        manager._on_message([b"HELLO", b"x"])
        assert seen == [[b"HELLO", b"x"]]
    finally:
        manager.close()


@pytest.mark.mooncake
@pytest.mark.skipif(not MOONCAKE[0], reason=MOONCAKE[1])
def test_ascend_is_checked_and_runs_over_mooncake_tcp() -> None:
    """Ascend inherits staging through Mooncake; its instances pass the instance check."""
    from staging_contracts.backends.ascend import AscendKVManager

    with pytest.raises(ContractError, match=r"^BrokenAscend does not satisfy"):

        class BrokenAscend(AscendKVManager):  # type: ignore[staging-member-type]  # the mistake under test
            attn_tp_size: str  # type: ignore[assignment]  # the mistake under test

    manager = AscendKVManager(make_kv_args(), role=Role.DECODE, attn_tp_size=2, protocol="tcp")
    try:
        assert manager.engine.session_id.startswith("127.0.0.1:")
        assert manager._staging_logger.name == "staging_contracts.backends.ascend"
    finally:
        manager.close()
