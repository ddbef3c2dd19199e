"""Command line: ``staging-contracts check | demo | soak | bench``.

The CLI is the only place in the package that prints.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from .contract.contract import Contract, is_abstract
from .contract.enforcement import contract_roots
from .contract.problems import ContractError
from .contract.typeforms import class_label
from .mixin import STAGING_CONTRACT

__all__ = ["main"]

EXIT_OK = 0
EXIT_NONCONFORMING = 1
EXIT_UNIMPORTABLE = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    status: int = args.run(args)
    return status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="staging-contracts",
        description="Typed staging path for PD-disaggregated LLM serving.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    check = commands.add_parser(
        "check",
        help="explain how classes satisfy the staging host contract",
        description=(
            "Import each MODULE:CLASS and print how it satisfies the contract of every "
            "enforcing mixin it uses (the StagingHost contract when it uses none), or of the "
            "mixin named by --mixin. Exit 0 if all conform, 1 if any does not, 2 if a name "
            "cannot be imported (importing it raised, or it is not a class)."
        ),
    )
    check.add_argument("targets", nargs="+", metavar="MODULE:CLASS")
    check.add_argument(
        "--mixin",
        metavar="MODULE:MIXIN",
        help="check against the contract of this ContractMixin instead (any enforcing mixin)",
    )
    check.set_defaults(run=_run_check)

    demo = commands.add_parser(
        "demo",
        help="run a verified heterogeneous-TP staged transfer across processes",
        description=(
            "Fill each prefill rank's KV pool with seeded data, stage R requests into the "
            "decode ranks through the chosen engine, and verify every decode page. "
            "Exit 0 only when every page verified."
        ),
    )
    from .cluster.demo import add_demo_arguments  # noqa: PLC0415 - keeps `check` light

    add_demo_arguments(demo)
    demo.set_defaults(run=_run_demo)

    from .cluster.soak_report import SOAK_EPILOG, add_soak_arguments  # noqa: PLC0415 - as demo

    soak = commands.add_parser(
        "soak",
        help="run the multi-process transfer continuously while injecting faults",
        description=(
            "Keep rooms moving from P prefill to D decode rank processes while injecting the "
            "listed faults in turn; verify every completed room bit for bit; print a summary: "
            "rooms succeeded and failed by reason, corrupt and hung rooms, time to detect "
            "each kill, ring use at the end, listener restarts."
        ),
        epilog=SOAK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_soak_arguments(soak)
    soak.set_defaults(run=_run_soak)

    from .bench import GROUPS  # noqa: PLC0415 - keeps `check` free of benchmark imports

    bench = commands.add_parser(
        "bench",
        help="run benchmarks against anchors measured in the same run",
        description=f"Groups: {', '.join(GROUPS)} (default: all).",
    )
    bench.add_argument("groups", nargs="*", metavar="GROUP", choices=[[], *GROUPS])
    bench.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list")
    bench.add_argument(
        "--quick", action="store_true", help="fewer repetitions (for smoke tests, not figures)"
    )
    bench.set_defaults(run=_run_bench)
    return parser


def _run_check(args: argparse.Namespace) -> int:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: local modules are importable
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
    status = EXIT_OK
    for target in args.targets:
        status = max(status, _check_one(target, forced))
        print()
    return status


def _load_class(target: str) -> type | int:
    """Import ``MODULE:CLASS``; the class, or the exit status after saying why not."""
    module_name, sep, qualname = target.partition(":")
    if not sep or not module_name or not qualname:
        print(f"{target}: expected MODULE:CLASS", file=sys.stderr)
        return EXIT_UNIMPORTABLE
    try:
        module = importlib.import_module(module_name)
    except ContractError as exc:
        print(f"{target}: the contract rejected a class while importing {module_name!r}:")
        print(exc)
        return EXIT_NONCONFORMING
    except ImportError as exc:
        print(f"{target}: cannot import {module_name!r}: {exc}", file=sys.stderr)
        return EXIT_UNIMPORTABLE
    except Exception as exc:  # noqa: BLE001 - any error of the imported module: exit 2, say it
        trace = "".join(traceback.format_exception(exc)).rstrip()
        print(
            f"{target}: importing {module_name!r} raised {type(exc).__name__}: {exc}\n{trace}",
            file=sys.stderr,
        )
        return EXIT_UNIMPORTABLE
    obj: object = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            print(f"{target}: {module_name!r} has no attribute {qualname!r}", file=sys.stderr)
            return EXIT_UNIMPORTABLE
    if not isinstance(obj, type):
        print(f"{target}: {qualname!r} is not a class", file=sys.stderr)
        return EXIT_UNIMPORTABLE
    return obj


def _check_one(target: str, forced: Contract | None = None) -> int:
    obj = _load_class(target)
    if isinstance(obj, int):
        return obj
    if forced is not None:
        contracts = [forced]
    else:
        contracts = [root.__dict__["contract"] for root in contract_roots(obj)]
    if not contracts:
        print(f"{target} does not use an enforcing mixin; against the StagingHost contract:")
        contracts = [STAGING_CONTRACT]
    status = EXIT_OK
    for contract in contracts:
        print(contract.explain(obj))
        report = contract.inspect_class(obj, abstract=is_abstract(obj))
        if not report.conforms:
            print(contract.class_error(report))
            status = EXIT_NONCONFORMING
    return status


def _run_demo(args: argparse.Namespace) -> int:
    from .cluster.demo import (  # noqa: PLC0415 - heavy imports
        config_from_args,
        placement_from_args,
        run_demo,
    )

    try:
        config = config_from_args(args)
        placement = placement_from_args(args)
    except ValueError as exc:
        print(f"staging-contracts demo: {exc}", file=sys.stderr)
        return EXIT_UNIMPORTABLE
    return run_demo(config, placement=placement)


def _run_soak(args: argparse.Namespace) -> int:
    from .cluster.soak import run_soak  # noqa: PLC0415 - heavy imports
    from .cluster.soak_report import config_from_args, format_summary  # noqa: PLC0415
    from .control.security import SecurityError  # noqa: PLC0415

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"staging-contracts soak: {exc}", file=sys.stderr)
        return EXIT_UNIMPORTABLE
    _progress(
        f"soak over {config.backend}: {config.prefill_tp} prefill -> {config.decode_tp} decode "
        f"ranks, {config.duration_s:g} s, faults: {', '.join(config.faults) or 'none'}"
    )
    try:
        result = run_soak(config, progress=_progress)
    except (ImportError, SecurityError) as exc:
        print(f"staging-contracts soak: {exc}", file=sys.stderr)
        return EXIT_UNIMPORTABLE
    except RuntimeError as exc:  # the ranks did not start; they are stopped already
        print(f"staging-contracts soak: {exc}", file=sys.stderr)
        return EXIT_NONCONFORMING
    except KeyboardInterrupt:  # run_soak stopped every rank on the way out
        print("staging-contracts soak: interrupted", file=sys.stderr)
        return 130
    print(format_summary(result))
    return EXIT_OK if result.ok else EXIT_NONCONFORMING


def _run_bench(args: argparse.Namespace) -> int:
    from .bench import format_table, run_groups, write_json  # noqa: PLC0415 - heavy imports

    rows = run_groups(args.groups or None, quick=args.quick, progress=_progress)
    print(format_table(rows))
    if args.json:
        write_json(rows, args.json)
        print(f"wrote {len(rows)} rows to {args.json}")
    return EXIT_OK


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
