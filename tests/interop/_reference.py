"""The reference (SGLang 0.5.23): installed once into a cache folder, imported on a CPU machine.

**Install.** :func:`ensure_installed` pip-installs the pinned wheel and the few pure-Python (or
self-contained binary) packages its disaggregation modules import, each pinned and with
``--no-deps`` (the wheel's own requirements pull a CUDA stack), into one folder of the cache:
``$STAGING_CONTRACTS_INTEROP_CACHE`` if set, else ``$XDG_CACHE_HOME/staging-contracts/interop``,
else ``~/.cache/staging-contracts/interop``. The folder is named after a digest of the pins
and the Python version, filled under a file lock in a temporary sibling and renamed into
place when complete, so concurrent runs install it once and a broken run leaves nothing
half-installed behind. A later run reuses it without touching the network. If pip cannot
install it (no package index, say), :class:`ReferenceUnavailable` says why.

**Import.** :func:`load_reference` appends that folder to ``sys.path`` (so nothing of this
environment is shadowed) and imports the five ``conn`` modules and the staging modules.
Their import chain touches packages a CPU machine does not have: ``triton``, ``tvm_ffi``,
``mori`` and two model-zoo modules that need ``torchvision``. For those, and only for those
that cannot be imported for real, an import-time stand-in is served while the reference is
imported (any attribute is a class, a decorator returns what it decorates); the stand-ins
leave ``sys.modules`` and ``sys.meta_path`` afterwards, and nothing of them runs in the
tests. torch probes for triton itself, so its compiler modules are imported first, before any
stand-in exists, and settle on "no triton". The reference's torch kernels are selected with its
own switch (``SGLANG_STAGING_USE_TORCH``); environment variables its import sets are undone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import threading
import types
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

__all__ = [
    "CACHE_ENV",
    "DEPENDENCIES",
    "REFERENCE",
    "CpuStagingBuffer",
    "CpuStream",
    "Reference",
    "ReferenceUnavailable",
    "cache_root",
    "cpu_staging_allocator",
    "ensure_installed",
    "importing",
    "install_dir",
    "is_installed",
    "load_reference",
]

logger = logging.getLogger(__name__)

REFERENCE: Final = "sglang==0.5.23"
"""The reference wheel (its staging code: ``sglang/srt/disaggregation/common/staging_*.py``)."""

DEPENDENCIES: Final[tuple[str, ...]] = (
    "annotated-types==0.8.0",
    "anyio==4.16.0",
    "compressed-tensors==0.18.0",
    "gguf==0.19.0",
    "h11==0.16.0",
    "httpcore2==2.16.2",
    "httpx2==2.16.2",
    "huggingface-hub==2.4.0",
    "ipython==9.18.1",
    "loguru==0.7.3",
    "msgspec==0.23.0",
    "orjson==3.13.0",
    "pillow==13.0.0",
    "prometheus-client==0.26.0",
    "psutil==7.2.2",
    "pybase64==1.5.1",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "safetensors==0.8.0",
    "sentencepiece==0.2.1",
    "starlette==1.10.0",
    "tokenizers==0.23.2",
    "tqdm==4.70.1",
    "traitlets==5.16.1",
    "transformers==5.19.0",
    "truststore==0.10.5",
    "typing-inspection==0.4.5",
)
"""What the import chain of the disaggregation modules needs beyond this environment (torch,
numpy, pyzmq, requests, regex, PyYAML, filelock, packaging, typing-extensions and the engine
SDKs come with the project's extras). Found by importing them with nothing but these: each
one is imported on the way; the versions are those the wheel pins where it pins them."""

CACHE_ENV: Final = "STAGING_CONTRACTS_INTEROP_CACHE"
"""Environment variable naming the cache folder (default: see the module docstring)."""

PIP_NETWORK_TIMEOUT_S: Final = 60
"""pip's timeout per network operation (it retries a few times on its own)."""

PIP_TIMEOUT_S: Final = 1800
"""Longest the whole first install may take before it is given up (about 300 MB)."""

_STANDIN_PACKAGES: Final = ("triton", "tvm_ffi", "mori")
"""GPU-only packages the import chain touches (with every submodule)."""

_TORCHVISION_MODULES: Final = (
    "sglang.srt.multimodal.internvl_utils",
    "sglang.srt.configs.deepseek_ocr",
)
"""Model-zoo modules of the reference that import torchvision at the top."""

_TORCH_FIRST: Final = ("torch._dynamo", "torch._inductor", "torch._inductor.compile_fx")
"""torch modules that probe for triton when imported: imported before any stand-in exists."""

_MODULES: Final = {
    "staging_buffer": "sglang.srt.disaggregation.common.staging_buffer",
    "staging_handler": "sglang.srt.disaggregation.common.staging_handler",
    "common_conn": "sglang.srt.disaggregation.common.conn",
    "mooncake_conn": "sglang.srt.disaggregation.mooncake.conn",
    "nixl_conn": "sglang.srt.disaggregation.nixl.conn",
    "ascend_conn": "sglang.srt.disaggregation.ascend.conn",
    "mori_conn": "sglang.srt.disaggregation.mori.conn",
}

_TORCH_KERNELS_SWITCH: Final = "SGLANG_STAGING_USE_TORCH"
"""The reference's own switch from its Triton kernels to its torch ones."""


class ReferenceUnavailable(RuntimeError):
    """The reference could not be installed or imported; the text says why."""


# --------------------------------------------------------------------------- install


def cache_root() -> Path:
    """The cache folder: ``$STAGING_CONTRACTS_INTEROP_CACHE``, else under the user's cache."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "staging-contracts" / "interop"


def _pins_digest() -> str:
    text = "\n".join((REFERENCE, *DEPENDENCIES, f"cp{sys.version_info[0]}{sys.version_info[1]}"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def install_dir(root: Path | None = None) -> Path:
    """Where these pins are (or will be) installed under ``root`` (default :func:`cache_root`)."""
    base = cache_root() if root is None else root
    name, _, version = REFERENCE.partition("==")
    return base / f"{name}-{version}-{_pins_digest()}"


_COMPLETE: Final = ".complete"


def is_installed(root: Path | None = None) -> bool:
    """Whether a complete install of these pins is in the cache (no network, no lock)."""
    return (install_dir(root) / _COMPLETE).is_file()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing)."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_installed(root: Path | None = None) -> Path:
    """Install the pinned reference into the cache unless it is there; return its folder.

    Raises:
        ReferenceUnavailable: pip failed (the text holds the end of its output) or ran past
            :data:`PIP_TIMEOUT_S`.
    """
    target = install_dir(root)
    if (target / _COMPLETE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f"{target.name}.lock"):
        if (target / _COMPLETE).is_file():  # another run installed it while we waited
            return target
        for stale in target.parent.glob(f"{target.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a run that died (we hold the lock)
        partial = target.parent / f"{target.name}.partial-{os.getpid()}"
        try:
            _pip_install(partial)
            (partial / _COMPLETE).write_text("\n".join((REFERENCE, *DEPENDENCIES)) + "\n")
            shutil.rmtree(target, ignore_errors=True)  # an incomplete folder of an older layout
            partial.rename(target)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    logger.info("reference installed into %s", target)
    return target


def _pip_install(folder: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-compile",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--timeout",
        str(PIP_NETWORK_TIMEOUT_S),
        "--target",
        str(folder),
        REFERENCE,
        *DEPENDENCIES,
    ]
    logger.info("installing the reference: %s", " ".join(command))
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise ReferenceUnavailable(
            f"pip did not install {REFERENCE} within {PIP_TIMEOUT_S} s (is the package index"
            " reachable?)"
        ) from exc
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-25:])
        raise ReferenceUnavailable(
            f"pip could not install {REFERENCE} and its import dependencies from the package"
            f" index (exit status {done.returncode}); the interop suite needs them:\n{tail}"
        )


# --------------------------------------------------------------------------- stand-ins


class _StandInType(type):
    """Metaclass of the stand-in classes: every attribute of one is another stand-in class."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stand_in_class(f"{cls.__qualname__}.{name}")

    def __getitem__(cls, key: object) -> type:
        return cls

    def __or__(cls, other: object) -> Any:
        return cls

    def __ror__(cls, other: object) -> Any:
        return cls


class _StandIn(metaclass=_StandInType):
    """An instance of a stand-in class: built from anything; used as a decorator it returns
    what it decorates; any attribute is a stand-in class."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        del args, kwargs

    def __call__(self, *args: object, **kwargs: object) -> object:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _StandIn()

    def __getattr__(self, name: str) -> type:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stand_in_class(name)


def _stand_in_class(qualname: str) -> type:
    return _StandInType(
        qualname.rpartition(".")[2], (_StandIn,), {"__qualname__": qualname, "__module__": ""}
    )


class _StandInModule(types.ModuleType):
    """A stand-in module (a package, so its submodules are stand-ins too)."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stand_in_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves stand-ins for the named packages (and their submodules) and modules."""

    def __init__(self, packages: Sequence[str], modules: Sequence[str]) -> None:
        self._packages = frozenset(packages)
        self._modules = frozenset(modules)
        self.served: list[str] = []

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        del path, target
        if fullname.partition(".")[0] in self._packages or fullname in self._modules:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        self.served.append(module.__name__)


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


# --------------------------------------------------------------------------- import


@dataclass(frozen=True)
class Reference:
    """The reference's modules, imported (their attributes are its real functions and
    classes; typed ``Any`` as the reference is untyped)."""

    folder: Path
    """Where it is installed."""
    staging_buffer: types.ModuleType
    """``common/staging_buffer.py``: allocator, layout maths, torch and Triton kernels."""
    staging_handler: types.ModuleType
    """``common/staging_handler.py``: the staging messages, mixin and decode handler."""
    common_conn: types.ModuleType
    """``common/conn.py``: ``CommonKVManager`` (``send_chunk_ready``, ``handle_chunk_ready``)."""
    mooncake_conn: types.ModuleType
    """``mooncake/conn.py``: ``MooncakeKVManager``."""
    nixl_conn: types.ModuleType
    """``nixl/conn.py``: ``NixlKVManager``."""
    ascend_conn: types.ModuleType
    """``ascend/conn.py``: ``AscendKVManager``."""
    mori_conn: types.ModuleType
    """``mori/conn.py``: ``MoriKVManager``."""
    stood_in: tuple[str, ...]
    """The modules served as import-time stand-ins."""


_loaded: Reference | None = None
_load_lock = threading.Lock()


def load_reference(folder: Path) -> Reference:
    """Import the reference installed in ``folder`` (once per process).

    Raises:
        ReferenceUnavailable: a module of it cannot be imported (the text names it and why).
    """
    global _loaded  # noqa: PLW0603 - once per process
    with _load_lock:
        if _loaded is None:
            _loaded = _import(folder)
        elif _loaded.folder != folder:
            raise ReferenceUnavailable(f"the reference is already loaded from {_loaded.folder}")
        return _loaded


@contextlib.contextmanager
def importing(folder: Path) -> Iterator[_StandInFinder]:
    """While inside, modules of the reference installed in ``folder`` import on this CPU
    machine: the folder is on ``sys.path`` (appended), the stand-ins are served, and the
    reference's torch kernels are selected. On leaving, the stand-ins leave ``sys.modules``
    and ``sys.meta_path`` and the environment is restored (the folder stays on the path)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's compiler modules warn about deprecations
        for name in _TORCH_FIRST:
            importlib.import_module(name)
    packages = [name for name in _STANDIN_PACKAGES if _missing(name)]
    modules = list(_TORCHVISION_MODULES) if _missing("torchvision") else []
    finder = _StandInFinder(packages, modules)
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    environment = dict(os.environ)
    os.environ[_TORCH_KERNELS_SWITCH] = "1"
    sys.meta_path.insert(0, finder)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its import warns about CUDA-only features
            yield finder
    finally:
        sys.meta_path.remove(finder)
        for name in list(sys.modules):
            if isinstance(sys.modules[name], _StandInModule):
                del sys.modules[name]
        os.environ.clear()
        os.environ.update(environment)


def _import(folder: Path) -> Reference:
    loaded: dict[str, types.ModuleType] = {}
    with importing(folder) as finder:
        for key, name in _MODULES.items():
            try:
                loaded[key] = importlib.import_module(name)
            except Exception as exc:  # any failure of its import chain is reported
                raise ReferenceUnavailable(
                    f"cannot import the reference's {name} from {folder}: {exc!r}"
                ) from exc
    if loaded["staging_buffer"]._USE_TRITON_STAGING:
        raise ReferenceUnavailable("the reference chose its Triton kernels despite the switch")
    logger.info("reference imported from %s; stood in for %s", folder, finder.served)
    return Reference(folder=folder, **loaded, stood_in=tuple(finder.served))


# --------------------------------------------------------------------------- CPU objects

_DEVICE_TYPES: Final = "_STAGING_SUPPORTED_DEVICE_TYPES"
"""The reference's list of the device types its staging buffers may live on."""


def cpu_staging_allocator(reference: Reference, total_size: int) -> Any:
    """The reference's ``StagingAllocator`` of ``total_size`` bytes, built by its own
    constructor on the CPU (its ``StagingBuffer`` accepts only CUDA and XPU devices: the list
    is widened to the CPU for this construction only)."""
    module = reference.staging_buffer
    allowed: tuple[str, ...] = getattr(module, _DEVICE_TYPES)
    setattr(module, _DEVICE_TYPES, (*allowed, "cpu"))
    try:
        return module.StagingAllocator(total_size, "cpu", 0)
    finally:
        setattr(module, _DEVICE_TYPES, allowed)


class CpuStream:
    """A device stream on the CPU, with what the reference calls on one (torch's own CPU
    ``Stream`` lacks ``synchronize``): CPU work is done when the call returns."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, other: object) -> None:
        """Nothing to wait for."""
        del other

    def wait_event(self, event: object) -> None:
        """Nothing to wait for."""
        del event

    def synchronize(self) -> None:
        """Nothing to wait for."""


class CpuStagingBuffer:
    """What the reference's prefill asks of its staging buffer (``StagingBuffer``, which
    refuses the CPU), on the CPU: the bytes, their address and size, a device module and
    streams (trivial, as CPU work is synchronous).

    Args:
        size: bytes of the buffer.
    """

    def __init__(self, size: int) -> None:
        self.buffer = torch.zeros(size, dtype=torch.uint8)
        self.device = torch.device("cpu")
        self.device_module = types.SimpleNamespace(set_device=_ignore)
        self._stream = CpuStream()

    def get_ptr(self) -> int:
        """Address of the buffer."""
        return int(self.buffer.data_ptr())

    def get_size(self) -> int:
        """Bytes of the buffer."""
        return int(self.buffer.numel())

    def fits(self, required_bytes: int) -> bool:
        """Whether ``required_bytes`` fit."""
        return required_bytes <= self.get_size()

    def get_gather_stream(self) -> CpuStream:
        """The stream the gather runs on."""
        return self._stream

    def producer_stream(self) -> CpuStream:
        """The stream the KV rows were written on."""
        return self._stream


def _ignore(*args: object) -> None:
    del args
