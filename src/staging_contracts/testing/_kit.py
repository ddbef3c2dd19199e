"""``StagingBackendContract``: the conformance tests a staging backend runs against itself.

The class checks need only ``backend_class``; the behaviour checks need a live decode manager
from ``make_decode_manager``; the transfer checks run
:func:`~staging_contracts.testing.run_transfer` with managers from ``make_manager``. How the
hooks default, skip and report a failure once: ``docs/writing-a-backend.md``, sections 2 to 4.

**Any contract.** The class and instance checks hold the backend to the contract of whatever
enforcing mixin it uses: ours (``StagingManagerMixin``) or a serving stack's own
``ContractMixin`` over its own Protocol. The instance check runs on the managers
:meth:`StagingBackendContract.make_hosts` builds the host's own way (by default the host
factory named by ``--staging-backend MODULE:CLASS=MODULE:FACTORY`` when ``FACTORY()`` takes no
arguments); the checks that need our staging path (the live decode manager, the staged
transfers, the mixin's logger) skip for a backend that does not use ``StagingManagerMixin``,
saying so.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import ClassVar, NoReturn, TypeVar, cast

import pytest

from .._contract.contract import Contract, is_abstract
from .._contract.enforcement import contract_roots
from .._contract.problems import ContractError
from .._contract.typeforms import class_label
from .._contract.witness import witness_note
from .._control.wire import ALLOC_OVERSIZED, ChunkReady, MalformedMessage, StagingReq
from .._decode.rooms import RoomStatus
from ..backends._common import Role
from ..mixin import StagingManagerMixin
from ..protocols import ArrivalOutcome, KVArgs, StagingHandler
from ..stats import StagingStats
from ._decode_setup import DecodeSetup, LiveDecodeManager
from ._factories import EngineUnavailable, FactoryUnavailable, standard_factory
from ._harness import (
    HARNESS_ENDED,
    ManagerFactory,
    TransferGeometry,
    TransferManager,
    run_transfer,
)
from ._live import WAIT_S, LiveDecode, kit_fail
from ._notes import WITNESS_GUIDE, WITNESS_NOTES
from ._targets import BackendLoadError, BackendTarget, contract_of

NO_FACTORY_MESSAGE = (
    "needs a live decode manager: define make_decode_manager(self, setup) on your "
    "StagingBackendContract subclass, returning a started manager with decode staging "
    "enabled (e.g. 'return setup.start(MyKVManager(setup.kv_args, role=Role.DECODE, "
    "attn_tp_size=setup.attn_tp_size))'), or pass "
    "--staging-backend MODULE:CLASS=MODULE:FACTORY where FACTORY(kv_args, *, role, "
    "attn_tp_size) builds an unstarted manager"
)
"""How to add a decode factory, when a behaviour test is skipped for want of one."""

NO_MANAGER_FACTORY_MESSAGE = (
    "define make_manager(self, kv_args, *, role, attn_tp_size) on your "
    "StagingBackendContract subclass, returning a new (unstarted) manager of that role, "
    "e.g. 'return MyKVManager(kv_args, role=role, attn_tp_size=attn_tp_size, ...)'"
)
"""How to add a manager factory, when a transfer check is skipped for want of one."""

TRANSFER_SHAPES = ((2, 1), (1, 2))
"""(prefill TP, decode TP) of the transfer checks: P > D, then P < D."""

_KIT_DIR = Path(__file__).resolve().parent.parent
"""Frames of the library (the kit, the harness, the backends): left out of the tracebacks
shown to an author, whose own frames remain."""

_FIRST_FAILURE: dict[tuple[type, str], str] = {}
"""(test class, what failed to build) -> the test that reported it (once per session)."""

_T = TypeVar("_T")

_UNKNOWN_ROOM = 987_654_321
_ROOM_BEFORE_ATTACH = 1
_ROOM_OVERSIZED = 2
_ROOM_SHARED = 3


class StagingBackendContract:
    """Base class of the contract kit: subclass it and set :attr:`backend_class`.

    Class checks: the class contract, its explanation and the backend's logger. Instance and
    behaviour checks run on a live decode manager built by :meth:`make_decode_manager` for
    each test and closed after it.
    """

    backend_class: ClassVar[type]
    """The backend under test (a ``StagingManagerMixin`` host)."""

    decode_setup: ClassVar[DecodeSetup] = DecodeSetup()
    """The setup handed to :meth:`make_decode_manager` (override to change sizes)."""

    wait_s: ClassVar[float] = WAIT_S
    """How long a behaviour check waits for the listener thread to act on a message."""

    transfer_geometry: ClassVar[TransferGeometry] = TransferGeometry()
    """Sizes of the transfer checks (rooms of three chunks, a ring they must share)."""

    transfer_rooms: ClassVar[int] = 3
    """Rooms of each transfer check, all in flight at once."""

    transfer_timeout_s: ClassVar[float] = 30.0
    """Bound on each transfer check; rooms still running then fail as timed out."""

    transfer_stall_s: ClassVar[float] = 3.0
    """A transfer check ends early, failing its rooms, when no progress at all is possible:
    decode's staging handler got no message within this many seconds of the start, or every
    write was done this long ago and no arrival reached decode (``run_transfer``'s
    ``stall_s``)."""

    _backend_target: ClassVar[BackendTarget | None] = None
    """Set on the classes ``--staging-backend`` generates: the backend, loaded lazily."""

    # ------------------------------------------------------------------ author's hooks

    def make_decode_manager(self, setup: DecodeSetup) -> LiveDecodeManager:
        """Build a started decode manager of :attr:`backend_class` with staging enabled.

        Override it. The manager must satisfy :class:`LiveDecodeManager`; the simplest body
        builds the backend from ``setup.kv_args`` and returns ``setup.start(manager)``. The kit
        closes the manager after each test.

        The default builds one decode manager with the manager factory named by
        ``--staging-backend MODULE:CLASS=MODULE:FACTORY``, if any, else with the backend's
        standard constructor, ``backend_class(setup.kv_args, role=Role.DECODE,
        attn_tp_size=setup.attn_tp_size)`` (with single-host options for the in-tree
        backends), and returns ``setup.start(manager)``. When that constructor does not fit,
        it skips the test saying why in a test file's subclass, and fails it for a backend
        named by ``--staging-backend`` (skips only for an in-tree backend whose engine is not
        installed).
        """
        make = self._manager_factory(f"this check {NO_FACTORY_MESSAGE}")
        manager = make(setup.kv_args, role=Role.DECODE, attn_tp_size=setup.attn_tp_size)
        return setup.start(manager)

    def make_manager(self, kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> TransferManager:
        """Build one new, unstarted manager of :attr:`backend_class` for the transfer checks.

        Override it when the backend's constructor is not the standard one. The harness calls
        it once per rank, enables staging, wires the managers and starts them, and closes
        each one afterwards. The default uses the ``--staging-backend`` factory or the
        standard constructor, as :meth:`make_decode_manager` does.
        """
        make = self._manager_factory(
            f"the transfer checks need managers: {NO_MANAGER_FACTORY_MESSAGE}"
        )
        return make(kv_args, role=role, attn_tp_size=attn_tp_size)

    def make_hosts(self) -> Iterable[object] | None:
        """Build managers of :attr:`backend_class` the host's own way, for the instance check.

        Override it for a backend whose constructor is a serving stack's own (its arguments,
        its configuration objects): return the managers to check, each as the host builds it
        (a prefill and a decode one, with staging on and off, say). The kit checks each
        against the contract of every enforcing mixin of its class, then closes each that has
        a ``close()``.

        The default returns what the host factory named by ``--staging-backend
        MODULE:CLASS=MODULE:FACTORY`` builds when ``FACTORY()`` takes no arguments (one
        manager, or an iterable of them), else ``None``: the instance check then runs on the
        live decode manager of our staging path, for a ``StagingManagerMixin`` backend.
        """
        target = type(self)._backend_target
        factory = None if target is None else self._load(target, target.load_host_factory)
        if factory is None:
            return None
        built = factory()
        if isinstance(built, Iterable) and not isinstance(built, str | bytes):
            return list(built)
        return [built]

    # ------------------------------------------------------------------ kit internals

    @pytest.fixture(autouse=True)
    def _kit_node(self, request: pytest.FixtureRequest) -> None:
        """Note the running test's node id (to point later reports of one failure at it)."""
        self._kit_nodeid = request.node.nodeid

    def _once(self, key: str, message: str) -> NoReturn:
        """Fail this test with ``message`` the first time ``key`` fails for this class; skip
        later tests of the class that need the same thing, pointing at the first."""
        first = _FIRST_FAILURE.setdefault((type(self), key), self._kit_nodeid)
        if first != self._kit_nodeid:
            pytest.skip(f"{key} failed; reported once, in {first}")
        kit_fail(message)

    def _manager_factory(self, how: str) -> ManagerFactory:
        """The ``--staging-backend`` factory, else the standard constructor; ``how`` says
        what to add when the constructor does not fit."""
        # Outcomes are raised outside the except blocks: pytest would show the caught error
        # too ("During handling of the above exception"), though the text already says it.
        target = type(self)._backend_target
        factory = None if target is None else self._load(target, target.load_factory)
        if factory is not None:
            return factory
        backend = self._backend()
        try:
            return standard_factory(backend)
        except FactoryUnavailable as exc:
            problem = str(exc)
            skip = target is None or isinstance(exc, EngineUnavailable)
        if skip:
            pytest.skip(problem if target is not None else f"{problem}; {how}")
        self._once(
            f"the standard constructor of {class_label(backend)}",
            f"{problem}: the kit cannot build {class_label(backend)}, so it cannot check its "
            f"staged transfer. Name a manager factory: --staging-backend "
            f"{target.class_ref if target else class_label(backend)}=MODULE:FACTORY, where "
            "FACTORY(kv_args, *, role, attn_tp_size) returns a new, unstarted manager (the "
            "same factory demo --backend takes)",
        )

    def _load(self, target: BackendTarget, load: Callable[[], _T]) -> _T:
        """``load()`` of a ``target`` method; its failure is reported once, outside the except
        block."""
        try:
            return load()
        except BackendLoadError as exc:
            problem = str(exc)
        self._once(f"the factory {target.factory_ref}", problem)

    def _builder(self, hook: str) -> str:
        """What the author wrote that builds managers for ``hook``: their override, their
        ``--staging-backend`` factory, or their class's constructor."""
        if getattr(type(self), hook) is not getattr(StagingBackendContract, hook):
            return f"{type(self).__name__}.{hook}"
        target = type(self)._backend_target
        if target is not None and target.factory_ref is not None:
            return f"the factory {target.factory_ref}"
        backend = target.class_qualname if target else getattr(type(self), "backend_class", None)
        name = backend if isinstance(backend, str) else class_label(cast(type, backend))
        return f"the constructor {name}(kv_args, role=..., attn_tp_size=...)"

    def _build(self, hook: str, build: Callable[[], _T]) -> _T:
        """``build()``; a failure is reported once (:meth:`_build_failed`), outside the except
        block (pytest would show the caught error too)."""
        try:
            return build()
        except Exception as exc:  # noqa: BLE001 - reported once, naming the author's builder
            failure = exc
        self._build_failed(hook, failure)

    def _build_failed(self, hook: str, exc: Exception) -> NoReturn:
        """Report, once per class, that building a manager raised ``exc``: the author's
        builder named, the contract's text or the error with the author's frames only."""
        builder = self._builder(hook)
        if isinstance(exc, ContractError):
            message = f"{builder} raised the contract's error:\n{exc}"
        else:
            frames = [
                frame
                for frame in traceback.extract_tb(exc.__traceback__)
                if not Path(frame.filename).resolve().is_relative_to(_KIT_DIR)
            ]
            trace = "".join(traceback.format_list(frames)).rstrip()
            message = f"{builder} raised {type(exc).__name__}: {exc}"
            if trace:
                message = f"{message}\n\n{trace}"
        self._once(builder, message)

    def _contracts(self, cls: type) -> list[Contract]:
        """The contracts ``cls`` is held to: one per enforcing mixin (ours when none)."""
        roots = contract_roots(cls)
        return [root.__dict__["contract"] for root in roots] or [contract_of(cls)]

    def _staging_path_or_skip(self, what: str) -> type:
        """The backend, when it is on our staging path; else skip ``what``, saying why."""
        cls = self._backend()
        if not issubclass(cls, StagingManagerMixin):
            held = ", ".join(
                f"the {c.name} contract of {_qualified(c.mixin)}" if c.mixin else c.name
                for c in self._contracts(cls)
            )
            pytest.skip(
                f"{what} needs the staging path of staging_contracts (StagingManagerMixin); "
                f"{class_label(cls)} is held to {held}, which the class and instance checks "
                "cover"
            )
        return cls

    def _backend(self) -> type:
        target = type(self)._backend_target
        if target is not None:
            try:
                return target.load_class()
            except BackendLoadError as exc:
                kit_fail(str(exc))
        backend = getattr(type(self), "backend_class", None)
        if not isinstance(backend, type):
            self._once(
                "naming the backend (backend_class)",
                f"{type(self).__name__} sets no backend_class: add 'backend_class = "
                "MyKVManager' to the class body",
            )
        return backend

    @pytest.fixture
    def staging_live(self) -> Iterator[LiveDecode]:
        """A live decode manager of the backend, with the kit's peers; closed afterwards."""
        backend = self._staging_path_or_skip("this check")
        manager = self._build(
            "make_decode_manager", lambda: self.make_decode_manager(self.decode_setup)
        )
        try:
            if not isinstance(manager, backend):
                self._once(
                    f"{self._builder('make_decode_manager')} (its type)",
                    f"{self._builder('make_decode_manager')} returned "
                    f"{_a(type(manager).__name__)}, not an instance of {backend.__name__}",
                )
            live = LiveDecode(manager, wait_s=self.wait_s)
        except BaseException:
            _close(manager)  # whatever it returned, it is not left open
            raise
        try:
            yield live
        finally:
            live.close()

    # ------------------------------------------------------------------ class checks

    def test_class_satisfies_the_contract(self, request: pytest.FixtureRequest) -> None:
        """The backend uses an enforcing mixin and declares every member of its contract (a
        witness it states names it; one it lacks is recommended at the end of the run)."""
        cls = self._backend()
        contracts = self._contracts(cls)
        explanation = "\n\n".join(contract.explain(cls) for contract in contracts)
        if not contract_roots(cls):
            kit_fail(
                f"{class_label(cls)} uses no enforcing mixin: list StagingManagerMixin (or your "
                "stack's own ContractMixin subclass) first in the bases, e.g. 'class "
                f"{cls.__name__}(StagingManagerMixin, CommonKVManager)'.\n\n{explanation}"
            )
        if is_abstract(cls):
            kit_fail(
                f"{class_label(cls)} was created with abstract=True: the kit checks concrete "
                f"backends; name a subclass that satisfies the contract.\n\n{explanation}"
            )
        for contract in contracts:
            report = contract.inspect_class(cls)
            if report.problems:
                kit_fail(f"{contract.class_error(report)}\n\n{explanation}")
        note = witness_note(cls, [contract.protocol for contract in contracts])
        if note is not None:
            notes = request.config.stash.setdefault(WITNESS_NOTES, {})
            notes[f"{cls.__module__}.{cls.__qualname__}"] = f"{note} ({WITNESS_GUIDE})"

    def test_explanation_covers_every_member(self, request: pytest.FixtureRequest) -> None:
        """Each contract's explanation lists every member and its verdict is 'conforms'."""
        cls = self._backend()
        for contract in self._contracts(cls):
            explanation = contract.explain(cls)
            if isinstance(request.node, pytest.Item):
                request.node.add_report_section("call", f"{contract.name} contract", explanation)
            rows = explanation.splitlines()
            unlisted = [
                member.name
                for member in contract.members
                if not any(row.startswith(f"{member.name} ") for row in rows)
            ]
            if unlisted:
                kit_fail(f"the explanation does not list {unlisted!r}:\n{explanation}")
            if not rows[-1].startswith("verdict: conforms"):
                kit_fail(f"the explanation's verdict is not 'conforms':\n{explanation}")

    def test_mixin_logs_under_the_backend_module(self) -> None:
        """The mixin's logger for the backend is the logger of the backend's own module."""
        cls = self._staging_path_or_skip("this check of StagingManagerMixin's logger")
        logger = getattr(cls, "_staging_logger", None)
        if not isinstance(logger, logging.Logger) or logger.name != cls.__module__:
            name = logger.name if isinstance(logger, logging.Logger) else repr(logger)
            kit_fail(
                f"{class_label(cls)}._staging_logger is {name}, expected the logger "
                f"{cls.__module__!r} (StagingManagerMixin sets it at class creation)"
            )

    # ------------------------------------------------------------------ instance checks

    @pytest.fixture
    def kit_hosts(self, request: pytest.FixtureRequest) -> Iterator[list[object]]:
        """The managers the instance check runs on: those :meth:`make_hosts` builds the host's
        way (closed afterwards), else the live decode manager of our staging path."""
        hosts = self._build("make_hosts", self.make_hosts)
        if hosts is None:
            self._staging_path_or_skip(
                "without a host factory (make_hosts, or --staging-backend "
                "MODULE:CLASS=MODULE:FACTORY with FACTORY() building managers the host's way), "
                "the instance check"
            )
            live: LiveDecode = request.getfixturevalue("staging_live")
            yield [live.manager]
            return
        owned = list(hosts)
        try:
            yield owned
        finally:
            for host in owned:
                _close(host)

    def test_instance_satisfies_the_contract(self, kit_hosts: list[object]) -> None:
        """Every manager built the host's way (or the live decode manager of our staging
        path) holds a value of the declared type in every member of its contract."""
        backend = self._backend()
        if not kit_hosts:
            kit_fail(f"{self._builder('make_hosts')} built no manager to check")
        problems = []
        for index, host in enumerate(kit_hosts):
            if not isinstance(host, backend):
                problems.append(
                    f"manager {index} is {_a(type(host).__name__)}, not an instance of "
                    f"{backend.__name__}"
                )
                continue
            for contract in self._contracts(type(host)):
                try:
                    contract.check_instance(host)
                except ContractError as exc:
                    problems.append(str(exc) if len(kit_hosts) == 1 else f"manager {index}: {exc}")
        if problems:
            kit_fail("\n\n".join(problems))

    def test_attach_rejects_a_handler_that_breaks_the_contract(
        self, staging_live: LiveDecode
    ) -> None:
        """attach_staging_handler refuses an object that is not a StagingHandler."""
        manager = staging_live.manager
        not_a_handler = cast(StagingHandler, object())
        with pytest.raises(ContractError, match=r"^\w+ instance does not satisfy the StagingHost"):
            manager.attach_staging_handler(not_a_handler)
        if manager._staging_handler is not staging_live.handler:
            kit_fail("a refused handler replaced the attached one")

    # ------------------------------------------------------------------ behaviour

    def test_unknown_room_staging_req_is_dropped_and_counted(
        self, staging_live: LiveDecode
    ) -> None:
        """A STAGING_REQ from the listener for a room decode never registered is dropped."""
        manager = staging_live.manager
        before = manager.staging_stats()
        staging_live.send(StagingReq(_UNKNOWN_ROOM, 0, 1, staging_live.session_id).to_frames())
        _expect_counts(staging_live, before, {"received": 1, "dropped": 1}, via_listener=True)
        if staging_live.handler.poll_room(_UNKNOWN_ROOM) is not None:
            kit_fail("a STAGING_REQ for an unknown room created the room")

    def test_messages_before_attach_are_dropped_and_counted(self, staging_live: LiveDecode) -> None:
        """Without an attached handler, STAGING_REQ and CHUNK_READY are dropped and counted."""
        manager = staging_live.manager
        sid = staging_live.session_id
        before = manager.staging_stats()
        manager.detach_staging_handler()
        try:
            req = manager._handle_staging_req(
                StagingReq(_ROOM_BEFORE_ATTACH, 0, 1, sid).to_frames()
            )
            ready = manager._handle_chunk_ready(
                ChunkReady(_ROOM_BEFORE_ATTACH, 0, 0, 1, sid, writer_rank=0).to_frames()
            )
        finally:
            manager.attach_staging_handler(staging_live.handler)
        if (req, ready) != (None, None):
            kit_fail(f"with no handler attached the mixin returned {req!r} and {ready!r}")
        _expect_counts(staging_live, before, {"received": 2, "dropped": 2}, via_listener=False)

    def test_oversized_chunk_is_answered_with_offset_minus_two(
        self, staging_live: LiveDecode
    ) -> None:
        """A chunk larger than the ring is answered with offset -2 and fails its room."""
        prefill_tp = staging_live.decode_tp
        pages = staging_live.pool_pages
        size = staging_live.region_bytes(prefill_tp, pages)
        if size <= staging_live.ring_bytes:
            kit_fail(
                f"a chunk of the whole KV pool ({pages} pages, {size} bytes) fits the "
                f"{staging_live.ring_bytes}-byte ring, so no chunk can be oversized; give the "
                "decode manager a smaller ring (DecodeSetup's defaults do)"
            )
        peer = staging_live.prefill_peer()
        staging_live.register(_ROOM_OVERSIZED, range(pages), pages, prefill_tp, [peer])
        before = staging_live.manager.staging_stats()
        staging_live.send(
            StagingReq(_ROOM_OVERSIZED, 0, pages, staging_live.session_id).to_frames()
        )
        answers = peer.answers(1)
        if len(answers) != 1:
            kit_fail(
                "the prefill peer got no STAGING_RSP for an oversized chunk "
                f"({staging_live.listener_hint})"
            )
        (answer,) = answers
        if (answer.offset, answer.round, answer.end) != (ALLOC_OVERSIZED, 0, -1):
            kit_fail(f"an oversized chunk was answered with {answer}, expected offset -2")
        _expect_counts(staging_live, before, {"received": 1, "oversized": 1}, via_listener=True)
        status = staging_live.handler.poll_room(_ROOM_OVERSIZED)
        if status is not RoomStatus.FAILED:
            kit_fail(f"the room of an oversized chunk is {status}, expected FAILED")

    def test_chunk_writers_share_one_region(self, staging_live: LiveDecode) -> None:
        """Every writer of a chunk is answered the same ring region; the last arrival frees it."""
        manager = staging_live.manager
        prefill_tp = staging_live.multi_writer_prefill_tp()
        writers = staging_live.writers(prefill_tp)
        if staging_live.region_bytes(prefill_tp, 1) > staging_live.ring_bytes:
            kit_fail(f"a one-page chunk does not fit the {staging_live.ring_bytes}-byte ring")
        peers = [staging_live.prefill_peer() for _ in writers]
        staging_live.register(_ROOM_SHARED, [0], 1, prefill_tp, peers)
        before = manager.staging_stats()
        request = StagingReq(_ROOM_SHARED, 0, 1, staging_live.session_id).to_frames()
        for _ in writers:
            staging_live.send(request)
        answers = [answer for peer in peers for answer in peer.answers(len(writers))]
        if len(answers) != len(writers) ** 2:
            kit_fail(
                f"{len(writers)} writers asked for a region; their peers got {len(answers)} "
                f"answers, expected {len(writers) ** 2}: each request answers every writer "
                f"({staging_live.listener_hint})"
            )
        regions = {(a.offset, a.round, a.end) for a in answers}
        if len(regions) != 1 or min(a.offset for a in answers) < 0:
            kit_fail(f"the writers of one chunk were answered different regions: {regions}")
        _expect_counts(
            staging_live, before, {"received": len(writers), "allocated": 1}, via_listener=True
        )
        outcomes = [
            manager._handle_chunk_ready(
                ChunkReady(_ROOM_SHARED, 0, 0, 1, staging_live.session_id, rank).to_frames()
            )
            for rank in writers
        ]
        expected = [ArrivalOutcome.WAITING] * (len(writers) - 1) + [ArrivalOutcome.COMPLETE]
        if outcomes != expected:
            kit_fail(f"the writers' arrivals gave {outcomes}, expected {expected}")
        staging_live.wait_for(
            lambda: staging_live.handler.poll_room(_ROOM_SHARED) is RoomStatus.SUCCESS,
            "the room did not succeed after every writer arrived",
        )
        if staging_live.context.allocator.live_count != 0:
            kit_fail("the chunk's region was not freed after every writer arrived")

    def test_malformed_frames_raise_and_are_counted(self, staging_live: LiveDecode) -> None:
        """Frames that are not the expected message raise MalformedMessage and are counted."""
        manager = staging_live.manager
        sid = staging_live.session_id
        req = StagingReq(_UNKNOWN_ROOM, 0, 1, sid).to_frames()
        ready = ChunkReady(_UNKNOWN_ROOM, 0, 0, 1, sid).to_frames()
        before = manager.staging_stats()
        cases = [
            (manager._handle_staging_req, [], r"^frame 0 \('type'\): missing"),
            (manager._handle_staging_req, req[:2], r"^STAGING_REQ frame 2 \('chunk_idx'\)"),
            (manager._handle_staging_req, [req[0], b"+5", *req[2:]], r"^STAGING_REQ frame 1 "),
            (manager._handle_staging_req, ready, r"^frame 0 \('type'\): expected STAGING_REQ"),
            (manager._handle_chunk_ready, ready[:3], r"^CHUNK_READY frame 3 \('page_start'\)"),
            (manager._handle_chunk_ready, req, r"^frame 0 \('type'\): expected CHUNK_READY"),
        ]
        for entry, frames, pattern in cases:
            with pytest.raises(MalformedMessage, match=pattern):
                entry(frames)
        counts = {"received": len(cases), "malformed": len(cases)}
        _expect_counts(staging_live, before, counts, via_listener=False)

    def test_drop_warning_is_logged_under_the_backend_logger(
        self, staging_live: LiveDecode, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The warning for a dropped message is a record of the backend module's logger."""
        manager = staging_live.manager
        name = type(manager).__module__
        frames = StagingReq(_ROOM_BEFORE_ATTACH, 0, 1, staging_live.session_id).to_frames()
        with caplog.at_level(logging.WARNING):
            manager.detach_staging_handler()
            try:
                manager._handle_staging_req(frames)
            finally:
                manager.attach_staging_handler(staging_live.handler)
        drops = [r for r in caplog.records if "no staging handler attached" in r.getMessage()]
        if [r.name for r in drops] != [name]:
            kit_fail(
                f"the drop warning was logged by {[r.name for r in drops]!r}, expected one "
                f"record of the backend's logger {name!r}"
            )

    # ------------------------------------------------------------------ a whole transfer

    @pytest.mark.parametrize(
        ("prefill_tp", "decode_tp"), TRANSFER_SHAPES, ids=[f"P{p}-D{d}" for p, d in TRANSFER_SHAPES]
    )
    def test_staged_transfer_delivers_every_page(self, prefill_tp: int, decode_tp: int) -> None:
        """Several multi-chunk rooms staged from prefill to decode land bit for bit.

        Runs :func:`~staging_contracts.testing.run_transfer` with managers from
        :meth:`make_manager`; on failure, the message names the likely cause (the listener's
        idle hook, the message routing, ...) and lists each failed room with its reason.
        """
        backend = self._staging_path_or_skip("the staged transfer check")
        failures: list[Exception] = []

        def make(kv_args: KVArgs, *, role: Role, attn_tp_size: int) -> TransferManager:
            try:
                return self.make_manager(kv_args, role=role, attn_tp_size=attn_tp_size)
            except Exception as exc:
                failures.append(exc)
                raise

        report = None
        try:
            with _Duplicates():
                report = run_transfer(
                    make,
                    prefill_tp=prefill_tp,
                    decode_tp=decode_tp,
                    rooms=self.transfer_rooms,
                    geometry=self.transfer_geometry,
                    timeout_s=self.transfer_timeout_s,
                    stall_s=self.transfer_stall_s,
                )
        except Exception as exc:
            if not failures or exc is not failures[0]:
                raise
        if report is None:
            self._build_failed("make_manager", failures[0])
        if not report.ok:
            kit_fail(
                f"the staged transfer from prefill TP {prefill_tp} to decode TP {decode_tp} "
                f"through {class_label(backend)} failed: {report.diagnosis()}"
            )


def _qualified(cls: type | None) -> str:
    return "?" if cls is None else f"{cls.__module__}.{class_label(cls)}"


def _close(obj: object) -> None:
    """Close ``obj`` when it has a ``close()``."""
    close = getattr(obj, "close", None)
    if callable(close):
        close()


def _a(noun: str) -> str:
    """``a Foo`` / ``an int``."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


class _Duplicates(logging.Filter):
    """While a transfer check runs, drops the log records that only repeat what its failure
    message says: the harness's summary, and each rank's note that a room failed because the
    harness ended the run. Each failed room is then printed once, in the failure."""

    _LOGGERS = (
        "staging_contracts.testing._harness",
        "staging_contracts._decode.handler",
        "staging_contracts.backends._kv_requests",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == self._LOGGERS[0]:
            return record.levelno < logging.WARNING
        return HARNESS_ENDED not in record.getMessage()

    def __enter__(self) -> None:
        for name in self._LOGGERS:
            logging.getLogger(name).addFilter(self)

    def __exit__(self, *exc_info: object) -> None:
        for name in self._LOGGERS:
            logging.getLogger(name).removeFilter(self)


def _expect_counts(
    live: LiveDecode, before: StagingStats, expected: dict[str, int], *, via_listener: bool
) -> None:
    """Wait until the counters grew by exactly ``expected`` (others unchanged), else fail.

    Waits because the listener thread counts a message after handling it, so its answer to a
    prefill peer may arrive before the count does.
    """
    want = {field: expected.get(field, 0) for field in StagingStats.__dataclass_fields__}
    hint = f" ({live.listener_hint})" if via_listener else ""

    def grown() -> dict[str, int]:
        after = live.manager.staging_stats()
        return {field: getattr(after, field) - getattr(before, field) for field in want}

    def failure() -> str:
        changed = {name: value for name, value in grown().items() if value}
        return f"staging_stats() changed by {changed}, expected {expected}{hint}"

    live.wait_until(lambda: grown() == want, failure)
