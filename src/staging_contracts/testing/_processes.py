"""A small group of spawned processes driven in lockstep: what the harness runs ranks in.

:class:`RankGroup` starts one process per job (:class:`~staging_contracts._run.Supervisor`),
each given a :class:`ParentLink` to talk back over a pipe. The parent moves the group from
step to step: it sends a command to some ranks (:meth:`RankGroup.send`) and gathers one
message of an expected kind from each (:meth:`RankGroup.gather`), every wait bounded. A rank
that sends ``("error", text)``, exits (its traceback, or why it has none, in the error), or
stays silent past the bound ends the gather with :class:`RankFailed`;
:meth:`RankGroup.close` then ends every process (closing the pipes first, so that a rank
waiting for a command stops by itself; then ``SIGKILL``, each step bounded).

The module knows nothing of staging: the harness gives it the entry point and the jobs.

**Threads:** one, the caller's, on each side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Final

from .._run import Supervisor

JOIN_S: Final = 10.0
"""Longest :meth:`RankGroup.close` waits for the processes to exit by themselves, and a rank's
process to be gone once its pipe said it ended."""


class RankFailed(RuntimeError):
    """A rank process failed, died or did not answer in time; the text says which and why.

    Attributes:
        label: the rank (e.g. ``decode rank 0``).
        kind: the message the parent was waiting for.
        sent: the rank's own message kind when it sent one (``"error"`` or another), else
            ``None``.
        detail: what the rank said (its error and traceback), or why it is silent.
    """

    def __init__(self, label: str, kind: str, sent: str | None, detail: str) -> None:
        self.label = label
        self.kind = kind
        self.sent = sent
        self.detail = detail
        super().__init__(f"{label}, waited for {kind!r}: {detail}")


class ParentLink:
    """The rank's end of its pipe: send messages, wait for the parent's commands.

    Args:
        conn: the pipe end the rank was started with.
        bound_s: longest :meth:`expect` waits for a command before the rank gives up.
    """

    def __init__(self, conn: Connection, bound_s: float) -> None:
        self._conn = conn
        self._bound_s = bound_s

    def send(self, kind: str, *payload: object) -> None:
        """Send ``(kind, *payload)`` to the parent (picklable values only)."""
        self._conn.send((kind, *payload))

    def expect(self, kind: str) -> tuple[object, ...]:
        """Wait (at most ``bound_s``) for the parent's command ``kind``; its payload.

        Raises:
            TimeoutError: no command within the bound.
            EOFError: the parent closed the pipe (it gave up on the run).
            RuntimeError: a command of another kind came.
        """
        if not self._conn.poll(self._bound_s):
            raise TimeoutError(f"no {kind!r} command from the parent in {self._bound_s:g}s")
        message = self._conn.recv()
        if not isinstance(message, tuple) or not message or message[0] != kind:
            raise RuntimeError(f"expected the command {kind!r}, got {message!r}")
        return message[1:]

    def close(self) -> None:
        """Close the pipe end; safe to call twice."""
        self._conn.close()


class RankGroup:
    """Processes started from one entry point, one per job, each with a pipe to this side.

    Args:
        target: the module-level entry point, called as ``target(job, conn)`` in each process.
        jobs: one picklable job per process.
        labels: a name per job, for messages (``prefill rank 1``).
    """

    def __init__(
        self,
        target: Callable[[object, Connection], None],
        jobs: Sequence[object],
        labels: Sequence[str],
    ) -> None:
        if len(jobs) != len(labels):
            raise ValueError(f"{len(jobs)} jobs but {len(labels)} labels")
        self.labels = list(labels)
        self._conns: list[Connection] = []
        self._ranks: Supervisor[int] = Supervisor()
        try:
            for index, (job, label) in enumerate(zip(jobs, labels, strict=True)):
                mine, theirs = self._ranks.pipe()
                self._ranks.start(index, target, (job, theirs), name=label)
                theirs.close()
                self._conns.append(mine)
        except BaseException:
            self.close()
            raise

    def send(self, indices: Sequence[int], kind: str, *payload: object) -> None:
        """Send the command ``(kind, *payload)`` to the ranks at ``indices``.

        Raises:
            RankFailed: a rank's pipe is closed (it died).
        """
        for index in indices:
            try:
                self._conns[index].send((kind, *payload))
            except (BrokenPipeError, EOFError, OSError) as exc:
                detail = f"its pipe is closed ({exc})"
                raise RankFailed(self.labels[index], kind, None, detail) from None

    def gather(self, indices: Sequence[int], kind: str, bound_s: float) -> list[tuple[object, ...]]:
        """One message of ``kind`` from each rank at ``indices``, in that order; payloads only.

        **Blocking:** until every one answered, at most ``bound_s``.

        Raises:
            RankFailed: a rank sent another kind (its ``error``), exited first, or is still
                silent after ``bound_s``; the first such rank, by arrival.
        """
        got: dict[int, tuple[object, ...]] = {}
        deadline = time.monotonic() + bound_s
        while len(got) < len(indices):
            waiting = [i for i in indices if i not in got]
            handles: dict[object, int] = {}
            for i in waiting:
                handles[self._conns[i]] = i
                handles[self._ranks[i].sentinel] = i
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                silent = ", ".join(self.labels[i] for i in waiting)
                raise RankFailed(silent, kind, None, f"no answer within {bound_s:g}s")
            ends = [self._conns[i] for i in waiting] + [self._ranks[i].sentinel for i in waiting]
            for ready in wait(ends, remaining):
                i = handles[ready]
                if i in got:
                    continue
                conn = self._conns[i]
                if not conn.poll():  # the sentinel: exited; a last message may still be there
                    raise RankFailed(self.labels[i], kind, None, self._exited(i))
                try:
                    message = conn.recv()
                except EOFError:
                    raise RankFailed(self.labels[i], kind, None, self._exited(i)) from None
                if not isinstance(message, tuple) or not message:
                    raise RankFailed(self.labels[i], kind, None, f"sent {message!r}")
                sent = str(message[0])
                if sent != kind:
                    detail = " ".join(str(part) for part in message[1:]) or sent
                    raise RankFailed(self.labels[i], kind, sent, detail)
                got[i] = tuple(message[1:])
        return [got[i] for i in indices]

    def _exited(self, index: int) -> str:
        """How the process at ``index`` ended (its sentinel is ready: the join is short)."""
        self._ranks[index].join(JOIN_S)
        return self._ranks.explain(self._ranks[index])

    def close(self) -> None:
        """End every process, each step bounded (:data:`JOIN_S`); safe to call twice."""
        for conn in self._conns:
            conn.close()
        self._ranks.close(JOIN_S)
