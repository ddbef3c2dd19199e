"""Command line: ``staging-contracts check | demo | soak | bench``.

The CLI is the only place in the package that prints. Bad input is answered at once, in one
line that names the option and the rule, with exit status 2; an error inside a command is one
line too (exit 1; exit 3 for ``check``, whose 1 means "does not conform"), and its traceback
is shown only with ``--debug`` (or ``STAGING_CONTRACTS_DEBUG=1``), for bug reports.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from ._cluster import logformat
from ._cluster.summary_json import (
    CheckRecord,
    check_summary,
    check_target,
    package_version,
    write_summary,
)
from ._contract.contract import Contract, is_abstract
from ._contract.enforcement import contract_roots
from ._contract.typeforms import class_label
from ._contract.witness import witness_note
from ._run import Interrupted, exit_status, stop_on_signals
from .mixin import STAGING_CONTRACT
from .testing._notes import WITNESS_GUIDE

__all__ = ["main"]

EXIT_OK = 0
EXIT_NONCONFORMING = 1
EXIT_UNIMPORTABLE = 2
EXIT_USAGE = 2
EXIT_INTERNAL = 3
"""``check`` itself failed (a bug, or a class whose inspection raised): no verdict."""
DEBUG_ENV = "STAGING_CONTRACTS_DEBUG"
"""Set to 1 to show tracebacks, as ``--debug`` does."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``PROG: MESSAGE (see PROG --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    ``SIGTERM`` or ``SIGINT`` before a command's run has its own handlers (while the heavy
    modules load, during the preflight checks; ``check`` throughout) ends it with one
    ``PARTIAL`` line and ``128 + N``. Once a run began, the run takes the first signal and
    every later one is ignored until the command ends, so that its summary and ``--json``
    file are written whole (``SIGINT`` does not raise ``KeyboardInterrupt`` anywhere here).
    """
    words = list(sys.argv[1:] if argv is None else argv)
    command = next((w for w in words if w in _COMMANDS), None)
    try:
        with stop_on_signals(raise_on_signal=True):
            return _main(words, command)
    except Interrupted as stop:
        name, what = signal.Signals(stop.signum).name, command or "the command"
        print(f"PARTIAL: interrupted by {name} before {what} had anything to report")
        return exit_status(name)


def _main(words: list[str], command: str | None) -> int:
    parser = _parser(command)
    args = parser.parse_args(words)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # seen by _debug() and by rank processes
    debug = _debug()
    try:
        fmt = args.log_format or logformat.log_format()
    except ValueError as exc:
        print(f"staging-contracts: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with logformat.installed(fmt=fmt):
            status: int = args.run(args)
    except Exception as exc:  # noqa: BLE001 - one line for the user; --debug shows the rest
        if debug:
            traceback.print_exc()
        print(
            f"staging-contracts {args.command}: {type(exc).__name__}: {exc}"
            + ("" if debug else " (run with --debug for the traceback)"),
            file=sys.stderr,
        )
        return EXIT_INTERNAL if args.run is _run_check else EXIT_NONCONFORMING
    return status


def _debug() -> bool:
    """Whether tracebacks are shown (``--debug`` or ``STAGING_CONTRACTS_DEBUG``)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _command(
    commands: argparse._SubParsersAction[_Parser],
    name: str,
    help: str,
    description: str,
    *examples: str,
    aliases: Sequence[str] = (),
) -> _Parser:
    """A command's parser: its ``--help`` keeps the description's lines and ends with the
    examples."""
    epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples) if examples else None
    return commands.add_parser(
        name,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help=help,
        aliases=aliases,
    )


