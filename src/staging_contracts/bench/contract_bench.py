"""Group ``contract``: what enforcement costs.

* ``contract.per-call`` — a method the host defines and one the mixin provides (the prefill's
  per-chunk ``_is_watermark_ready``), called on an enforced host, against the same methods
  on an unchecked plain class (goal <= 1.02: the contract never touches the hot path);
* ``contract.instance-check`` — our once-per-construction check against
  ``typeguard.check_type(obj, StagingHost)`` on the same object (goal <= 0.3);
* ``contract.class-check`` — creating a host class with the mixin (class check and
  initialiser wrapping included) against creating the same class without it (informative).
"""

from __future__ import annotations

import typing
from typing import Any

from typeguard import CollectionCheckStrategy, check_type

from ..mixin import STAGING_CONTRACT, StagingManagerMixin
from ..prefill.books import RegionAnswerTable, WatermarkTracker
from ..protocols import (
    ArrivalOutcome,
    DecodeStagingContext,
    KVArgs,
    KVArgsRecord,
    KVBufferTensors,
    PrefillStagingContext,
    StagingHandler,
    StagingHost,
    StagingReqOutcome,
    Watermark,
)
from . import BenchOptions, BenchRow, ratio_row
from .timing import interleaved_ns_per_call, median_seconds

__all__ = ["run"]


class _Handler:
    def handle_staging_req(
        self, room: int, chunk_idx: int, *, num_pages: int, session_id: str, pp_rank: int | None
    ) -> StagingReqOutcome:
        return StagingReqOutcome.ALLOCATED

    def handle_chunk_arrival(
        self,
        room: int,
        chunk_idx: int,
        *,
        page_start: int,
        num_pages: int,
        session_id: str,
        writer_rank: int | None,
    ) -> ArrivalOutcome:
        return ArrivalOutcome.WAITING


def _kv_args() -> KVArgsRecord:
    return KVArgsRecord(
        page_size=16,
        kv_item_lens=(4096,) * 4,
        engine_rank=0,
        device="cpu",
        total_kv_head_num=8,
        kv_head_num=4,
        kv_layer_ids=(0, 1),
    )


class _Base:
    kv_args: KVArgs
    attn_tp_size: int
    kv_buffer_tensors: KVBufferTensors | None

    def __init__(self) -> None:
        self.kv_args = _kv_args()
        self.attn_tp_size = 2
        self.kv_buffer_tensors = None
        self.counter = 0

    def host_method(self) -> int:
        self.counter += 1
        return self.counter


def _prefill_context() -> PrefillStagingContext:
    watermarks = WatermarkTracker()
    watermarks.observe("decode-0", Watermark(3, 4096))
    return PrefillStagingContext(watermarks, RegionAnswerTable())


class _EnforcedHost(StagingManagerMixin, _Base):
    _staging_handler: StagingHandler | None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None

    def __init__(self) -> None:
        super().__init__()
        self._staging_handler = _Handler()
        self._staging_ctx = _prefill_context()


class _PlainHost(_Base):
    _staging_handler: StagingHandler | None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None

    def __init__(self) -> None:
        super().__init__()
        self._staging_handler = _Handler()
        self._staging_ctx = _prefill_context()

    # The very function the mixin provides (the prefill's per-chunk readiness check, its
    # hot path), copied onto a class without any contract.
    _is_watermark_ready = StagingManagerMixin._is_watermark_ready


def _per_call(quick: bool) -> BenchRow:
    enforced = _EnforcedHost()
    plain = _PlainHost()

    def calls(host: Any) -> Any:
        def loop(n: int) -> None:
            for _ in range(n):
                host.host_method()
                host._is_watermark_ready("decode-0", 4, 1024)

        return loop

    loops = 20_000 if quick else 200_000
    ours, anchor = interleaved_ns_per_call(
        calls(enforced), calls(plain), loops=loops, repeats=5 if quick else 31
    )
    # Two method calls per iteration: report per call.
    return ratio_row("contract.per-call", ours / 2, anchor / 2, "ns/call", "<= 1.02")


def _instance_check(quick: bool) -> BenchRow:
    host = _EnforcedHost()
    repeats = 5 if quick else 41
    loops = 50 if quick else 400

    def ours() -> None:
        for _ in range(loops):
            STAGING_CONTRACT.check_instance(host)

    def anchor() -> None:
        for _ in range(loops):
            check_type(
                host, StagingHost, collection_check_strategy=CollectionCheckStrategy.ALL_ITEMS
            )

    ours_s = median_seconds(ours, repeats=repeats)
    anchor_s = median_seconds(anchor, repeats=repeats)
    return ratio_row(
        "contract.instance-check",
        ours_s / loops * 1e6,
        anchor_s / loops * 1e6,
        "us/check",
        "<= 0.3",
    )


def _class_body(ns: dict[str, Any]) -> None:
    ns["__annotations__"] = {
        "_staging_handler": StagingHandler | None,
        "_staging_ctx": DecodeStagingContext | PrefillStagingContext | None,
    }

    def __init__(self: Any) -> None:
        _Base.__init__(self)
        self._staging_handler = None
        self._staging_ctx = None

    ns["__init__"] = __init__


def _class_check(quick: bool) -> BenchRow:
    import types  # noqa: PLC0415 - only this benchmark creates classes dynamically

    loops = 20 if quick else 200

    def make(bases: tuple[type, ...]) -> Any:
        def run() -> None:
            for _ in range(loops):
                types.new_class("Host", bases, {}, _class_body)

        return run

    ours_s = median_seconds(make((StagingManagerMixin, _Base)), repeats=5 if quick else 21)
    anchor_s = median_seconds(make((_Base,)), repeats=5 if quick else 21)
    return ratio_row(
        "contract.class-check", ours_s / loops * 1e6, anchor_s / loops * 1e6, "us/class"
    )


def run(options: BenchOptions) -> list[BenchRow]:
    """Run the group; ``options.quick`` trades precision for time (smoke tests)."""
    quick = options.quick
    typing.get_type_hints(StagingHost)  # resolve outside the timed region
    return [_per_call(quick), _instance_check(quick), _class_check(quick)]
