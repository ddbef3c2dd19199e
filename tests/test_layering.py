"""The package's layers: imports only point down, as each package's ``__init__`` states."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Final, NamedTuple

import pytest

PACKAGE_ROOT: Final = Path(__file__).resolve().parent.parent / "src" / "staging_contracts"

TOP_LEVEL_MODULES: Final = frozenset(
    {
        "__init__",
        "cli",
        "config",
        "mypy_plugin",
        "mixin",
        "outcomes",
        "protocols",
        "stats",
        "tracing",
    }
)
"""The only modules that sit directly under ``staging_contracts/``; the rest are packages."""

_BELOW_BACKENDS: Final = frozenset(
    {
        "_contract",
        "config",
        "tracing",
        "stats",
        "outcomes",
        "protocols",
        "_staging",
        "_control",
        "engines",
        "_decode",
        "_prefill",
        "mixin",
    }
)

ALLOWED: Final[dict[str, frozenset[str]]] = {
    "_contract": frozenset(),
    "stats": frozenset(),
    "outcomes": frozenset(),
    "config": frozenset(),
    "tracing": frozenset({"outcomes"}),
    "protocols": frozenset({"stats"}),
    "_staging": frozenset({"protocols", "stats"}),
    "_control": frozenset({"config", "protocols", "stats"}),
    "engines": frozenset({"protocols", "stats"}),
    "_decode": frozenset(
        {"_staging", "_control", "config", "tracing", "outcomes", "protocols", "stats"}
    ),
    "_prefill": frozenset(
        {"_staging", "_control", "config", "tracing", "outcomes", "protocols", "stats"}
    ),
    "mixin": frozenset({"_contract", "_control", "protocols", "stats"}),
    "backends": _BELOW_BACKENDS,
    "_run": _BELOW_BACKENDS | {"backends"},
    "testing": _BELOW_BACKENDS | {"backends", "_run"},
    "metrics": _BELOW_BACKENDS | {"backends"},
    "_cluster": _BELOW_BACKENDS | {"backends", "metrics", "_run"},
    "_bench": _BELOW_BACKENDS | {"backends", "_cluster", "_run"},
    "mypy_plugin": frozenset({"_contract"}),
    "__init__": frozenset({"_contract", "_control", "mixin", "protocols", "stats"}),
    "cli": _BELOW_BACKENDS | {"backends", "_run", "testing", "_cluster", "_bench", "metrics"},
}
"""What each unit (a top-level module, or a package with everything in it) may import.

