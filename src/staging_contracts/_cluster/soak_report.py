"""What a soak is and what it found: its faults, its configuration, its result and summary.

The pure half of ``staging-contracts soak``: no process is started here
(:func:`~.soak.run_soak` runs a soak). How each room is counted (succeeded, failed, corrupt,
hung) is in :class:`SoakResult`'s fields, what passes in :attr:`SoakResult.problems`, and
the operator's view in docs/operating.md. Every time in a result, its summary and the
driver's progress lines (``at_s``, ``elapsed_s``) is in seconds since the soak started;
durations (``detect_s``, ``restart_s``, a stall's length) are differences on that clock.
"""

from __future__ import annotations

import argparse
import logging
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Final

from .. import config as settings
from .._prefill.writer import PrefillTimeouts
from .._run.workload import TransferConfig, ring_bytes
from ..backends import BACKENDS
from ..outcomes import classify
from ._options import add_backend_argument, add_typed_options
from .preflight import check_environment
from .soak_memory import MemoryVerdict, memory_rows
from .soak_rank import SOAK_BODY, SOAK_PREFILL_TIMEOUTS, RankSettings

SOAK_LIVENESS_TIMEOUT_S: Final = 3.0
"""The soak's liveness timeout (short, so that kills are found quickly), unless
``--liveness-timeout`` or ``STAGING_CONTRACTS_LIVENESS_TIMEOUT_S`` says otherwise."""
SOAK_STALL_TIMEOUT_S: Final = 4.0
"""The soak's decode stall timeout, unless ``STAGING_CONTRACTS_STALL_TIMEOUT_S`` says otherwise."""
SOAK_META_TIMEOUT_S: Final = 5.0
"""The soak's ``ROOM_META`` timeout, unless ``STAGING_CONTRACTS_META_TIMEOUT_S`` says
otherwise."""

NO_MEMORY: Final = MemoryVerdict((), 0.0)
"""No samples (a result built without them)."""


FAULTS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "drop": "drop a share of every rank's outgoing control messages (--drop-share, "
        "default 2%) for the whole run: requests, answers, watermarks, room messages, fences, "
        "pings",
        "flood": "send a burst of messages to a decode rank's control listener, then to a "
        "prefill rank's, from two threads each: "
        "malformed ones (random bytes, known types with bad fields, too many frames) and "
        "well-formed ones the rank must not keep (late STAGING_RSP, ROOM_META for rooms "
        "never opened, CHUNK_READY without a tag). With STAGING_CONTRACTS_SECRET the flooder "
        "holds the secret (a CURVE key the rank trusts, as a participant registered on the "
        "bootstrap), so every message passes the handshake. Fails the soak if a message is "
        "not counted or the answer table, the early ROOM_META store or the open rooms grew "
        "past their bound",
        "stall": "SIGSTOP a prefill rank for 2 s (under the liveness timeout), then SIGCONT",
        "stall-long": "SIGSTOP a prefill rank for the liveness timeout + 1.5 s: it is declared "
        "dead while it still holds its writes, then it comes back (SIGCONT)",
        "pause": "SIGSTOP a prefill rank, then a decode rank, each for the liveness timeout + "
        "1.5 s, then SIGCONT: a paused writer whose regions were reused comes back with its "
        "writes in flight. With this fault listed the ranks run with the integrity check on "
        "(STAGING_CONTRACTS_INTEGRITY=1), so that a late landing fails its room instead of "
        "passing as success",
        "forge": "a hostile engine in the driver loads a decode rank's engine metadata. "
        "nixl (with STAGING_CONTRACTS_SECRET): it sends forged arrival notifications for the "
        "rooms in flight (no tag, a made-up MAC); decode must drop and count every one "
        "(unauthorized). mooncake: it writes garbage one-sidedly over decode's whole ring "
        "for 1.5 s, with no arrival; a room whose region it overwrote must fail with reason "
        "integrity, never succeed. With this fault listed the ranks run with the integrity "
        "check on. Skipped (injected 0 times) on nixl without the secret and on other "
        "backends",
        **{
            f"kill-{role}": f"SIGKILL a {role} rank with rooms in flight, time until the "
            "survivors fail those rooms, start a new process for it (rooms keep coming to the "
            "survivors meanwhile)"
            for role in ("prefill", "decode")
        },
    }
)
"""Every fault the soak injects: name -> what it does (``--help`` lists these)."""
FAULT_ORDER: Final = tuple(FAULTS)
"""The order faults are injected in (``drop`` is on for the whole run)."""


