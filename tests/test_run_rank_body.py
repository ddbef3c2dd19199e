"""The run layer's rank body: what every rank (demo, soak, harness) is built from.

A body whose staging set-up raises closes the backend it built (nobody else holds it);
a body built without a host calls the backend with the standard constructor only."""

from __future__ import annotations

from typing import Any

import pytest

from staging_contracts._run import _rank_body as rank_body
from staging_contracts._run._rank_body import BodyOptions, DecodeBody, PrefillBody
from staging_contracts._run.workload import TransferConfig
from staging_contracts.backends._common import Role
from staging_contracts.backends.local import LocalKVManager

CONFIG = TransferConfig(
    backend="local",
    prefill_tp=1,
    decode_tp=1,
    kv_heads=2,
    layers=1,
    head_dim=8,
    tokens=16,
    page_size=4,
    requests=1,
    chunk_tokens=8,
)
HARNESS_LIKE = BodyOptions(host=None, log_level=None)

closed: list[Role] = []
constructed: list[dict[str, Any]] = []


class Recording(LocalKVManager):
    """A local backend that records how it was built and that it was closed."""

    def __init__(self, kv_args: Any, *, role: Role, attn_tp_size: int, **rest: Any) -> None:
        constructed.append(rest)
        super().__init__(kv_args, role=role, attn_tp_size=attn_tp_size, **rest)

    def close(self, *args: Any, **kwargs: Any) -> Any:
        closed.append(self.role)
        return super().close(*args, **kwargs)


@pytest.fixture(autouse=True)
def _clear() -> None:
    closed.clear()
    constructed.clear()


@pytest.mark.parametrize(
    ("side", "setup", "role"),
    [
        (DecodeBody, "enable_decode_staging", Role.DECODE),
        (PrefillBody, "enable_prefill_staging", Role.PREFILL),
    ],
)
def test_a_failing_staging_setup_closes_the_backend(
    monkeypatch: pytest.MonkeyPatch, side: type[DecodeBody | PrefillBody], setup: str, role: Role
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no staging here")

    monkeypatch.setattr(rank_body, setup, refuse)
    with pytest.raises(RuntimeError, match="no staging here"):
        side(CONFIG, 0, HARNESS_LIKE, Recording)
    assert closed == [role]


def test_a_body_without_a_host_uses_the_standard_constructor() -> None:
    body = DecodeBody(CONFIG, 0, HARNESS_LIKE, Recording)
    try:
        assert constructed == [{}]
        assert body.info().ring_size == body.handler.allocator.total_size > 0
    finally:
        body.close()
    body.close()  # idempotent
    assert closed == [Role.DECODE]


def test_a_plain_body_is_given_its_role() -> None:
    with pytest.raises(ValueError, match="needs its role"):
        rank_body.RankBody(CONFIG, 0, HARNESS_LIKE, Recording)
    assert constructed == []  # refused before any backend was built
