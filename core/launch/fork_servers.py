"""The fork servers of one process (:mod:`shardline.launch.fork_server`), shared by its worlds.

A driver that starts many worlds one after another (a test run, ``shardline conformance``, a
program that makes an ``LLM`` more than once) would otherwise pay a server start and an
``import torch`` per world. Worlds share a server when their ranks' environments and this
process's ``sys.path`` match (what the server's own imports saw); a server ends
``linger_s`` after the last world using it lets go, or with this process at the latest
(servers are tethered to a thread of their :class:`ForkServers`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from shardline.launch.tether import ForkedChild, Spawner

#: Environment variables that change from one call to the next in a driver and that nothing
#: reads at import (pytest names the running test in one): environments that differ only in
#: these share a server.
CALL_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})


class ForkServer:
    """This end of one fork server: its process, a thread that sends it requests one at a
    time (so a caller never waits for the server's imports), and a thread that reads how
    each child ended."""

    def __init__(
        self,
        popen: Callable[..., subprocess.Popen],
        environ: dict[str, str],
        preload: Sequence[str] = (),
    ) -> None:
        """Start the server with ``popen`` (a Spawner's, so tethered) and ``environ``; it
        imports the modules ``preload`` names at once."""
        self._requests, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ends, ends_write = os.pipe()
        try:
            program = "from shardline.launch.fork_server import main; main()"
            self.process = popen(
                [sys.executable, "-c", program, str(theirs.fileno()), str(ends_write)],
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(), ends_write),
                env=environ,
            )
        except BaseException:
            self._requests.close()
            os.close(ends)
            raise
        finally:
            theirs.close()
            os.close(ends_write)
        authkey = bytes(multiprocessing.current_process().authkey)
        with contextlib.suppress(OSError):  # a server already gone is seen as the ends close
            self._requests.send(pickle.dumps((list(sys.path), authkey, tuple(preload))))
        self._lock = threading.Lock()
        self._children: dict[int, ForkedChild] = {}  # by pid, until they end
        self._early_ends: dict[int, int] = {}  # pid -> exit code, read before the fork reply
        self._gone = False
        self._closed = False
        #: Whether a child was ever asked of it.
        self.asked = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=target, args=args, name=name, daemon=True)
            for target, args, name in (
                (self._read_ends, (ends,), "shardline-fork-server-ends"),
                (self._send_requests, (), "shardline-fork-server-requests"),
            )
        ]
        for thread in self._threads:
            thread.start()

    def fork(
        self,
        child: ForkedChild,
        env: dict[str, str],
        numbers: list[int],
        fds: list[int],
        module: str,
        cpus: list[int],
    ) -> None:
        """Have the server fork ``child`` (importing ``module`` first if it has not) with
        ``fds`` placed at ``numbers`` (closed here), ``env``, on ``cpus``; returns at once. A child
        killed before its turn comes, or asked of a closed server, is never forked."""
        with self._lock:
            if not self._closed:
                self.asked = True
                self._queue.put((child, env, numbers, fds, module, cpus))
                return
        for fd in fds:
            os.close(fd)
        child.ended(-signal.SIGKILL)

    def is_alive(self) -> bool:
        """False once the server's end of its ends pipe closed (it exits: its file descriptors
        close before the kernel lets it be reaped) or it was reaped."""
        with self._lock:
            if self._gone:
                return False
        return self.process.poll() is None

    def close(self) -> None:
        """Kill the server (and so every child it forked), reap it and release everything."""
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()
        with self._lock:
            self._closed = True
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._requests.close()

    def _send_requests(self) -> None:
        while (request := self._queue.get()) is not None:
            child, env, numbers, fds, module, cpus = request
            try:
                if child.killed:
                    data, got = b"", []
                else:
                    packet = pickle.dumps((child.name, env, numbers, module, cpus))
                    socket.send_fds(self._requests, [packet], fds)
                    data, got, _, _ = socket.recv_fds(self._requests, 4096, 1)
            except OSError:
                data, got = b"", []
            finally:
                for fd in fds:
                    os.close(fd)
            if not data or not got:
                child.ended(-signal.SIGKILL)  # never forked: killed first, or the server gone
                continue
            pid = pickle.loads(data)
            child.forked(pid, got[0])
            with self._lock:
                code = self._early_ends.pop(pid, None)
                if code is None and not self._gone:
                    self._children[pid] = child
            if code is not None or self._gone:
                child.ended(-signal.SIGKILL if code is None else code)

    def _read_ends(self, ends: int) -> None:
        with os.fdopen(ends, "rb") as lines:
            for line in lines:
                pid, code = (int(word) for word in line.split())
                with self._lock:
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._early_ends[pid] = code
                if child is not None:
                    child.ended(code)
        with self._lock:
            self._gone = True
            orphans, self._children = list(self._children.values()), {}
        for child in orphans:
            child.ended(-signal.SIGKILL)


@dataclass
class _Hold:
    """Who holds a server: how many, and since when none has."""

    key: tuple
    users: int = 0
    idle_since: float = 0.0


class ForkServers:
    """Fork servers shared by the worlds of this process: one per ranks' environment (less
    :data:`CALL_VARIABLES`) and ``sys.path``, started by the first :meth:`acquire` for it,
    ended ``linger_s`` after the last :meth:`release` (an idle server keeps what it imported
    in memory), or by :meth:`close`. Each is tethered to this object's thread.
    :meth:`process_wide` is the one :class:`~shardline.launch.runtime.RankProcesses` uses."""

    _process_wide: ClassVar[ForkServers | None] = None
    _process_wide_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, linger_s: float = 60.0, name: str = "shardline-fork-servers") -> None:
        self.linger_s = linger_s
        self._spawner = Spawner(name)
        self._lock = threading.Lock()
        self._current: dict[tuple, ForkServer] = {}
        self._holds: dict[ForkServer, _Hold] = {}
        self._closed = False

    @classmethod
    def process_wide(cls) -> ForkServers:
        """This process's shared instance (made on first use; a forked copy of this process
        makes its own)."""
        with cls._process_wide_lock:
            if cls._process_wide is None:
                cls._process_wide = cls(name="shardline-process-fork-servers")
            return cls._process_wide

    def acquire(self, environ: Mapping[str, str], preload: Sequence[str] = ()) -> ForkServer:
        """A live server for ranks with ``environ``, held until :meth:`release`; one started
        for it imports ``preload`` at once. Raises RuntimeError once :meth:`close` was
        called."""
        key = (
            tuple(sorted((k, v) for k, v in environ.items() if k not in CALL_VARIABLES)),
            tuple(sys.path),
        )
        dead = None
        with self._lock:
            if self._closed:
                raise RuntimeError("these fork servers are closed")
            server = self._current.get(key)
            if server is not None and not server.is_alive():
                # Killed from outside: its holders close it as they let go, or now if none.
                del self._current[key]
                if self._holds[server].users == 0:
                    del self._holds[server]
                    dead = server
                server = None
            if server is None:
                server = ForkServer(self._spawner.popen, dict(environ), preload)
                self._current[key] = server
                self._holds[server] = _Hold(key)
            self._holds[server].users += 1
        if dead is not None:
            dead.close()
        return server

    def prepare(self, environ: Mapping[str, str], module: str) -> ForkServer:
        """Have a server for ranks with ``environ`` import ``module`` now, in the background:
        one started for it where none runs (it waits ``linger_s`` for its first world); one
        already running imports it with its first request for it, as before. The ranks'
        imports then overlap what this process does before it starts them. Returns the
        server (for :meth:`end_if_unused`)."""
        server = self.acquire(environ, (module,))
        self.release(server)
        return server

    def end_if_unused(self, server: ForkServer) -> None:
        """End ``server`` now where nothing holds it and no child was ever asked of it (one
        :meth:`prepare` started for ranks that will not come: a refused config); else leave
        it, to end as usual."""
        with self._lock:
            hold = self._holds.get(server)
            if hold is None or hold.users > 0 or server.asked:
                return
            self._forget(server)
        server.close()

    def release(self, server: ForkServer) -> None:
        """Let go of ``server`` (once per :meth:`acquire`; nothing once :meth:`close` ended
        it)."""
        with self._lock:
            hold = self._holds.get(server)
            if hold is None:
                return
            hold.users -= 1
            if hold.users > 0:
                return
            hold.idle_since = idle_since = time.monotonic()
            retired = self._current.get(hold.key) is not server or not server.is_alive()
            if retired:
                self._forget(server)
        if retired:
            server.close()
            return
        timer = threading.Timer(self.linger_s, self._end_if_idle, (server, idle_since))
        timer.daemon = True
        timer.start()

    def close(self) -> None:
        """End every server (and so every child forked from them) and this object's thread."""
        with self._lock:
            self._closed = True
            servers = list(self._holds)
            self._current.clear()
            self._holds.clear()
        for server in servers:
            server.close()
        self._spawner.close()

    def _end_if_idle(self, server: ForkServer, idle_since: float) -> None:
        with self._lock:
            hold = self._holds.get(server)
            # Held again since (and perhaps let go again: a later timer decides).
            if hold is None or hold.users > 0 or hold.idle_since != idle_since:
                return
            self._forget(server)
        server.close()

    def _forget(self, server: ForkServer) -> None:
        key = self._holds.pop(server).key
        if self._current.get(key) is server:
            del self._current[key]


def _forget_process_wide_in_child() -> None:
    # A forked copy of this process shares the servers' sockets but not the threads that use
    # them: it starts its own servers.
    ForkServers._process_wide = None
    ForkServers._process_wide_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_process_wide_in_child)