_COMMANDS = ("check", "explain", "demo", "soak", "bench")


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s options are built (the others' imports are heavy: torch
    for ``demo`` and ``soak``), none of them when ``command`` is ``None`` (the top-level
    ``--help`` lists the commands only, and imports nothing heavy)."""
    parser = _Parser(
        prog="staging-contracts",
        description="Typed staging path for PD-disaggregated LLM serving.",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help=f"show the traceback of an error (or set {DEBUG_ENV}=1)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    _add_log_format(parser, default=None)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    check = _command(
        commands,
        "check",
        "explain how classes satisfy the contract of their enforcing mixin (alias: explain)",
        "Import each MODULE:CLASS and print how it satisfies the contract of every enforcing "
        "mixin it uses (the StagingHost contract when it uses none), or of the mixin named by "
        "--mixin. Exit 0 if none has a problem these checks can see (each verdict says what was "
        "not verified, such as types the class does not declare), 1 if any has one, 2 if a "
        "name cannot be imported (importing it raised, or it is not a class), 3 if the check "
        "itself failed.",
        "staging-contracts check staging_contracts.backends.nixl:NixlKVManager",
        "staging-contracts check mypkg.backends:AcmeKVManager mypkg.backends:OtherKVManager",
        "staging-contracts check mypkg.hosts:CacheHost --mixin mypkg.mixins:CacheMixin",
        aliases=["explain"],
    )
    check.add_argument("targets", nargs="+", metavar="MODULE:CLASS")
    check.add_argument(
        "--mixin",
        metavar="MODULE:MIXIN",
        help="check against the contract of this ContractMixin instead (any enforcing mixin)",
    )
    check.add_argument(
        "--json", metavar="PATH", help="also write the verdicts to PATH as JSON (schema 1)"
    )
    check.set_defaults(run=_run_check)

    demo = _command(
        commands,
        "demo",
        "run a verified heterogeneous-TP staged transfer across processes",
        "Fill each prefill rank's KV pool with seeded data, stage R requests into the decode "
        "ranks through the chosen engine, and verify every decode page. Exit 0 only when every "
        "page verified. Options the layout, the engine or this machine's memory cannot serve "
        "are refused before any process starts, as is a bad STAGING_CONTRACTS_* variable. "
        "Prefill's chunk bounds take their variables, else the demo's own (deadline 60 s); the "
        "ring is sized by the demo (4 regions of the largest chunk): "
        "STAGING_CONTRACTS_RING_BYTES is ignored, with a warning.",
        "staging-contracts demo",
        "staging-contracts demo --backend mooncake --prefill-tp 2 --decode-tp 4",
        "staging-contracts demo --tokens 8192 --requests 8 --chunk-tokens 1024",
    )
    if command == "demo":
        _add_demo(demo)
    demo.set_defaults(run=_run_demo)

    soak = _command(
        commands,
        "soak",
        "run the multi-process transfer continuously while injecting faults",
        "Keep rooms moving from P prefill to D decode rank processes while injecting the listed "
        "faults in turn; verify every completed room bit for bit; print a summary: rooms "
        "succeeded and failed by reason, corrupt and hung rooms, time to detect each kill, ring "
        "use at the end, listener restarts.",
    )
    if command == "soak":
        from ._cluster.metrics_relay import add_metrics_port_argument  # noqa: PLC0415
        from ._cluster.soak_report import SOAK_EPILOG, add_soak_arguments  # noqa: PLC0415

        soak.epilog = SOAK_EPILOG
        add_soak_arguments(soak)
        _add_outputs(soak)
        add_metrics_port_argument(soak)
    soak.set_defaults(run=_run_soak)

    groups: Sequence[str] = ("...",)
    if command == "bench":
        from ._bench import GROUPS  # noqa: PLC0415 - keeps `check` free of benchmark imports

        groups = tuple(GROUPS)
    bench = _command(
        commands,
        "bench",
        "run benchmarks against anchors measured in the same run",
        f"Groups: {', '.join(groups)} (default: all). `bench scaling` (on its own) sweeps "
        "request length, TP pairs, page size and concurrency per engine, writes scaling.json "
        "and scaling.csv under --out, and charts under --plot.",
        "staging-contracts bench",
        "staging-contracts bench contract staging --json rows.json",
        "staging-contracts bench control --quick",
        "staging-contracts bench scaling --out results --plot charts",
    )
    bench.add_argument("groups", nargs="*", metavar="GROUP", help=", ".join(groups))
    bench.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list")
    bench.add_argument(
        "--out",
        metavar="DIR",
        help="bench scaling: where to write scaling.json and scaling.csv (default: .)",
    )
    bench.add_argument(
        "--plot",
        metavar="DIR",
        help="bench scaling: also draw PNG charts into DIR (needs the 'plot' extra)",
    )
    bench.add_argument(
        "--quick", action="store_true", help="fewer repetitions (for smoke tests, not figures)"
    )
    bench.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where KV pools and staging buffers live (cuda needs a GPU; default cpu)",
    )
    bench.add_argument(
        "--backend",
        action="append",
        dest="backends",
        metavar="BACKEND",
        help="a backend of the transfer group: a name, MODULE:CLASS or "
        "MODULE:CLASS=MODULE:FACTORY (repeatable; default: every in-tree engine)",
    )
    bench.set_defaults(run=_run_bench)
    return parser


def _add_log_format(parser: argparse.ArgumentParser, default: str | None) -> None:
    parser.add_argument(
        "--log-format",
        choices=logformat.LOG_FORMATS,
        default=default,
        help=f"log lines of every process as text (default) or one JSON object each (or set "
        f"{logformat.LOG_FORMAT_ENV})",
    )


def _add_outputs(parser: argparse.ArgumentParser) -> None:
    """``--json PATH`` and ``--log-format`` of a command that runs processes."""
    parser.add_argument(
        "--json", metavar="PATH", help="also write the summary to PATH as JSON (schema 1)"
    )
    _add_log_format(parser, default=argparse.SUPPRESS)


def _add_demo(demo: argparse.ArgumentParser) -> None:
    from ._cluster.demo import add_demo_arguments  # noqa: PLC0415 - torch: only for `demo`
    from ._cluster.metrics_relay import add_metrics_port_argument  # noqa: PLC0415

    add_demo_arguments(demo)
    _add_outputs(demo)
    add_metrics_port_argument(demo)
    demo.add_argument(
        "--ignore-memory",
        action="store_true",
        help="start even when the pools, rings and buffers exceed the memory available",
    )


def _local_modules_importable() -> None:
    """Put the working directory first on ``sys.path``, as ``python -m`` does, so that a
    ``MODULE:CLASS`` given on the command line may name a local module (rank processes
    started by spawn inherit the path)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def _run_check(args: argparse.Namespace) -> int:
    _local_modules_importable()
    forced: Contract | None = None
    if args.mixin is not None:
        mixin = _load_class(args.mixin)
        if isinstance(mixin, int):
            return mixin
        if mixin not in contract_roots(mixin):
            print(
                f"{args.mixin}: {class_label(mixin)} is not an enforcing mixin (a ContractMixin "
                "subclass defined with contract=...)",
                file=sys.stderr,
            )
            return EXIT_UNIMPORTABLE
        forced = mixin.__dict__["contract"]
    if args.json:
        try:
            check_target(args.json)
        except ValueError as exc:
            print(f"staging-contracts check: {exc}", file=sys.stderr)
            return EXIT_USAGE
    status = EXIT_OK
    records: list[CheckRecord] = []
    for target in args.targets:
        records.append(CheckRecord(target))
        records[-1].exit_status = _check_one(target, forced, records[-1])
        status = max(status, records[-1].exit_status)
        print()
    if args.json:
        print(f"wrote the verdicts to {write_summary(check_summary(records, status), args.json)}")
    return status


