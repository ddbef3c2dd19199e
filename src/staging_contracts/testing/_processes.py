"""A small group of spawned processes driven in lockstep: what the harness runs ranks in.

:class:`RankGroup` starts one process per job (:class:`~staging_contracts._run.Supervisor`),
each given a :class:`ParentLink` to talk back over a pipe; what goes over it is typed
(:class:`~staging_contracts._run._codec.Message`, on the run layer's one codec). The parent
moves the group from step to step: it sends a command to some ranks (:meth:`RankGroup.send`)
and gathers one message of an expected class from each (:meth:`RankGroup.gather`), every wait
bounded. A rank that sends a :class:`Failure` (or another message than the one expected),
exits (its traceback, or why it has none, in the error), sends what does not decode, or
stays silent past the bound ends the gather with :class:`RankFailed`;
:meth:`RankGroup.close` then ends every process (closing the pipes first, so that a rank
waiting for a command stops by itself; then ``SIGKILL``, each step bounded).

The module knows nothing of staging: the harness gives it the entry point, the jobs and its
messages (:mod:`~staging_contracts.testing._rank_steps`).

**Threads:** one, the caller's, on each side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Final, TypeVar

from .._control.wire import MalformedMessage
from .._run import Supervisor
from .._run._codec import Message, decode, encode

M = TypeVar("M", bound=Message)

JOIN_S: Final = 10.0
"""Longest :meth:`RankGroup.close` waits for the processes to exit by themselves, and a rank's
process to be gone once its pipe said it ended."""


@dataclass(frozen=True, slots=True)
class Failure(Message):
    """A rank's answer in place of the one expected: why it stops, in words (its error and
    traceback)."""

    error: str


class RankFailed(RuntimeError):
    """A rank process failed, died or did not answer in time; the text says which and why.

    Attributes:
        label: the rank (e.g. ``decode rank 0``).
        kind: the name of the message class the parent was waiting for, or of the command
            it could not send.
        sent: the name of the rank's own message class when it sent another
            (:class:`Failure` or a subclass, or any other), else ``None`` (it sent nothing, or
            bytes that do not decode: :attr:`detail` says which).
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

    def send(self, event: Message) -> None:
        """Send ``event`` to the parent."""
        self._conn.send_bytes(encode(event))

    def expect(self, kind: type[M]) -> M:
        """Wait (at most ``bound_s``) for the parent's command of class ``kind``.

        Raises:
            TimeoutError: no command within the bound.
            EOFError: the parent closed the pipe (it gave up on the run).
            MalformedMessage: what came does not decode.
            RuntimeError: a command of another class came.
        """
        if not self._conn.poll(self._bound_s):
            raise TimeoutError(f"no {kind.__name__} command from the parent in {self._bound_s:g}s")
        message = decode(self._conn.recv_bytes()).message
        if not isinstance(message, kind):
            raise RuntimeError(f"expected the command {kind.__name__}, got {message!r}")
        return message

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

    def send(self, indices: Sequence[int], command: Message) -> None:
        """Send ``command`` to the ranks at ``indices``.

        Raises:
            RankFailed: a rank's pipe is closed (it died).
        """
        raw = encode(command)
        for index in indices:
            try:
                self._conns[index].send_bytes(raw)
            except (BrokenPipeError, EOFError, OSError) as exc:
                detail = f"its pipe is closed ({exc})"
                raise RankFailed(self.labels[index], type(command).__name__, None, detail) from None

    def gather(self, indices: Sequence[int], kind: type[M], bound_s: float) -> list[M]:
        """One message of class ``kind`` from each rank at ``indices``, in that order.

        **Blocking:** until every one answered, at most ``bound_s``.

        Raises:
            RankFailed: a rank sent another message (its :class:`Failure`) or one that does
                not decode, exited first, or is still silent after ``bound_s``; the first such
                rank, by arrival.
        """
        name = kind.__name__
        got: dict[int, M] = {}
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
                raise RankFailed(silent, name, None, f"no answer within {bound_s:g}s")
            ends = [self._conns[i] for i in waiting] + [self._ranks[i].sentinel for i in waiting]
            for ready in wait(ends, remaining):
                i = handles[ready]
                if i in got:
                    continue
                conn = self._conns[i]
                if not conn.poll():  # the sentinel: exited; a last message may still be there
                    raise RankFailed(self.labels[i], name, None, self._exited(i))
                try:
                    message = decode(conn.recv_bytes()).message
                except EOFError:
                    raise RankFailed(self.labels[i], name, None, self._exited(i)) from None
                except MalformedMessage as exc:
                    raise RankFailed(self.labels[i], name, None, f"sent {exc}") from None
                if not isinstance(message, kind):
                    detail = message.error if isinstance(message, Failure) else repr(message)
                    raise RankFailed(self.labels[i], name, type(message).__name__, detail)
                got[i] = message
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
