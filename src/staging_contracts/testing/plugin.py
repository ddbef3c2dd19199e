"""The contract kit's pytest plugin: run the kit on backends named on the command line.

``--staging-backend NAME|MODULE:CLASS[=MODULE:FACTORY]`` (may repeat; its ini twin,
``staging_backend``, takes one per line and loses to the flag) adds a test class generated from
:class:`~staging_contracts.testing.StagingBackendContract` per backend, collected under the
node ``staging-backend::Test<Class>``; a backend that does not load is one collection error.
After the run it lists, under ``staging-contracts``, each backend the kit checked that states
no witness, with the line to add (a recommendation, see
:mod:`~staging_contracts._contract.witness`). It also rewords two collection errors of an
author's own test module: a ``class`` statement the contract rejects, and a project module
not on ``sys.path``. See ``docs/writing-a-backend.md``, "Without a test file".

Loaded through the ``pytest11`` entry point, or with ``-p staging_contracts.testing.plugin``.
Loading it imports neither torch nor pyzmq: the kit, its targets and the backends are imported
only when a backend is named (or a collection error needs the contract's explanation).
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pytest

from .._contract.problems import ContractError
from ._notes import WITNESS_NOTES

if TYPE_CHECKING:
    from ._kit import StagingBackendContract
    from ._targets import BackendTarget

__all__ = [
    "INI_KEY",
    "NODE_NAME",
    "kit_class",
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_exception_interact",
    "pytest_terminal_summary",
]

INI_KEY: Final = "staging_backend"
"""The ini key mirroring ``--staging-backend``."""

NODE_NAME: Final = "staging-backend"
"""The collection node the generated test classes live under."""

_TARGETS: Final = pytest.StashKey[tuple["BackendTarget", ...]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add the ``staging-contracts`` option group and its ini key."""
    help_text = (
        "run the staging backend contract kit on the backend NAME (in-tree or registered "
        "under the staging_contracts.backends entry points) or MODULE:CLASS (may repeat); "
        "append =MODULE:FACTORY to name the manager factory, FACTORY(kv_args, *, role, "
        "attn_tp_size), that builds its managers (as for demo --backend)"
    )
    group = parser.getgroup("staging-contracts", "staging backend contract kit")
    group.addoption(
        "--staging-backend",
        action="append",
        dest=INI_KEY,
        default=None,
        metavar="NAME|MODULE:CLASS[=MODULE:FACTORY]",
        help=help_text,
    )
    parser.addini(
        INI_KEY,
        "backends to run the staging backend contract kit on, one "
        "NAME or MODULE:CLASS[=MODULE:FACTORY] per line (--staging-backend overrides them)",
        type="linelist",
        default=[],
    )


def pytest_configure(config: pytest.Config) -> None:
    """Parse the named backends (importing them is left to the tests).

    Raises:
        pytest.UsageError: a value is not ``NAME`` or ``MODULE:CLASS``, optionally with
            ``=MODULE:FACTORY``, or names no known backend.
    """
    given: Sequence[str] | None = config.getoption(INI_KEY)
    specs = list(given) if given else list(config.getini(INI_KEY))
    if not specs:
        return  # no targets: collection adds nothing
    from ._targets import BackendTarget  # noqa: PLC0415 - only when a backend is named

    try:
        config.stash[_TARGETS] = tuple(BackendTarget.parse(spec) for spec in specs)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Add the kit's tests for each named backend (before ``-k``/``-m`` deselect items)."""
    targets = config.stash.get(_TARGETS, ())
    if not targets:
        return
    module = _KitModule.from_parent(session, path=config.rootpath / NODE_NAME, targets=targets)
    items.extend(session.genitems(module))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """After the run: the witness each checked backend could state (a recommendation)."""
    notes = config.stash.get(WITNESS_NOTES, {})
    if not notes:
        return
    terminalreporter.section("staging-contracts", sep="-")
    for note in notes.values():
        terminalreporter.line(note)