def _load_class(target: str) -> type | int:
    """Import ``MODULE:CLASS``; the class, or the exit status after saying why not."""
    from .backends._refs import (  # noqa: PLC0415 - the backends only when a class is named
        AttributeMissing,
        ModuleMissing,
        ModuleRaised,
        ModuleRejected,
        import_ref,
        split_ref,
    )

    ref = split_ref(target)
    if ref is None:
        print(f"{target}: expected MODULE:CLASS", file=sys.stderr)
        return EXIT_UNIMPORTABLE
    module_name, qualname = ref.module, ref.qualname
    try:
        obj = import_ref(ref)
    except ModuleRejected as failure:
        print(f"{target}: the contract rejected a class while importing {module_name!r}:")
        print(failure.error)
        return EXIT_NONCONFORMING
    except ModuleMissing as failure:
        print(f"{target}: cannot import {module_name!r}: {failure.error}", file=sys.stderr)
        return EXIT_UNIMPORTABLE
    except ModuleRaised as failure:
        exc = failure.error
        trace = "".join(traceback.format_exception(exc)).rstrip() if _debug() else ""
        hint = f"\n{trace}" if trace else " (run with --debug for the traceback)"
        print(
            f"{target}: importing {module_name!r} raised {type(exc).__name__}: {exc}{hint}",
            file=sys.stderr,
        )
        return EXIT_UNIMPORTABLE
    except AttributeMissing:
        print(f"{target}: {module_name!r} has no attribute {qualname!r}", file=sys.stderr)
        return EXIT_UNIMPORTABLE
    if not isinstance(obj, type):
        print(f"{target}: {qualname!r} is not a class", file=sys.stderr)
        return EXIT_UNIMPORTABLE
    return obj


