"""Command-line options that ``demo`` and ``soak`` build alike.

**Called by:** :func:`~.demo.add_demo_arguments` and
:func:`~.soak_report.add_soak_arguments`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable


def add_backend_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """``--backend SPEC``: which backend the run's ranks use."""
    parser.add_argument(
        "--backend",
        default=default,
        metavar="SPEC",
        help="the backend: a name (nixl, mooncake, or one registered under the entry-point "
        "group staging_contracts.backends), MODULE:CLASS, or MODULE:CLASS=MODULE:FACTORY "
        "(default: nixl, which needs no system libraries)",
    )


def add_typed_options(
    parser: argparse.ArgumentParser,
    defaults: object,
    options: Iterable[tuple[str, type, str, str | None]],
) -> None:
    """Each ``(flag, type, metavar, help)`` of ``options``, in order, defaulting to the field of
    ``defaults`` the flag names (``--page-size``: ``page_size``)."""
    for flag, kind, metavar, text in options:
        default = getattr(defaults, flag.removeprefix("--").replace("-", "_"))
        parser.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)