def pytest_exception_interact(
    node: pytest.Item | pytest.Collector,
    call: pytest.CallInfo[Any],
    report: pytest.CollectReport | pytest.TestReport,
) -> None:
    """Reword the collection error of a test module whose import the contract rejected, or
    that imports a project module pytest cannot find (see the module's docstring)."""
    if not isinstance(node, pytest.Collector) or not isinstance(report, pytest.CollectReport):
        return
    if call.excinfo is None:
        return
    error = call.excinfo.value
    cause = error.__cause__ if isinstance(error, node.CollectError) else error
    if isinstance(cause, ContractError) and not cause.instance:
        from ._targets import contract_of  # noqa: PLC0415 - only on this collection error

        explanation = contract_of(cause.cls).explain(cause.cls)
        report.longrepr = (
            f"importing {report.nodeid} failed: the contract rejected a class statement:\n"
            f"{cause}\n\n{explanation}"
        )
    elif isinstance(cause, ModuleNotFoundError) and report.longrepr is not None:
        hint = _path_hint(cause, node.config.rootpath)
        if hint is not None:
            report.longrepr = f"{report.longrepr}\n{hint}"


def _path_hint(error: ModuleNotFoundError, root: Path) -> str | None:
    """Why a module of the project is not found, when it lies at ``root`` or in ``root/src``."""
    missing = error.name or ""
    if "." in missing:  # the package imports: a submodule is misspelt, sys.path is fine
        return None
    for folder, entry in ((root, "."), (root / "src", "src")):
        if missing and ((folder / missing).is_dir() or (folder / f"{missing}.py").is_file()):
            cwd = (
                " run 'python -m pytest' (it adds the current directory), or"
                if entry == "."
                else ""
            )
            return (
                f"Hint: {missing!r} is in {folder}, which is not on sys.path:{cwd} set "
                f'pythonpath = ["{entry}"] under [tool.pytest.ini_options], or install the '
                "package (pip install -e .)"
            )
    return None


def kit_class(target: BackendTarget, name: str | None = None) -> type[StagingBackendContract]:
    """The test class the plugin generates for one named backend.

    Args:
        target: the backend (and factory) to test, imported when the tests run.
        name: the class name; default ``Test<Class>``.
    """
    from ._kit import StagingBackendContract  # noqa: PLC0415 - only when a backend is named

    namespace: dict[str, Any] = {
        "__test__": True,
        "__doc__": f"The staging contract kit on {target.spec}.",
        "__module__": __name__,
        "_backend_target": target,
    }
    return types.new_class(
        name or f"Test{target.class_name}",
        (StagingBackendContract,),
        exec_body=lambda ns: ns.update(namespace),
    )


class _KitModule(pytest.Module):
    """A module node whose object is built from the named backends, not imported."""

    def __init__(self, *, targets: Sequence[BackendTarget], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._names: list[tuple[str, BackendTarget]] = []
        taken: set[str] = set()
        for index, target in enumerate(targets):
            name = f"Test{target.class_name}"
            if name in taken:
                name = f"{name}_{index}"
            taken.add(name)
            self._names.append((name, target))

    def _getobj(self) -> types.ModuleType:
        module = types.ModuleType(f"{__name__}.generated")
        module.__doc__ = "Contract kit test classes generated from --staging-backend."
        for name, target in self._names:
            setattr(module, name, kit_class(target, name))
        return module

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        """One :class:`_KitClass` per named backend."""
        return [
            _KitClass.from_parent(self, name=name, target=target) for name, target in self._names
        ]


class _KitClass(pytest.Class):
    """The kit's test class for one backend; importing the backend is part of collecting it."""

    def __init__(self, *, target: BackendTarget, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._target = target

    def collect(self) -> Iterable[pytest.Item | pytest.Collector]:
        """The kit's tests, or one collection error saying why the backend (or its factory:
        importable, and taking a manager factory's arguments) does not load."""
        from ._targets import BackendLoadError  # noqa: PLC0415 - only when a backend is named

        try:
            self._target.load_class()
            self._target.load_factory()
        except BackendLoadError as exc:
            raise self.CollectError(f"{self._target.spec}: {exc}") from None
        return super().collect()