def _check_one(target: str, forced: Contract | None, record: CheckRecord) -> int:
    obj = _load_class(target)
    if isinstance(obj, int):
        return obj
    if forced is not None:
        contracts = [forced]
    else:
        contracts = [root.__dict__["contract"] for root in contract_roots(obj)]
    if not contracts:
        print(
            f"{target} does not use an enforcing mixin; against the StagingHost contract of "
            "staging_contracts.StagingManagerMixin:"
        )
        contracts = [STAGING_CONTRACT]
    status = EXIT_OK
    for contract in contracts:
        print(contract.explain(obj))
        report = contract.inspect_class(obj, abstract=is_abstract(obj))
        error = None if report.conforms else contract.class_error(report)
        if error is not None:
            print(error)
            status = EXIT_NONCONFORMING
        name = class_label(contract.protocol)
        problem = None if error is None else str(error)
        record.contracts.append({"protocol": name, "conforms": error is None, "error": problem})
    for note in (_hook_note(obj, target), _witness_note(obj, contracts)):
        if note is not None:
            print(note)
            record.notes.append(note)
    return status


def _witness_note(cls: type, contracts: Sequence[Contract]) -> str | None:
    """A note (not a failure) when a concrete host states no witness for a contract it is
    held to: the line that would make every type checker report it at its class."""
    if is_abstract(cls):
        return None
    held = [c.protocol for c in contracts if c.mixin is not None and c.mixin in cls.__mro__]
    note = witness_note(cls, held)
    return None if note is None else f"{note} ({WITNESS_GUIDE})"


def _hook_note(cls: type, target: str) -> str | None:
    """A note (not a failure) when a concrete staging backend on ``CommonKVManager`` keeps
    its base's listener hooks: staging messages and arrivals would never reach the mixin,
    which no class contract can see; the kit's transfer check shows it."""
    from .mixin import StagingManagerMixin  # noqa: PLC0415

    if not issubclass(cls, StagingManagerMixin) or is_abstract(cls):
        return None
    # a subclass of CommonKVManager has imported it; importing it here would load pyzmq
    common = sys.modules.get("staging_contracts.backends._common")
    base = getattr(common, "CommonKVManager", None)
    if not isinstance(base, type) or not issubclass(cls, base):
        return None
    kept = [
        f"{hook} ({why})"
        for hook, why in (
            ("_on_message", "staging messages are not handed to self._dispatch_staging"),
            ("_on_idle", "staging_idle(self) is not called"),
        )
        if getattr(cls, hook) is getattr(base, hook)
    ]
    if not kept:
        return None
    return (
        f"note: {class_label(cls)} keeps CommonKVManager's {' and '.join(kept)}; the contract "
        "does not cover the listener hooks, so it conforms all the same. Check that staging "
        f"traffic flows with the kit's transfer check: pytest --staging-backend {target} "
        "(docs/writing-a-backend.md, step 5)"
    )


