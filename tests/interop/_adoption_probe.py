"""Run SGLang 0.5.23's own code, patched or not, and report what it did, as JSON.

Run as ``python -m tests.interop._adoption_probe [--overlay DIR] OUT.json`` from the
repository root: ``DIR`` holds an ``sglang`` package that shadows the installed reference
(the adoption patch applied; see :mod:`._adoption`). The same probe runs on the unpatched
reference, so a test can compare what SGLang does with and without the patch.

What it reports:

* ``classes``: for each of its managers, whether its class uses an enforcing mixin and, when
  the mixin module has a contract, that contract's verdict on the class;
* ``managers``: each of the twelve managers built through its real ``__init__``
  (:mod:`._sglang_managers`): built or the error, and the instance check's verdict;
* ``listener``: per backend, the ``STAGING_RSP`` frames its own decode listener thread sent
  for a fixed sequence of ``STAGING_REQ`` frames (a chunk's first writer, its second, an
  oversized chunk, an unregistered room), and whether the thread was alive after them;
* ``readiness``: per backend, its prefill's ``_is_watermark_ready`` over a grid of regions
  after a fixed sequence of ``WATERMARK`` messages;
* ``assignments``: on built managers, what SGLang's own post-construction assignments did
  (``set_kv_buffer_tensors``, attaching its ``DecodeStagingHandler``), and what wrong-typed
  assignments of ``_staging_handler`` and ``kv_buffer_tensors`` did;
* ``checks``: the exit status and output of ``staging-contracts check`` (its ``main``, in this
  process, where SGLang imports) on its managers, against their own mixin's contract.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

import torch
import zmq

__all__ = ["main"]

ROOM = 4242
OTHER_ROOM = 4343
SESSION = "prefill-session-0"
REQUESTS: list[list[bytes]] = [
    [b"STAGING_REQ", b"4242", b"0", b"2", SESSION.encode()],
    [b"STAGING_REQ", b"4242", b"0", b"2", SESSION.encode()],
    [b"STAGING_REQ", b"4242", b"1", b"100000", SESSION.encode()],
    [b"STAGING_REQ", b"4343", b"0", b"2", SESSION.encode()],
    [b"STAGING_REQ", b"4242", b"2", b"1", SESSION.encode()],
]
"""A chunk's first writer, its second writer, a chunk that can never fit the ring, a room
never registered, and one more chunk (answered only if the thread survived the others)."""

WATERMARKS: list[tuple[int, int]] = [(0, 4096), (1, 1024), (0, 8192)]
READY_GRID: list[tuple[int, int]] = [(r, e) for r in (0, 1, 2) for e in (512, 1024, 4096, 9000)]


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _classes(reference: Any) -> dict[str, Any]:
    from staging_contracts import ContractMixin

    contract = getattr(reference.staging_handler, "STAGING_CONTRACT", None)
    found: dict[str, Any] = {}
    for name, module in (
        ("MooncakeKVManager", reference.mooncake_conn),
        ("NixlKVManager", reference.nixl_conn),
        ("AscendKVManager", reference.ascend_conn),
        ("MoriKVManager", reference.mori_conn),
    ):
        cls = getattr(module, name)
        row: dict[str, Any] = {"enforced": issubclass(cls, ContractMixin)}
        if contract is not None:
            report = contract.inspect_class(cls)
            row["conforms"] = report.conforms
            row["problems"] = [p.describe(instance=False) for p in report.problems]
            row["missing"] = [p.member for p in report.problems]
        found[name] = row
    return found


def _managers(reference: Any) -> dict[str, Any]:
    from tests.interop import _sglang_managers as sg

    contract = getattr(reference.staging_handler, "STAGING_CONTRACT", None)
    found: dict[str, Any] = {}
    for spec in sg.SPECS:
        row: dict[str, Any] = {}
        try:
            manager, _pool = sg.build_manager(reference, spec)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            row["built"] = False
            row["error"] = _error(exc)
            row["trace"] = traceback.format_exc(limit=-4)
        else:
            row["built"] = True
            row["context"] = type(manager._staging_ctx).__name__
            row["has_handler"] = hasattr(manager, "_staging_handler")
            if contract is not None:
                problems = contract.instance_problems(manager)
                row["instance_problems"] = [p.describe(instance=True) for p in problems]
        found[spec.label] = row
    return found


def _attach_handler(reference: Any, manager: Any, pool: list[torch.Tensor]) -> Any:
    """What SGLang's decode does after building a staging manager: hand it the KV pool
    (``set_kv_buffer_tensors``), create its ``DecodeStagingHandler`` and assign it."""
    from tests.interop import _sglang_managers as sg

    layers = sg.LAYERS
    # its handler's constructor insists on an indexed (accelerator) device: it is shown a
    # pool on "cpu:0", then given the real one, as the interop sides do
    shown = [types.SimpleNamespace(device=torch.device("cpu", 0))]
    manager.set_kv_buffer_tensors(shown, shown, sg.PAGE_SIZE, slot_layer_ids=[0])
    scheduler = types.SimpleNamespace(
        req_to_token_pool=types.SimpleNamespace(
            req_to_token=torch.zeros((4, sg.POOL_PAGES * sg.PAGE_SIZE), dtype=torch.int64)
        )
    )
    handler = reference.staging_handler.DecodeStagingHandler.create(manager, scheduler, 0)
    manager.set_kv_buffer_tensors(
        pool[:layers], pool[layers:], sg.PAGE_SIZE, slot_layer_ids=list(range(layers))
    )
    handler.kv_buffer_info = manager.kv_buffer_tensors
    manager._staging_handler = handler
    return handler


def _listener(reference: Any, backend: str) -> dict[str, Any]:
    from tests.interop import _fakes
    from tests.interop import _sglang_managers as sg

    manager, pool = sg.build_manager(reference, sg.ManagerSpec(backend, "decode", True))
    handler = _attach_handler(reference, manager, pool)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    prefill: zmq.Socket[bytes] = context.socket(zmq.PULL)
    prefill.setsockopt(zmq.LINGER, 0)
    port = prefill.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    receiver = _fakes.Receiver(
        [{"rank": 0, "pp_rank": 0}],
        {0: _fakes.ZmqSocket(context, endpoint)},
        _fakes.PrefillInfo(2),
    )
    request = types.SimpleNamespace(
        req=types.SimpleNamespace(
            kv=types.SimpleNamespace(cache_protected_len=0, req_pool_idx=0),
            bootstrap_room=ROOM,
        ),
        kv_receiver=receiver,
    )
    manager.register_staging_room_bootstrap(ROOM, receiver.bootstrap_infos, receiver)
    handler.register_decode_req(ROOM, request)
    threads_before = {t.ident for t in __import__("threading").enumerate()}
    sg.start_decode_listener(reference, manager)
    listener = [t for t in __import__("threading").enumerate() if t.ident not in threads_before]
    sender: zmq.Socket[bytes] = context.socket(zmq.PUSH)
    sender.setsockopt(zmq.LINGER, 0)
    sender.connect(f"tcp://{manager.local_ip}:{manager.rank_port}")
    answers: list[list[str]] = []
    for frames in REQUESTS:
        sender.send_multipart(frames)
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if prefill.poll(200):
            answers.append([f.decode() for f in prefill.recv_multipart()])
        elif len(answers) >= 4:
            break
    alive = [t.is_alive() for t in listener]
    sender.close()
    prefill.close()
    return {"answers": answers, "listener_threads": len(listener), "alive": alive}


def _readiness(reference: Any, backend: str) -> dict[str, Any]:
    from tests.interop import _sglang_managers as sg

    manager, _pool = sg.build_manager(reference, sg.ManagerSpec(backend, "prefill", True))
    grid: list[list[bool]] = []
    for rnd, tail in WATERMARKS:
        message = [b"WATERMARK", str(rnd).encode(), str(tail).encode(), b"decode-0"]
        reference.staging_handler.handle_watermark_msg(manager._staging_ctx, message)
        grid.append([manager._is_watermark_ready("decode-0", r, e) for r, e in READY_GRID])
    never = manager._is_watermark_ready("never-seen", 0, 1)
    return {"grid": grid, "unknown_session": never}


def _assignments(reference: Any) -> dict[str, Any]:
    from tests.interop import _sglang_managers as sg

    manager, pool = sg.build_manager(reference, sg.ManagerSpec("nixl", "decode", True))
    found: dict[str, Any] = {}
    try:
        handler = _attach_handler(reference, manager, pool)
    except Exception as exc:  # noqa: BLE001 - reported
        found["own"] = _error(exc)
        return found
    found["own"] = "passed"
    for name, value in (("_staging_handler", "not a handler"), ("kv_buffer_tensors", [1, 2])):
        before = getattr(manager, name)
        try:
            setattr(manager, name, value)
        except Exception as exc:  # noqa: BLE001 - reported
            found[name] = {
                "error": type(exc).__name__,
                "text": str(exc),
                "kept": getattr(manager, name) is before,
            }
        else:
            found[name] = {"error": None, "kept": False}
    manager._staging_handler = None
    found["detach"] = manager._staging_handler is None
    found["mocks"] = _mock_assignments(reference, manager)
    manager._staging_handler = handler
    prefill, _ = sg.build_manager(reference, sg.ManagerSpec("mooncake", "prefill", True))
    prefill.set_kv_buffer_tensors(pool[:2], pool[2:], sg.PAGE_SIZE, slot_layer_ids=[0, 1])
    found["prefill_pool"] = isinstance(prefill.kv_buffer_tensors, dict)
    return found


def _mock_assignments(reference: Any, manager: Any) -> dict[str, str]:
    """What SGLang's own unit tests would meet: a bare ``MagicMock()`` handler is refused (it
    is no ``DecodeStagingHandler``), one made with ``spec=DecodeStagingHandler`` passes."""
    from unittest import mock

    found: dict[str, str] = {}
    spec = reference.staging_handler.DecodeStagingHandler
    for kind, value in (("bare", mock.MagicMock()), ("spec", mock.MagicMock(spec=spec))):
        try:
            manager._staging_handler = value
        except Exception as exc:  # noqa: BLE001 - reported
            found[kind] = type(exc).__name__
        else:
            found[kind] = "passed"
    return found


CHECKS: dict[str, list[str]] = {
    "mooncake": ["check", "sglang.srt.disaggregation.mooncake.conn:MooncakeKVManager"],
    "nixl": ["check", "sglang.srt.disaggregation.nixl.conn:NixlKVManager"],
    "ascend": ["check", "sglang.srt.disaggregation.ascend.conn:AscendKVManager"],
    "mori-against-the-mixin": [
        "check",
        "--mixin",
        "sglang.srt.disaggregation.common.staging_handler:StagingManagerMixin",
        "sglang.srt.disaggregation.mori.conn:MoriKVManager",
    ],
}


def _checks() -> dict[str, Any]:
    import contextlib
    import io

    from staging_contracts.cli import main as cli

    found: dict[str, Any] = {}
    for name, words in CHECKS.items():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cli(words)
        found[name] = {"status": status, "out": out.getvalue(), "err": err.getvalue()}
    return found


def main(argv: list[str] | None = None) -> int:
    """Run every part of the probe; write the JSON report; exit 0 even when parts failed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--overlay", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.overlay is not None:
        sys.path.insert(0, str(args.overlay))
    from tests.interop._reference import ensure_installed, load_reference

    reference = load_reference(ensure_installed())
    report: dict[str, Any] = {
        "staging_handler": reference.staging_handler.__file__,
        "classes": _classes(reference),
        "managers": _managers(reference),
    }
    for part, run in (
        ("listener", lambda: {b: _listener(reference, b) for b in ("mooncake", "nixl")}),
        ("readiness", lambda: {b: _readiness(reference, b) for b in ("mooncake", "nixl")}),
        ("assignments", lambda: _assignments(reference)),
        ("checks", _checks),
    ):
        try:
            report[part] = run()
        except Exception as exc:  # noqa: BLE001 - reported, the other parts still run
            report[part] = {"failed": _error(exc), "trace": traceback.format_exc()}
    args.out.write_text(json.dumps(report, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # SGLang's managers cannot be closed; their ZMQ contexts would block at interpreter exit
    os._exit(status)