def parse_faults(text: str) -> tuple[str, ...]:
    """The faults named in a comma-separated list (``all``: every fault; ``none``: none).

    Returns:
        The named faults, in :data:`FAULT_ORDER`, each once.

    Raises:
        ValueError: a name is not a fault; the message names the valid ones.
    """
    names = [part.strip() for part in text.split(",") if part.strip()]
    if names == ["all"]:
        return FAULT_ORDER
    if names in ([], ["none"]):
        return ()
    unknown = [name for name in names if name not in FAULTS]
    if unknown:
        raise ValueError(
            f"unknown fault{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"valid faults: {', '.join(FAULT_ORDER)} (or all, none)"
        )
    return tuple(name for name in FAULT_ORDER if name in names)


SOAK_EPILOG: Final = "\n".join(
    [
        "faults (--faults, comma-separated; default all):",
        *(
            textwrap.fill(
                text, width=88, initial_indent=f"  {name:<13} ", subsequent_indent=" " * 16
            )
            for name, text in FAULTS.items()
        ),
        "",
        "The soak runs until --duration has passed and each listed fault was injected once.",
        "Exit status: 0 when no room was corrupt or hung, the rings and fences were empty at the",
        "end, every control listener lived and some rooms succeeded; 1 otherwise; 2 for bad",
        "options.",
        "",
        "examples:",
        "  staging-contracts soak --duration 60",
        "  staging-contracts soak --backend mooncake --faults kill-prefill,kill-decode",
        "  staging-contracts soak --faults drop,flood --drop-share 0.05 --duration 300",
    ]
)
"""The end of ``staging-contracts soak --help``: every fault, the exit status, examples."""


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    """The soak's command-line options (``--faults`` is parsed by :func:`config_from_args`,
    so that an unknown name is refused in one line)."""
    default = SoakConfig()
    add_backend_argument(parser, default.backend)
    parser.add_argument(
        "--duration",
        type=float,
        default=default.duration_s,
        metavar="S",
        help=f"seconds of rooms and faults (default {default.duration_s:g})",
    )
    parser.add_argument(
        "--faults",
        default="all",
        metavar="LIST",
        help=f"comma-separated faults to inject: {', '.join(FAULT_ORDER)}, all or none "
        "(default all; see below)",
    )
    parser.add_argument(
        "--host",
        default=default.host,
        help="address the ranks' control listeners and engines bind (default 127.0.0.1; "
        "another address needs STAGING_CONTRACTS_SECRET)",
    )
    in_flight = default.rooms_in_flight
    ranks = (
        ("--seed", int, "N", None),
        ("--prefill-tp", int, "P", None),
        ("--decode-tp", int, "D", None),
        (
            "--prefill-instances",
            int,
            "N",
            "prefill instances of P ranks each, sharing decode's ring; rooms go to them in "
            f"turn (default {default.prefill_instances})",
        ),
        ("--rooms-in-flight", int, "N", f"rooms kept issued at once (default {in_flight})"),
        (
            "--drop-share",
            float,
            "F",
            f"share of control messages the drop fault loses (default {default.drop_share:g})",
        ),
    )
    add_typed_options(parser, default, ranks)
    parser.add_argument(
        "--liveness-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds of silence before a rank declares a peer dead (default: "
        f"STAGING_CONTRACTS_LIVENESS_TIMEOUT_S, else {default.liveness_timeout_s:g}; the "
        "soak's stall and ROOM_META timeouts and prefill's chunk bounds likewise take their "
        "variable, else the soak's own short values; the ring is sized by the soak, "
        "STAGING_CONTRACTS_RING_BYTES is ignored with a warning)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="let the ranks log warnings (every failed room)"
    )


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    """Build the soak's configuration from parsed options.

    The liveness timeout is ``--liveness-timeout``, else its variable, else the soak's
    default; the stall and ``ROOM_META`` timeouts are their variables, else the soak's
    defaults; the liveness interval is its variable, else the library's default.

    Raises:
        ConfigError: a variable of the settings table is unusable.
        ValueError: an unknown fault (the message names the valid ones), or a value out of
            range.
    """
    if args.liveness_timeout is not None:
        liveness_timeout_s = args.liveness_timeout
        check_environment(liveness_timeout_s, timeout_source="--liveness-timeout")
    elif settings.LIVENESS_TIMEOUT_S.from_env() is not None:
        liveness_timeout_s = settings.LIVENESS_TIMEOUT_S.value()
        check_environment()  # the timeout is the variable's, and named so
    else:
        liveness_timeout_s = SOAK_LIVENESS_TIMEOUT_S
        check_environment(liveness_timeout_s, timeout_source="the soak's default")
    return SoakConfig(
        backend=args.backend,
        duration_s=args.duration,
        faults=parse_faults(args.faults),
        host=args.host,
        seed=args.seed,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        prefill_instances=args.prefill_instances,
        rooms_in_flight=args.rooms_in_flight,
        drop_share=args.drop_share,
        liveness_timeout_s=liveness_timeout_s,
        liveness_interval_s=settings.LIVENESS_INTERVAL_S.value(),
        stall_timeout_s=settings.STALL_TIMEOUT_S.value_or(SOAK_STALL_TIMEOUT_S),
        meta_timeout_s=settings.META_TIMEOUT_S.value_or(SOAK_META_TIMEOUT_S),
        log_level=logging.WARNING if args.verbose else logging.ERROR,
    )


