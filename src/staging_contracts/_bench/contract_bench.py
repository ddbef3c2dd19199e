"""Group ``contract``: what enforcement costs.

Each row times an enforced host (:class:`~staging_contracts.mixin.StagingManagerMixin`)
against the same work on a plain class, or our instance check against typeguard's; the
docs' benchmarks page lists the rows, their anchors and goals. ``contract.instance-check``
repeats the check on one host, so the per-class conformance cache of the Protocol-typed
members always hits; ``contract.instance-check.cold`` checks hosts of new classes only
(:func:`_cold_hosts`), where it never helps.
"""

from __future__ import annotations

import statistics
import time
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any, Protocol

from typeguard import CollectionCheckStrategy, check_type

from .._prefill.books import RegionAnswerTable, WatermarkTracker
from ..mixin import STAGING_CONTRACT, StagingManagerMixin
from ..protocols import (
    ArrivalMode,
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
from . import BenchOptions, BenchRow, ratio_row, smoke
from .timing import in_turns, interleaved_ns_per_call, median_seconds


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


class HostValues(Protocol):
    """The anchor's Protocol: the members of ``StagingHost`` as annotated attributes, so that
    typeguard checks each value's type (it checks a Protocol property for presence only)."""

    _staging_handler: StagingHandler | None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None
    kv_args: KVArgs
    attn_tp_size: int
    arrival: ArrivalMode
    kv_buffer_tensors: KVBufferTensors | None


class _Base:
    kv_args: KVArgs
    attn_tp_size: int
    kv_buffer_tensors: KVBufferTensors | None

    def __init__(self) -> None:
        self.kv_args = KVArgsRecord(
            page_size=16,
            kv_item_lens=(4096,) * 4,
            engine_rank=0,
            device="cpu",
            total_kv_head_num=8,
            kv_head_num=4,
            kv_layer_ids=(0, 1),
        )
        self.attn_tp_size = 2
        self.kv_buffer_tensors = None
        self.counter = 0

    def host_method(self) -> int:
        # reads only: what an assignment costs is the contract.member-assign rows' part
        return self.counter + self.attn_tp_size


class _PlainHost(_Base):
    _staging_handler: StagingHandler | None
    _staging_ctx: DecodeStagingContext | PrefillStagingContext | None
    arrival: ArrivalMode = "zmq"

    def __init__(self) -> None:
        super().__init__()
        self._staging_handler = _Handler()
        watermarks = WatermarkTracker()
        watermarks.observe("decode-0", Watermark(3, 4096))
        self._staging_ctx = PrefillStagingContext(watermarks, RegionAnswerTable())

    # The very function the mixin provides (the prefill's per-chunk readiness check, its
    # hot path), copied onto a class without any contract.
    _is_watermark_ready = StagingManagerMixin._is_watermark_ready


class _EnforcedHost(StagingManagerMixin, _PlainHost):
    """The same host under the contract (the mixin's ``_is_watermark_ready`` comes first)."""


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


def _member_read(quick: bool) -> BenchRow:
    def reads(host: Any) -> Any:
        def loop(n: int) -> None:
            for _ in range(n):
                host.kv_args  # noqa: B018 - the read is what is timed
                host.attn_tp_size  # noqa: B018
                host._staging_handler  # noqa: B018
                host._staging_ctx  # noqa: B018

        return loop

    loops = 50_000 if quick else 500_000
    ours, anchor = interleaved_ns_per_call(
        reads(_EnforcedHost()), reads(_PlainHost()), loops=loops, repeats=5 if quick else 31
    )
    return ratio_row(
        "contract.member-read",
        ours / 4,
        anchor / 4,
        "ns/read",
        "<= 1.05",
        note="four members read per iteration; the enforced host checks assignments only",
    )


def _member_assign(quick: bool) -> list[BenchRow]:
    handler = _Handler()

    def assigns(host: Any, name: str) -> Any:
        def loop(n: int) -> None:
            for _ in range(n):
                setattr(host, name, handler)

        return loop

    loops = 20_000 if quick else 200_000
    repeats = 5 if quick else 21
    enforced, plain = _EnforcedHost(), _PlainHost()
    rows: list[BenchRow] = []
    for row, name, note in (
        (
            "contract.member-assign",
            "_staging_handler",
            "_staging_handler (set_later) assigned with setattr(): its value is checked on "
            "every assignment (a Protocol of methods: the value's class is verified once)",
        ),
        (
            "contract.member-assign.unwatched",
            "counter",
            "an attribute the contract does not watch, assigned with setattr(): the mixin's "
            "__setattr__ looks the name up and hands the assignment on",
        ),
    ):
        ours, anchor = interleaved_ns_per_call(
            assigns(enforced, name), assigns(plain, name), loops=loops, repeats=repeats
        )
        rows.append(ratio_row(row, ours, anchor, "ns/assign", note=note))
    return rows


def _instance_check(quick: bool) -> BenchRow:
    host = _EnforcedHost()
    repeats = 5 if quick else 41
    loops = 50 if quick else 400

    def ours() -> None:
        for _ in range(loops):
            STAGING_CONTRACT.check_instance(host)

    def anchor() -> None:
        for _ in range(loops):
            _typeguard_check(host)

    ours_s = median_seconds(ours, repeats=repeats)
    anchor_s = median_seconds(anchor, repeats=repeats)
    return ratio_row(
        "contract.instance-check",
        ours_s / loops * 1e6,
        anchor_s / loops * 1e6,
        "us/check",
        "<= 0.3",
        note=(
            f"one host checked {loops} times per measurement: the conformance cache of its "
            "Protocol-typed members always hits (every instance after a class's first); "
            "the anchor has no cache"
        ),
    )


def _cold_hosts(count: int, tag: str) -> list[_EnforcedHost]:
    """``count`` hosts, each of a new class with members of new classes: no check has seen
    any of them (the construction's own check saw only the replaced members)."""
    hosts: list[_EnforcedHost] = []
    for number in range(count):
        host_class = type(f"_ColdHost{tag}{number}", (_EnforcedHost,), {})
        host = host_class()
        handler_class = type(f"_ColdHandler{tag}{number}", (_Handler,), {})
        args_class = type(f"_ColdKVArgs{tag}{number}", (KVArgsRecord,), {})
        host._staging_handler = handler_class()
        host.kv_args = args_class(**asdict(host.kv_args))
        hosts.append(host)
    return hosts


def _typeguard_check(host: object) -> None:
    """The anchor: typeguard's check of ``host`` against :class:`HostValues`."""
    check_type(host, HostValues, collection_check_strategy=CollectionCheckStrategy.ALL_ITEMS)


def _instance_check_cold(quick: bool) -> BenchRow:
    count = 30 if quick else 300
    ours: list[float] = []
    anchor: list[float] = []
    checks: tuple[tuple[Callable[[object], None], Iterator[_EnforcedHost], list[float]], ...] = (
        (STAGING_CONTRACT.check_instance, iter(_cold_hosts(count, "Ours")), ours),
        (_typeguard_check, iter(_cold_hosts(count, "Anchor")), anchor),
    )
    for check, hosts, samples in in_turns(checks, count):
        host = next(hosts)
        start = time.perf_counter()
        check(host)
        samples.append(time.perf_counter() - start)
    note = (
        f"{count} checks each, every one the first of a host of a new class whose kv_args "
        "and _staging_handler are of new classes (made before timing), so typeguard "
        "verifies both Protocols as on a class's first construction; anchor "
        "typeguard.check_type(host, HostValues, ALL_ITEMS) (StagingHost's members as annotated "
        "attributes, so that typeguard checks their values) on as many equally new hosts; "
        "median of single checks, in turns"
    )
    return ratio_row(
        "contract.instance-check.cold",
        statistics.median(ours) * 1e6,
        statistics.median(anchor) * 1e6,
        "us/check",
        "<= 1.0",
        note=note,
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
    ns["arrival"] = "zmq"


def _class_check(quick: bool) -> BenchRow:
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
    """Run the group; ``options.quick`` trades precision for time (:func:`smoke` rows)."""
    quick = options.quick
    typing.get_type_hints(StagingHost)  # resolve outside the timed region
    typing.get_type_hints(HostValues)
    rows = [
        _per_call(quick),
        _member_read(quick),
        *_member_assign(quick),
        _instance_check(quick),
        _instance_check_cold(quick),
        _class_check(quick),
    ]
    return smoke(rows) if quick else rows  # quick: too few repetitions to judge