A unit may always import its own modules. The rules, bottom up: ``contract`` is domain-free;
``protocols``, ``stats`` and ``outcomes`` (why a room ended) are the domain's vocabulary;
``config`` (the environment's settings) is domain-free and ``tracing`` (OpenTelemetry spans
of rooms) knows only ``outcomes``;
``staging`` (the torch data path), ``control`` (wire and sockets) and ``engines`` sit on that
vocabulary alone; ``decode`` and ``prefill`` build each side from ``staging`` and ``control``
and never import each other;
``mixin`` joins the contract to the control plane; ``backends`` assemble all of that;
``metrics`` reads a backend's counters for Prometheus; ``run`` (the rank processes'
supervisor and the stop signals) sits on backends;
``testing`` and ``cluster`` use ``run``; ``bench`` may use ``cluster``; ``cli`` is the top.
"""


class Import(NamedTuple):
    """One import of a ``staging_contracts`` unit by a module of the package."""

    source: str
    """The importing file, relative to the package root."""
    line: int
    unit: str
    """The imported unit (first name below ``staging_contracts``)."""


def unit_of(path: Path, root: Path = PACKAGE_ROOT) -> str:
    """The unit a file of the package belongs to."""
    return path.relative_to(root).with_suffix("").parts[0]


def imports_of(path: Path, root: Path = PACKAGE_ROOT) -> Iterator[Import]:
    """Every ``staging_contracts`` unit ``path`` imports, whether or not under TYPE_CHECKING."""
    relative = path.relative_to(root)
    source = str(relative)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                package = ["staging_contracts", *relative.with_suffix("").parts[:-1]]
                base = package[: len(package) - (node.level - 1)]
                module = [*base, *(node.module.split(".") if node.module else [])]
            else:
                module = (node.module or "").split(".")
            if module[0] != "staging_contracts":
                continue
            if len(module) > 1:
                yield Import(source, node.lineno, module[1])
            else:
                for alias in node.names:
                    yield Import(source, node.lineno, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                module = alias.name.split(".")
                if module[0] == "staging_contracts":
                    yield Import(source, node.lineno, module[1] if len(module) > 1 else "__init__")


def package_files() -> list[Path]:
    return sorted(PACKAGE_ROOT.rglob("*.py"))


def test_only_the_listed_modules_sit_at_the_top() -> None:
    """Every other module of the package lives in a package folder."""
    top = {p.stem for p in PACKAGE_ROOT.glob("*.py")}
    assert top == TOP_LEVEL_MODULES


def test_every_unit_has_a_rule() -> None:
    """A new package or top-level module gets a stated place in the layers."""
    units = {unit_of(p) for p in package_files()}
    assert units == set(ALLOWED)


def test_every_package_states_its_place() -> None:
    """Each package's ``__init__`` docstring says what it may import and what imports it."""
    for init in sorted(PACKAGE_ROOT.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "\nMay import: " in doc, init
        assert "\nImported by: " in doc, init


@pytest.mark.parametrize("unit", sorted(ALLOWED))
def test_imports_only_point_down(unit: str) -> None:
    """A unit imports only the units its rule allows (and itself)."""
    wrong = [
        f"{imp.source}:{imp.line} imports {imp.unit!r}"
        for path in package_files()
        if unit_of(path) == unit
        for imp in imports_of(path)
        if imp.unit != unit and imp.unit not in ALLOWED[unit]
    ]
    assert not wrong, f"{unit!r} may import only {sorted(ALLOWED[unit])}: " + "; ".join(wrong)


def test_contract_imports_nothing_else_of_the_package() -> None:
    """The contract engine is domain-free: no import leaves ``_contract/``."""
    contract = [p for p in package_files() if unit_of(p) == "_contract"]
    assert contract
    leaving = [imp for p in contract for imp in imports_of(p) if imp.unit != "_contract"]
    assert leaving == []


def test_nothing_imports_the_entry_points() -> None:
    """The command line, the mypy plugin and the public surface are imported by no module."""
    entry = {"cli", "mypy_plugin", "__init__"}
    wrong = [
        imp
        for p in package_files()
        for imp in imports_of(p)
        if imp.unit in entry and imp.unit != unit_of(p)
    ]
    assert wrong == []


def test_the_import_reader_sees_every_form_of_import(tmp_path: Path) -> None:
    """The checker finds relative, absolute and TYPE_CHECKING imports (one that saw none would
    pass anything)."""
    module = tmp_path / "_decode" / "example.py"
    module.parent.mkdir()
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "import zmq\n"
        "from .._staging.kernels import gather_chunk\n"
        "from . import rooms\n"
        "from .. import protocols\n"
        "import staging_contracts._control.wire\n"
        "from staging_contracts._prefill.writer import StagingWriter\n"
        "if TYPE_CHECKING:\n"
        "    from .._cluster import runner\n"
    )
    found = [(imp.line, imp.unit) for imp in imports_of(module, root=tmp_path)]
    assert found == [
        (3, "_staging"),
        (4, "_decode"),
        (5, "protocols"),
        (6, "_control"),
        (7, "_prefill"),
        (9, "_cluster"),
    ]
    assert unit_of(module, root=tmp_path) == "_decode"


def module_name(path: Path, root: Path = PACKAGE_ROOT) -> str:
    """The dotted name of a file of the package (a package by its ``__init__``)."""
    parts = ["staging_contracts", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports by name (``from pkg import sub`` included)."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")
                if node.level:
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_module_import_circles() -> None:
    """No two modules of the package import each other, directly or through others."""
    assert import_circles(module_graph()) == []