def reason_group(reason: str) -> str:
    """The category of a room's failure reason: the value of its
    :class:`~staging_contracts.outcomes.FailureReason` (by
    :func:`~staging_contracts.outcomes.classify`, its innermost cause), as the metrics label it.

    A reason passed on by the other side (``"decode failed the room: prefill writer rank 0
    ... is dead"``) counts as its cause (``"peer dead"``). Unrecognised reasons are
    ``"other"``.
    """
    return classify(reason).value


@dataclass(frozen=True, slots=True)
class SoakConfig:
    """One soak: engine, duration, faults, ranks, the load and the bounds.

    Raises:
        ValueError: an unknown fault or backend, or a size or bound out of range.
    """

    backend: str = "nixl"
    """The backend spec: a name (``nixl``, ``mooncake``, a registered one), ``MODULE:CLASS``
    or ``MODULE:CLASS=MODULE:FACTORY``, whose engine works across processes (resolved by
    :func:`~staging_contracts.backends.resolve_backend` in each rank process)."""
    duration_s: float = 60.0
    """How long rooms are issued; the soak runs longer if a listed fault is still due."""
    faults: tuple[str, ...] = FAULT_ORDER
    """Faults to inject (names of :data:`FAULTS`)."""
    host: str = "127.0.0.1"
    """Address every rank's control listener and engine bind. A non-loopback address needs
    the cluster secret (``STAGING_CONTRACTS_SECRET``); the driver's own sockets stay on
    loopback."""
    seed: int = 0
    """Seeds the workload, the drops, the flood frames and which rank each fault hits."""
    prefill_tp: int = 2
    decode_tp: int = 1
    prefill_instances: int = 1
    """Prefill instances (tenants) of ``prefill_tp`` ranks each; rooms go to them in turn,
    and every instance's rooms share decode's ring (so that a paused writer of one can
    reach a region since given to another)."""
    rooms_in_flight: int = 4
    """Rooms the driver keeps issued and not yet ended."""
    drop_share: float = 0.02
    """Share of control messages the ``drop`` fault discards."""
    flood_frames: int = 20_000
    """Malformed messages in one ``flood`` burst (over its two threads)."""
    liveness_timeout_s: float = SOAK_LIVENESS_TIMEOUT_S
    """Ranks declare a peer dead after this long without a word from it."""
    liveness_interval_s: float = settings.LIVENESS_INTERVAL_S.default
    """Ranks ping a watched peer this often; must be below :attr:`liveness_timeout_s`."""
    stall_timeout_s: float = SOAK_STALL_TIMEOUT_S
    """Decode fails a room that holds a writable region without progress this long."""
    meta_timeout_s: float = SOAK_META_TIMEOUT_S
    """Prefill fails a room whose ``ROOM_META`` has not come this long after its first chunk."""
    room_bound_s: float = 45.0
    """A room not ended this long after it was issued is hung."""
    settle_s: float = 2.0
    """Fault-free time between two faults."""
    kv_heads: int = 4
    layers: int = 2
    head_dim: int = 64
    tokens: int = 256
    page_size: int = 16
    chunk_tokens: int = 64
    ring_chunks: int = 4
    log_level: int = logging.ERROR
    """Level of the rank processes' log lines (stderr)."""

    def __post_init__(self) -> None:
        in_tree = BACKENDS.get(self.backend)
        if not self.backend or (in_tree is not None and in_tree.engine in (None, "local")):
            raise ValueError(
                f"backend {self.backend!r} cannot stage across processes; use nixl, mooncake "
                "or a spec whose engine crosses processes"
            )
        unknown = [name for name in self.faults if name not in FAULTS]
        if unknown:
            raise ValueError(f"unknown faults {unknown}; valid: {', '.join(FAULT_ORDER)}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s={self.duration_s!r} must be > 0")
        if self.prefill_instances < 1:
            raise ValueError(f"prefill_instances={self.prefill_instances} must be >= 1")
        if self.rooms_in_flight < 1 or self.flood_frames < 2:
            raise ValueError(
                f"rooms_in_flight={self.rooms_in_flight} must be >= 1 and "
                f"flood_frames={self.flood_frames} >= 2"
            )
        if not 0.0 <= self.drop_share < 0.5:
            raise ValueError(f"drop_share={self.drop_share!r} must be in [0, 0.5)")
        for name in ("liveness_timeout_s", "stall_timeout_s", "meta_timeout_s", "room_bound_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if not 0 < self.liveness_interval_s < self.liveness_timeout_s:
            raise ValueError(
                f"liveness_interval_s={self.liveness_interval_s!r} (the ping interval) must be "
                f"> 0 and below liveness_timeout_s={self.liveness_timeout_s!r}"
            )
        ring_bytes(self.transfer())  # raises ValueError for a TP pair the heads do not allow

    def transfer(self) -> TransferConfig:
        """The seeded workload the ranks share: twice as many requests as rooms in flight."""
        return TransferConfig(
            backend=self.backend,
            prefill_tp=self.prefill_tp,
            decode_tp=self.decode_tp,
            kv_heads=self.kv_heads,
            layers=self.layers,
            head_dim=self.head_dim,
            tokens=self.tokens,
            page_size=self.page_size,
            requests=2 * self.rooms_in_flight,
            seed=self.seed,
            chunk_tokens=self.chunk_tokens,
            ring_chunks=self.ring_chunks,
        )

    @property
    def integrity(self) -> bool:
        """Whether the ranks check staged bytes against their integrity tags: on with the
        ``pause`` fault (a paused writer's late landing must fail its room) and the ``forge``
        fault (a hostile write must fail its room), else as ``STAGING_CONTRACTS_INTEGRITY``
        says in each rank process."""
        return "pause" in self.faults or "forge" in self.faults

    def rank_settings(self) -> RankSettings:
        """What every rank process is started with."""
        body = replace(
            SOAK_BODY,
            host=self.host,
            liveness_timeout_s=self.liveness_timeout_s,
            liveness_interval_s=self.liveness_interval_s,
            stall_timeout_s=self.stall_timeout_s,
            prefill_timeouts=PrefillTimeouts(
                answer_s=settings.PREFILL_ANSWER_S.value_or(SOAK_PREFILL_TIMEOUTS.answer_s),
                ready_s=settings.PREFILL_READY_S.value_or(SOAK_PREFILL_TIMEOUTS.ready_s),
                deadline_s=settings.PREFILL_DEADLINE_S.value_or(SOAK_PREFILL_TIMEOUTS.deadline_s),
            ),
            meta_timeout_s=self.meta_timeout_s,
            integrity=True if self.integrity else None,
            log_level=self.log_level,
        )
        return RankSettings(
            transfer=self.transfer(),
            body=body,
            room_bound_s=self.room_bound_s,
            drop_share=self.drop_share if "drop" in self.faults else 0.0,
            seed=self.seed,
        )


@dataclass(frozen=True, slots=True)
class KillRecord:
    """One rank killed (``kill-*``) or found dead, and how the others took it."""

    role: str
    rank: int
    at_s: float
    """When it died, in seconds since the soak started."""
    rooms_in_flight: int
    """Rooms it was part of that a surviving rank had not ended yet when it died."""
    rooms_failed: int
    """Of those, rooms that failed (the others had finished their part before)."""
    detect_s: float | None
    """Seconds from the death until the surviving ranks had failed every one of those rooms
    that failed (``None``: none failed after the death)."""
    restart_s: float | None
    """Seconds from the death until its new process was ready and had taken its peers, so
    that rooms went to it again (``None``: it did not come back)."""
    unexpected: bool = False
    """The process died by itself, not by the soak's hand (always a problem)."""
    served_after: int = 0
    """Rooms its new process took part in that succeeded, by the end of the soak."""


@dataclass(frozen=True, slots=True)
class StallRecord:
    """One rank stopped (``SIGSTOP``) and continued (``stall``, ``stall-long``: a prefill
    rank; ``pause``: a prefill rank, then a decode rank)."""

    rank: int
    at_s: float
    """When it was stopped, in seconds since the soak started."""
    duration_s: float
    rooms_in_flight: int
    """Rooms issued and not ended when it stopped."""
    rooms_failed: int
    """Rooms that failed from the stop until shortly after it continued (those issued
    during the stop included)."""
    role: str = "prefill"
    """The stopped rank's role."""
    fault: str = "stall"
    """The fault that stopped it: ``stall``, ``stall-long`` or ``pause``."""


@dataclass(frozen=True, slots=True)
class ForgeRecord:
    """One ``forge`` at a decode rank: a burst of forged arrival notifications (NIXL,
    ``kind`` ``notify``), or hostile one-sided writes of garbage over its ring (Mooncake,
    ``kind`` ``write``)."""

    target: str
    """``"decode 0"``, ..."""
    at_s: float
    """When the burst began, in seconds since the soak started."""
    rooms: int
    """Rooms in flight when it began (``notify``: the rooms the notifications named)."""
    sent: int
    """Forged notifications sent (``write``: hostile writes that landed)."""
    counted: int
    """``notify``: of those, counted ``unauthorized`` by the target meanwhile (should equal
    ``sent``); ``write``: 0."""
    kind: str = "notify"
    """``notify`` (forged NIXL notifications) or ``write`` (hostile Mooncake writes)."""
    bytes_written: int = 0
    """``write``: bytes of garbage that landed in the target's ring."""
    seconds: float = 0.0
    """``write``: how long the hostile engine kept writing."""
    integrity_failed: int = 0
    """``write``: rooms that failed with reason ``integrity`` from the first write until
    shortly after the last (their region was overwritten before its check; none may
    succeed with those bytes: the soak's check would find it corrupt)."""


@dataclass(frozen=True, slots=True)
class FloodRecord:
    """One burst of malformed frames at a rank's control listener."""

    target: str
    """``"decode 0"``, ``"prefill 1"``, ..."""
    at_s: float
    """When the burst began, in seconds since the soak started."""
    sent: int
    """Messages sent (malformed and well-formed)."""
    counted: int
    """Messages the target accounted for meanwhile, over every counter of ``counted_by``
    (should be at least ``sent``: the rank's own traffic moves some counters too)."""
    seconds: float
    """How long the sending took."""
    authenticated: bool = False
    """Sent through CURVE sockets with a key the target trusts (the flooder held the cluster
    secret), so that every message reached the target's dispatch; ``False``: plain sockets
    (no secret)."""
    sent_by_kind: Mapping[str, int] = field(default_factory=dict)
    """Messages sent by kind: ``malformed``, or the well-formed message's type."""
    counted_by: Mapping[str, int] = field(default_factory=dict)
    """How much each counter of the target moved meanwhile (see ``soak_flood.COUNTERS``)."""
    state: Mapping[str, int] = field(default_factory=dict)
    """What the target held once the flood was counted (see ``soak_flood.STATE``)."""
    state_bounds: Mapping[str, int] = field(default_factory=dict)
    """The most each of ``state`` may hold (see ``soak_flood.state_bounds``)."""

    @property
    def uncounted(self) -> int:
        """Messages sent that no counter of the target accounts for."""
        return max(0, self.sent - self.counted)

    @property
    def grown(self) -> list[str]:
        """``"answers_held 20000 > 64"`` for each of ``state`` above its bound."""
        return [
            f"{name} {value} > {self.state_bounds[name]}"
            for name, value in self.state.items()
            if name in self.state_bounds and value > self.state_bounds[name]
        ]


@dataclass(frozen=True, slots=True)
class SoakResult:
    """The outcome of :func:`run_soak`."""

    config: SoakConfig
    elapsed_s: float
    """When the ranks were stopped, in seconds since the soak started (just before the rank
    processes started): the soak's whole length."""
    rooms_started: int
    rooms_succeeded: int
    """Rooms every decode rank completed with pages that verified."""
    rooms_prefill_failed: int
    """Of those, rooms a prefill rank failed or died in after its part had landed (the
    request still goes on on decode)."""
    failed_by_reason: dict[str, int]
    """Rooms a decode rank failed or died in, by :func:`reason_group` of their first failure
    reason, decode's first (``"rank killed"``: no survivor failed it, a decode rank it needed
    died)."""
    failure_examples: dict[str, str]
    """One failure reason of each group, as a rank gave it."""
    corrupt: int
    """Rooms a decode rank reported done whose pages do not verify. Must be 0."""
    corrupt_details: tuple[str, ...]
    hung: int
    """Rooms not ended within :attr:`SoakConfig.room_bound_s` by a rank that stayed alive (a
    liveness bug). Must be 0."""
    hung_details: tuple[str, ...]
    kills: tuple[KillRecord, ...]
    stalls: tuple[StallRecord, ...]
    floods: tuple[FloodRecord, ...]
    forges: tuple[ForgeRecord, ...]
    unauthorized: int
    """Arrivals the ranks dropped for a missing or bad MAC (over every process, as last
    reported)."""
    faults_injected: dict[str, int]
    """Fault name -> times injected (``drop``: 1 when it dropped any message)."""
    control_sent: int
    """Control messages the ranks sent (over every process, as last reported)."""
    control_dropped: int
    """Of those, dropped by the ``drop`` fault."""
    ring_live_bytes_end: int
    """Bytes the decode rings still held once idle at the end. Must be 0."""
    ring_live_regions_end: int
    """Regions the decode rings still held once idle at the end. Must be 0."""
    fenced_rooms_end: int
    """Rooms still fenced at the end. Must be 0."""
    open_rooms_end: int
    """Rooms still open on a rank at the end. Must be 0."""
    idle_reached: bool
    """Every rank answered the final ``status`` and reported nothing held."""
    listener_restarts: int
    """Control listener threads that ended (each would need a restart). Must be 0."""
    listener_errors: int
    """Dispatches or idle runs that raised something other than ``MalformedMessage`` (bugs;
    each is logged with its traceback by the rank), over the ranks alive at the end."""
    unexpected_exits: tuple[str, ...]
    """Rank processes that died without being killed by the soak. Must be empty."""
    rank_errors: tuple[str, ...]
    """Commands a rank could not carry out. Must be empty."""
    interrupted: str | None = None
    """The signal (``"SIGTERM"``, ``"SIGINT"``) that ended the soak early: the figures are
    what was seen until then (a partial soak, which does not pass)."""
    memory: MemoryVerdict = NO_MEMORY
    """Every rank process's RSS after the warm-up, judged (see ``soak_memory``). Must be
    flat."""

    @property
    def bytes_verified(self) -> int:
        """KV bytes of the rooms that succeeded: each room's whole request (every head, K and
        V, every layer), verified on every decode rank."""
        return self.rooms_succeeded * self.config.transfer().request_bytes

    @property
    def rooms_failed(self) -> int:
        """Rooms that failed, whatever the reason."""
        return sum(self.failed_by_reason.values())

    @property
    def problems(self) -> list[str]:
        """Why the soak did not pass, one line each (empty: it passed)."""
        out: list[str] = []
        if self.interrupted is not None:
            out.append(f"interrupted by {self.interrupted}: a partial soak")
        if self.corrupt:
            out.append(f"{self.corrupt} corrupt rooms")
        if self.hung:
            out.append(f"{self.hung} hung rooms")
        if self.ring_live_bytes_end or self.ring_live_regions_end:
            out.append(
                f"ring still holds {self.ring_live_bytes_end} bytes in "
                f"{self.ring_live_regions_end} regions at the end"
            )
        if self.fenced_rooms_end or self.open_rooms_end:
            out.append(
                f"{self.fenced_rooms_end} fenced and {self.open_rooms_end} open rooms at the end"
            )
        if not self.idle_reached:
            out.append("the ranks did not all report idle at the end")
        for flood in self.floods:
            if flood.uncounted:
                out.append(f"{flood.uncounted} flood messages to {flood.target} not counted")
            if flood.grown:
                out.append(f"the flood grew state on {flood.target}: {', '.join(flood.grown)}")
        uncounted = sum(f.sent - f.counted for f in self.forges if f.kind == "notify")
        if uncounted > 0:
            out.append(f"{uncounted} forged arrivals not counted unauthorized")
        if self.listener_restarts:
            out.append(f"{self.listener_restarts} control listeners died")
        if self.unexpected_exits:
            out.append(f"{len(self.unexpected_exits)} rank processes died by themselves")
        if self.rank_errors:
            out.append(f"{len(self.rank_errors)} commands failed on a rank")
        if not self.rooms_succeeded:
            out.append("no room succeeded")
        if not self.memory.flat:
            out.append(f"memory grew in {len(self.memory.grown)} rank processes")
        return out

    @property
    def ok(self) -> bool:
        """Nothing corrupt, hung or leaked, every listener alive, some rooms succeeded."""
        return not self.problems


def _flood_rows(flood: FloodRecord) -> list[tuple[str, str]]:
    """What one flood sent, how the target counted it and what it held after."""
    how = "authenticated (CURVE, a trusted key)" if flood.authenticated else "plain sockets"
    kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(flood.sent_by_kind.items()))
    counters = ", ".join(f"{name} +{count}" for name, count in flood.counted_by.items() if count)
    held = ", ".join(
        f"{name} {value} (bound {flood.state_bounds.get(name, '?')})"
        for name, value in flood.state.items()
    )
    return [
        (
            "flood",
            f"{flood.target} at {flood.at_s:.1f} s, {how}: {flood.sent} messages in "
            f"{flood.seconds:.1f} s ({kinds or 'none'}); {flood.counted} counted"
            + ("" if not flood.uncounted else f", {flood.uncounted} NOT counted"),
        ),
        ("  counted by", counters or "no counter moved"),
        ("  held after", held or "not reported"),
    ]


