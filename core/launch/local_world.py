"""LocalWorld: N ranks as processes on this host, driven by function calls from the parent.

Each rank process joins the world through a *setup* callable (e.g. "init the gloo world"),
then runs functions the parent sends it, one at a time, and sends back the result or the
exception. Used by the conformance suite (worlds started once and reused) and by the demo.

Guarantees: every wait has a deadline; a rank that dies is reported with its exit code; a
rank whose parent dies exits on its own (its command pipe closes); :meth:`LocalWorld.close`
is idempotent and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from shardline.comm.store import serve_store
from shardline.errors import CommTimeoutError, PeerLostError, WorkerError
from shardline.interfaces.communicator_backend import Rendezvous

_STOP = "stop"
_JOIN_GRACE_S = 5.0


class LocalWorld:
    """``world_size`` rank processes running ``setup(rank, world_size, rendezvous)`` once,
    then the functions given to :meth:`run` as ``fn(context, *args, **kwargs)`` where
    ``context`` is what ``setup`` returned (it may have a ``close()`` method).

    ``setup`` and every function must be picklable (module-level), as ranks are spawned.
    """

    def __init__(
        self,
        world_size: int,
        setup: Callable[[int, int, Rendezvous], Any],
        start_timeout_s: float = 120.0,
        call_timeout_s: float = 120.0,
    ) -> None:
        self.world_size = world_size
        self.call_timeout_s = call_timeout_s
        self.broken: str | None = None
        self._store, self.rendezvous = serve_store(timeout_s=start_timeout_s)
        context = multiprocessing.get_context("spawn")
        self._connections: list[multiprocessing.connection.Connection] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        try:
            for rank in range(world_size):
                parent_end, child_end = context.Pipe()
                process = context.Process(
                    target=_rank_main,
                    args=(rank, world_size, self.rendezvous, setup, child_end),
                    name=f"shardline-rank-{rank}",
                    daemon=True,
                )
                process.start()
                child_end.close()
                self._connections.append(parent_end)
                self._processes.append(process)
            self._collect("start-up", range(world_size), start_timeout_s)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(context, *args, **kwargs)`` on every rank; return results in rank order.

        Raises :class:`WorkerError` for the first rank (lowest) that raised,
        :class:`PeerLostError` for a rank that died, :class:`CommTimeoutError` naming the
        ranks that did not answer within ``timeout_s`` (default ``call_timeout_s``). After
        a death or a timeout the world is marked :attr:`broken` and refuses further calls.
        """
        if self.broken is not None:
            raise PeerLostError(
                f"this world is unusable: {self.broken}", op=getattr(fn, "__name__", "run")
            )
        for connection in self._connections:
            connection.send((fn, args, kwargs))
        name = getattr(fn, "__name__", repr(fn))
        return self._collect(name, range(self.world_size), timeout_s or self.call_timeout_s)

    def close(self) -> None:
        """Stop every rank (politely, then by force). Idempotent."""
        for connection in self._connections:
            with contextlib.suppress(OSError, ValueError):
                connection.send(_STOP)
        deadline = time.monotonic() + _JOIN_GRACE_S
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(_JOIN_GRACE_S)
        for connection in self._connections:
            connection.close()
        self._connections = []
        self._processes = []
        self.broken = self.broken or "closed"

    def _collect(self, what: str, ranks: Sequence[int] | range, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        pending = {self._connections[r]: r for r in ranks}
        replies: dict[int, tuple] = {}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                silent = sorted(pending.values())
                self.broken = f"ranks {silent} did not answer {what} within {timeout_s:g} s"
                raise CommTimeoutError(self.broken, op=what)
            sentinels = {self._processes[r].sentinel: r for r in pending.values()}
            ready = multiprocessing.connection.wait([*pending, *sentinels], remaining)
            for connection in [c for c in ready if c in pending]:
                rank = pending.pop(connection)
                try:
                    replies[rank] = connection.recv()
                except (EOFError, OSError):
                    replies[rank] = self._death(rank, what)
            for sentinel in [s for s in ready if s in sentinels]:
                rank = sentinels[sentinel]
                connection = self._connections[rank]
                if connection in pending and not connection.poll():
                    pending.pop(connection)
                    replies[rank] = self._death(rank, what)
        results = []
        for rank in sorted(replies):
            kind, *payload = replies[rank]
            if kind == "error":
                exc_type, message, remote_traceback = payload
                raise WorkerError(
                    message, rank=rank, exc_type=exc_type, remote_traceback=remote_traceback
                )
            if kind == "lost":
                raise PeerLostError(payload[0], op=what, rank=rank)
            results.append(payload[0])
        return results

    def _death(self, rank: int, what: str) -> tuple:
        process = self._processes[rank]
        process.join(1.0)
        self.broken = (
            f"rank {rank} (pid {process.pid}) exited with code {process.exitcode} during {what}"
        )
        return ("lost", self.broken)


def _rank_main(
    rank: int,
    world_size: int,
    rendezvous: Rendezvous,
    setup: Callable[[int, int, Rendezvous], Any],
    connection: multiprocessing.connection.Connection,
) -> None:
    """Body of a rank process: set up, report, then serve calls until told to stop."""
    parent = os.getppid()
    try:
        context = setup(rank, world_size, rendezvous)
    except BaseException as error:
        connection.send(_error_reply(error))
        return
    connection.send(("ok", None))
    try:
        while True:
            # Block in the kernel, waking each second to notice a parent that died.
            if not connection.poll(1.0):
                if os.getppid() != parent:
                    return
                continue
            try:
                message = connection.recv()
            except (EOFError, OSError):
                return
            if message == _STOP:
                return
            fn, args, kwargs = message
            try:
                reply = ("ok", fn(context, *args, **kwargs))
            except BaseException as error:
                reply = _error_reply(error)
            connection.send(reply)
    finally:
        close = getattr(context, "close", None)
        if callable(close):
            close()


def _error_reply(error: BaseException) -> tuple:
    return ("error", type(error).__name__, str(error), traceback.format_exc())