def test_the_circle_finder_finds_a_circle(tmp_path: Path) -> None:
    """A circle through a TYPE_CHECKING import and ``from . import`` is found."""
    bench = tmp_path / "_bench"
    bench.mkdir()
    (bench / "__init__.py").write_text("")
    (bench / "a.py").write_text("from . import b\n")
    (bench / "b.py").write_text("from .c import x\n")
    (bench / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n"
    )
    (bench / "d.py").write_text("from .a import z\n")
    assert import_circles(module_graph(tmp_path)) == [
        ["staging_contracts._bench.a", "staging_contracts._bench.b", "staging_contracts._bench.c"]
    ]


def _divides_heads(node: ast.BinOp) -> bool:
    """``<something named *heads*> // ...``: a rank's share of the KV heads worked out."""
    if not isinstance(node.op, ast.FloorDiv):
        return False
    left = node.left
    name = left.id if isinstance(left, ast.Name) else getattr(left, "attr", "")
    return "heads" in name


def test_the_heads_per_rank_formula_lives_in_staging_layout_only() -> None:
    """Every share of KV heads comes from ``staging.layout`` (``heads_per_rank``,
    ``rank_heads``): no module divides a head count by a TP size itself."""
    layout = PACKAGE_ROOT / "_staging" / "layout.py"
    found = [
        f"{path.relative_to(PACKAGE_ROOT)}:{node.lineno}"
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        if path != layout
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.BinOp) and _divides_heads(node)
    ]
    assert not found, f"heads divided outside _staging/layout.py: {found}"


def test_ring_sizing_and_curve_key_text_are_defined_once() -> None:
    """``ring_bytes`` (_run/workload.py) and ``curve_key_text`` (_run/_rank_info.py)
    have one definition each, not one per rank body."""
    names = ("ring_bytes", "_ring_bytes", "curve_key_text", "_key_text")
    found = [
        f"{path.relative_to(PACKAGE_ROOT)}:{node.name}"
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        for node in ast.parse(path.read_text(), str(path)).body  # module-level functions
        if isinstance(node, ast.FunctionDef) and node.name in names
    ]
    assert sorted(found) == [
        "_run/_rank_info.py:curve_key_text",
        "_run/workload.py:ring_bytes",
    ]


def test_the_backends_package_init_only_re_exports() -> None:
    """``backends/__init__.py`` holds its docstring, imports and ``__all__``: the registry
    and the spec resolver live in their own modules, not in the package's ``__init__``."""
    init = PACKAGE_ROOT / "backends" / "__init__.py"
    body = ast.parse(init.read_text(), str(init)).body
    others = [
        f"line {node.lineno}: {type(node).__name__}"
        for index, node in enumerate(body)
        if not (index == 0 and isinstance(node, ast.Expr))  # the docstring
        and not isinstance(node, ast.ImportFrom)
        and not (
            isinstance(node, ast.Assign)
            and [ast.unparse(target) for target in node.targets] == ["__all__"]
        )
    ]
    assert not others, f"backends/__init__.py defines more than re-exports: {others}"


_SPEC_SEPARATORS: Final = frozenset({":", "="})
_SPLITTERS: Final = frozenset({"partition", "rpartition", "split", "rsplit"})
_LAZY_SUBMODULES: Final = PACKAGE_ROOT / "testing" / "__init__.py"
"""Imports its own submodules by name on first attribute access (not a spec)."""


def _parses_specs_itself(node: ast.Call, path: Path) -> bool:
    """A call that splits text at ``:`` or ``=``, or imports a module named by text."""
    if not isinstance(node.func, ast.Attribute):
        return False
    if node.func.attr == "import_module":
        return path != _LAZY_SUBMODULES
    return node.func.attr in _SPLITTERS and any(
        isinstance(arg, ast.Constant) and arg.value in _SPEC_SEPARATORS for arg in node.args
    )


def test_only_the_backend_resolver_parses_specs() -> None:
    """The command line and the pytest kit split ``NAME | MODULE:CLASS[=MODULE:FACTORY]`` and
    import what it names through ``backends._refs`` (one grammar, one import): neither
    splits text at ``:``/``=`` nor calls ``import_module`` itself."""
    paths = [PACKAGE_ROOT / "cli.py", *sorted((PACKAGE_ROOT / "testing").glob("*.py"))]
    found = [
        f"{path.relative_to(PACKAGE_ROOT)}:{node.lineno}: {ast.unparse(node)}"
        for path in paths
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Call) and _parses_specs_itself(node, path)
    ]
    assert not found, f"specs parsed outside backends/_refs.py: {found}"