def _run_demo(args: argparse.Namespace) -> int:
    from ._cluster.demo import (  # noqa: PLC0415 - heavy imports
        config_from_args,
        placement_from_args,
        run_demo,
    )
    from ._cluster.metrics_relay import check_metrics_available  # noqa: PLC0415
    from ._cluster.preflight import ignored_variables, preflight  # noqa: PLC0415 - heavy imports
    from .config import RING_BYTES  # noqa: PLC0415

    _local_modules_importable()
    try:
        config = config_from_args(args)
        placement = placement_from_args(args)
        preflight(config, ignore_memory=args.ignore_memory)
        if args.json:
            check_target(args.json)
        if args.metrics_port is not None:
            check_metrics_available()
    except ValueError as exc:  # a ConfigError (a bad variable) is one too
        print(f"staging-contracts demo: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for warning in ignored_variables({RING_BYTES: _RING_FIXED}):
        _progress(f"staging-contracts demo: {warning}", logging.WARNING)
    return run_demo(
        config, placement=placement, json_path=args.json, metrics_port=args.metrics_port
    )


def _run_soak(args: argparse.Namespace) -> int:
    from ._cluster.metrics_relay import check_metrics_available  # noqa: PLC0415
    from ._cluster.preflight import check_backend, ignored_variables  # noqa: PLC0415
    from ._cluster.soak import run_soak  # noqa: PLC0415 - heavy imports
    from ._cluster.soak_report import config_from_args, format_summary  # noqa: PLC0415
    from ._cluster.summary_json import soak_summary  # noqa: PLC0415
    from ._control.security import SecurityError  # noqa: PLC0415
    from .config import INTEGRITY, RING_BYTES, Setting  # noqa: PLC0415

    _local_modules_importable()
    try:
        config = config_from_args(args)  # checks every variable first (check_environment)
        check_backend(config.backend)
        if args.json:
            check_target(args.json)
        if args.metrics_port is not None:
            check_metrics_available()
    except ValueError as exc:  # a ConfigError (a bad variable) is one too
        print(f"staging-contracts soak: {exc}", file=sys.stderr)
        return EXIT_USAGE
    fixed: dict[Setting[Any], str] = {RING_BYTES: _RING_FIXED}
    if config.integrity:
        fixed[INTEGRITY] = "the pause and forge faults need the integrity check on"
    for warning in ignored_variables(fixed):
        _progress(f"staging-contracts soak: {warning}", logging.WARNING)
    _progress(
        f"soak over {config.backend}: {config.prefill_instances} x {config.prefill_tp} prefill "
        f"-> {config.decode_tp} decode ranks, {config.duration_s:g} s, "
        f"faults: {', '.join(config.faults) or 'none'}"
    )
    try:
        result = run_soak(config, progress=_progress, metrics_port=args.metrics_port)
    except (ImportError, SecurityError) as exc:
        print(f"staging-contracts soak: {exc}", file=sys.stderr)
        return EXIT_UNIMPORTABLE
    except RuntimeError as exc:  # the ranks did not start; they are stopped already
        print(f"staging-contracts soak: {exc}", file=sys.stderr)
        return EXIT_NONCONFORMING
    print(format_summary(result))
    if args.json:
        print(f"wrote the summary to {write_summary(soak_summary(result), args.json)}")
    if result.interrupted is not None:
        return exit_status(result.interrupted)
    return EXIT_OK if result.ok else EXIT_NONCONFORMING


def _run_bench(args: argparse.Namespace) -> int:
    from ._bench import (  # noqa: PLC0415 - heavy
        GROUPS,
        BenchOptions,
        format_table,
        run_groups,
        write_json,
    )

    if "scaling" in args.groups:
        return _run_scaling(args)
    if args.out is not None or args.plot is not None:
        print("staging-contracts bench: --out and --plot are for bench scaling", file=sys.stderr)
        return EXIT_USAGE
    unknown = [group for group in args.groups if group not in GROUPS]
    if unknown:
        print(
            f"staging-contracts bench: unknown group {unknown[0]!r}: choose from "
            f"{', '.join(GROUPS)}",
            file=sys.stderr,
        )
        return EXIT_USAGE

    if args.device == "cuda" and not _cuda_available():
        print("staging-contracts bench: --device cuda: no CUDA device here", file=sys.stderr)
        return EXIT_USAGE
    backends = tuple(args.backends) if args.backends else None
    if backends:
        from ._cluster.preflight import check_backend  # noqa: PLC0415 - heavy imports

        _local_modules_importable()
        try:
            for spec in backends:
                check_backend(spec)
        except ValueError as exc:
            print(f"staging-contracts bench: {exc}", file=sys.stderr)
            return EXIT_USAGE
    options = BenchOptions(quick=args.quick, device=args.device, backends=backends)
    with stop_on_signals(raise_on_signal=True) as stop:  # a stop keeps the ended groups' rows
        rows = run_groups(args.groups or None, options, progress=_progress)
    print(format_table(rows))
    if args.json:
        write_json(rows, args.json)
        print(f"wrote {len(rows)} rows to {args.json}")
    if stop.name is not None:
        print(f"PARTIAL: interrupted by {stop.name}: the rows of the groups that ended before it")
        return exit_status(stop.name)
    return EXIT_OK


def _run_scaling(args: argparse.Namespace) -> int:
    """``bench scaling``: the sweep, its table and slopes, its files (not a row group)."""
    from ._bench import BenchOptions  # noqa: PLC0415 - heavy
    from ._bench.plots import matplotlib_missing, write_plots  # noqa: PLC0415
    from ._bench.scaling import run_scaling  # noqa: PLC0415

    refusal = None
    if args.groups != ["scaling"]:
        refusal = "scaling runs on its own: give it alone, not with other groups"
    elif args.json is not None:
        refusal = "--json is for row groups; bench scaling writes scaling.json under --out"
    elif args.plot is not None and (missing := matplotlib_missing()) is not None:
        refusal = f"--plot: {missing}"
    if refusal is not None:
        print(f"staging-contracts bench: {refusal}", file=sys.stderr)
        return EXIT_USAGE
    backends = tuple(args.backends) if args.backends else None
    try:
        options = BenchOptions(quick=args.quick, device=args.device, backends=backends)
        with stop_on_signals(raise_on_signal=True):
            result = run_scaling(options, progress=_progress)
    except ValueError as exc:
        print(f"staging-contracts bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(result.format_text())
    paths = result.write(args.out if args.out is not None else ".")
    if args.plot is not None:
        paths += write_plots(result, args.plot)
    print("wrote " + ", ".join(str(path) for path in paths))
    if result.interrupted is not None:
        return exit_status(result.interrupted)
    if not result.rows:
        print("staging-contracts bench: no engine could be run", file=sys.stderr)
    return EXIT_OK if result.ok else EXIT_NONCONFORMING


def _cuda_available() -> bool:
    import torch  # noqa: PLC0415 - heavy, and only for --device cuda

    return bool(torch.cuda.is_available())


_RING_FIXED = (
    "the ring holds 4 regions of the largest chunk (TransferConfig.ring_chunks), as the "
    "memory check counts it"
)
"""Why ``demo`` and ``soak`` size the ring themselves (``STAGING_CONTRACTS_RING_BYTES`` is
ignored there, with a warning)."""


def _progress(message: str, level: int = logging.INFO) -> None:
    """A progress (or fault, or warning) line of a command, on stderr with the log lines:
    plain text, or with ``--log-format json`` one JSON log object (logger
    ``staging_contracts.cli``), so that stderr is JSON throughout."""
    if os.environ.get(logformat.LOG_FORMAT_ENV) == "json":
        message = logformat.json_line(message, logger="staging_contracts.cli", level=level)
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