def format_summary(result: SoakResult) -> str:
    """The soak's summary, one fact per line."""
    config = result.config
    failed = result.failed_by_reason
    prefill = f"{config.prefill_tp} prefill"
    if config.prefill_instances > 1:
        prefill = f"{config.prefill_instances} instances of {prefill}"
    rows: list[tuple[str, str]] = [
        ("engine", f"{config.backend}, {prefill} -> {config.decode_tp} decode"),
        ("ran", f"{result.elapsed_s:.1f} s, faults: {', '.join(config.faults) or 'none'}"),
        *(
            [("PARTIAL", f"interrupted by {result.interrupted}: what was seen until then")]
            if result.interrupted is not None
            else []
        ),
        ("times", "seconds since the soak started (as the progress lines)"),
        (
            "rooms",
            f"{result.rooms_started} started, {result.rooms_succeeded} succeeded, "
            f"{result.rooms_failed} failed, {result.corrupt} corrupt, {result.hung} hung",
        ),
        (
            "  succeeded",
            f"{result.rooms_prefill_failed} of them failed or lost on a prefill rank after its "
            "part landed",
        ),
        ("  bytes", f"{result.bytes_verified} verified (the succeeded rooms' KV bytes)"),
    ]
    for group, count in failed.items():
        rows.append((f"  failed: {group}", f"{count}  (e.g. {result.failure_examples[group]})"))
    for detail in (*result.corrupt_details, *result.hung_details)[:5]:
        rows.append(("  !", detail.replace("\n", "; ")))
    injected = ", ".join(f"{n} {c}" for n, c in result.faults_injected.items()) or "none"
    rows.append(("faults injected", injected))
    if "drop" in config.faults:
        rows.append(
            (
                "control dropped",
                f"{result.control_dropped} of {result.control_sent} messages "
                f"({config.drop_share:.0%} asked)",
            )
        )
    for flood in result.floods:
        rows += _flood_rows(flood)
    for forge in result.forges:
        if forge.kind == "write":
            hit = (
                f"{forge.integrity_failed} rooms failed integrity meanwhile"
                if forge.integrity_failed
                else "no room failed integrity meanwhile (the writes hit no region before "
                "its check)"
            )
            text = (
                f"{forge.target} at {forge.at_s:.1f} s: {forge.sent} hostile writes "
                f"({forge.bytes_written} bytes of garbage over its ring) in "
                f"{forge.seconds:.1f} s, {forge.rooms} rooms in flight; {hit}"
            )
        else:
            text = (
                f"{forge.target} at {forge.at_s:.1f} s: {forge.sent} forged notifications for "
                f"{forge.rooms} rooms in flight, {forge.counted} counted unauthorized"
            )
        rows.append(("forge", text))
    if "forge" in config.faults and not result.faults_injected.get("forge"):
        rows.append(("forge", "skipped: it needs nixl and STAGING_CONTRACTS_SECRET, or mooncake"))
    if any(forge.kind == "notify" for forge in result.forges) or result.unauthorized:
        rows.append(
            (
                "unauthorized",
                f"{result.unauthorized} messages from authenticated senders refused (arrivals "
                "without a valid MAC, answers not from the session's decode rank)",
            )
        )
    for stall in result.stalls:
        rows.append(
            (
                "stall",
                f"{stall.fault}: {stall.role} {stall.rank} at {stall.at_s:.1f} s for "
                f"{stall.duration_s:.1f} s: {stall.rooms_in_flight} rooms in flight, "
                f"{stall.rooms_failed} failed meanwhile",
            )
        )
    for kill in result.kills:
        detect = "n/a (no room failed)" if kill.detect_s is None else f"{kill.detect_s:.2f} s"
        back = (
            "never"
            if kill.restart_s is None
            else f"{kill.restart_s:.1f} s, then in {kill.served_after} rooms that succeeded"
        )
        rows.append(
            (
                "died by itself" if kill.unexpected else "kill",
                f"{kill.role} {kill.rank} at {kill.at_s:.1f} s: {kill.rooms_in_flight} rooms "
                f"in flight, {kill.rooms_failed} failed; detected in {detect}; back in {back}",
            )
        )
    rows += [
        (
            "ring use at end",
            f"{result.ring_live_bytes_end} bytes in {result.ring_live_regions_end} regions, "
            f"{result.fenced_rooms_end} fenced rooms, {result.open_rooms_end} open rooms"
            + ("" if result.idle_reached else " (NOT idle)"),
        ),
        ("listener restarts", str(result.listener_restarts)),
        ("listener errors", str(result.listener_errors)),
        *memory_rows(result.memory),
    ]
    rows += [("unexpected exit", line) for line in result.unexpected_exits]
    rows += [("rank error", line) for line in result.rank_errors[:5]]
    problems = result.problems
    rows.append(("verdict", "PASS" if not problems else "FAIL: " + "; ".join(problems)))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)