_SPAWNING_MODULES: Final = frozenset({"multiprocessing", "subprocess", "concurrent.futures"})
"""Modules whose import means processes are started (``multiprocessing.connection`` and
``multiprocessing.process`` only wait for processes and name their type: not these)."""
_SPAWNING_CALLS: Final = frozenset({"Process", "Popen", "get_context", "ProcessPoolExecutor"})
_SPAWNING_OS: Final = ("fork", "spawn", "posix_spawn", "exec", "system", "popen")


def _spawns(node: ast.AST) -> bool:
    """An import of a module that starts processes, or a call that starts one."""
    if isinstance(node, ast.Import):
        return any(alias.name in _SPAWNING_MODULES for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and node.module in _SPAWNING_MODULES
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    on_os = isinstance(func, ast.Attribute) and ast.unparse(func.value) == "os"
    return name in _SPAWNING_CALLS or (on_os and name.startswith(_SPAWNING_OS))


def spawning_modules(root: Path = PACKAGE_ROOT) -> list[str]:
    """The files of the package that start processes (by their source)."""
    return [
        str(path.relative_to(root))
        for path in sorted(root.rglob("*.py"))
        if any(_spawns(node) for node in ast.walk(ast.parse(path.read_text(), str(path))))
    ]


def test_exactly_one_module_spawns_processes() -> None:
    """Every rank process of the package (the harness's, the demo's, the soak's, the
    benchmarks') starts in ``_run/_supervisor.py``: no other module imports ``multiprocessing``
    or ``subprocess`` to start one, or calls ``Process``, ``Popen`` or ``os.fork`` itself."""
    assert spawning_modules() == ["_run/_supervisor.py"]


def test_the_spawn_finder_sees_every_form(tmp_path: Path) -> None:
    """Each way to start a process is found; waiting for one or naming its type is not."""
    forms = {
        "a.py": "import multiprocessing\n",
        "b.py": "from subprocess import run\n",
        "c.py": "ctx.Process(target=f)\n",
        "d.py": "import os\nos.fork()\n",
        "e.py": "import os\nos.posix_spawn('x', [], {})\n",
        "f.py": "from concurrent.futures import ProcessPoolExecutor\n",
        "quiet.py": (
            "from multiprocessing.connection import Connection, wait\n"
            "from multiprocessing.process import BaseProcess\n"
            "import os\nos.kill(1, 0)\nprocess.kill()\n"
        ),
    }
    for name, text in forms.items():
        (tmp_path / name).write_text(text)
    assert spawning_modules(tmp_path) == ["a.py", "b.py", "c.py", "d.py", "e.py", "f.py"]


_STAGING_SET_UPS: Final = frozenset({"enable_decode_staging", "enable_prefill_staging"})


def staging_set_ups(root: Path = PACKAGE_ROOT) -> list[str]:
    """Each module (relative path) that calls a staging set-up (``enable_*_staging``), once."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                if name in _STAGING_SET_UPS:
                    found.add(str(path.relative_to(root)))
    return sorted(found)


def test_every_rank_is_built_by_the_one_rank_body() -> None:
    """The harness's, the demo's and the soak's ranks get their staging from the run layer's
    body (``_run/_rank_body.py``); besides it only the kit's ``DecodeSetup`` (a backend
    author's own decode manager) and the control bench (one handler, no rank) set staging
    up. A second rank body would show here."""
    assert staging_set_ups() == [
        "_bench/control_bench.py",
        "_run/_rank_body.py",
        "testing/_decode_setup.py",
    ]


def test_the_set_up_finder_sees_calls_and_attribute_calls(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("enable_decode_staging(m, kv_buffers=p, ring_bytes=1)\n")
    (tmp_path / "b.py").write_text("setup.enable_prefill_staging(m)\n")
    (tmp_path / "c.py").write_text("from x import enable_decode_staging\n")  # not a call
    assert staging_set_ups(tmp_path) == ["a.py", "b.py"]
