"""A fork server: one Python process that imports what ranks need (torch, Shardline, the
ranks' own modules) once, then forks each rank from itself. A rank started with ``exec`` pays
an interpreter start and ``import torch`` (about 2 s of CPU on a 2-core host); ranks forked
from one server pay it once, whichever world they belong to (see
:class:`~shardline.launch.fork_servers.ForkServers`).

The server is a tethered child of a :class:`~shardline.launch.tether.Spawner` (it ends when
the Spawner's thread ends, or when it is killed). It ignores SIGINT (Ctrl-C is the driver's to
handle) and is single-threaded, so each child it forks asks for SIGKILL when the server ends
(``PR_SET_PDEATHSIG`` follows the forking thread) and checks that the server is still its
parent: the chain keeps the tether's promise. A child gets what an exec'd child of the Spawner
would have: SIGINT's default back, the caller's standard input, output and error and its
passed descriptors at their numbers and no other descriptor, the environment it was given,
and its name as its command line (``ps``, ``/proc/PID/cmdline``; cut to the server's own
command line's length).

Protocol, over a SOCK_SEQPACKET socket pair: the first packet is the pickled
``(sys.path, authkey, preload)``, ``preload`` the modules to import at once (before any
request: a driver that knows its ranks' module lets the server import it while it does other
work); then each request is one packet, the pickled
``(name, env, numbers, module, cpus)`` carrying the descriptors to place at ``numbers``,
whose first is the payload pipe :func:`~shardline.launch.tether.child_main` reads; the server
imports ``module`` (the target's) first if it has not yet, and the child runs on ``cpus``
(the asking thread's, as an exec'd child would inherit them). Its reply, the pickled child pid
carrying a pidfd of the child. Each child's end goes out on a pipe as a line ``PID CODE``
(CODE as :attr:`subprocess.Popen.returncode`: minus the signal that ended it).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import multiprocessing
import os
import pickle
import selectors
import signal
import socket
import sys
from dataclasses import dataclass

#: The most descriptors one request carries (standard three, payload pipe, passed ones).
MAX_FDS = 64
#: Largest request or first packet.
MAX_PACKET = 1 << 20
_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class _Child:
    """What a forked child becomes: ``fds`` maps each number to place to a descriptor."""

    name: str
    env: dict[str, str]
    fds: dict[int, int]
    server: int
    cpus: list[int]

    @property
    def payload(self) -> int:
        """The number of the payload pipe (the first asked for)."""
        return next(iter(self.fds))


def main() -> None:
    """The server's body (argv: REQUESTS_FD STATUSES_FD); in a forked child, the child's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests = socket.socket(fileno=int(sys.argv[1]))
    statuses = int(sys.argv[2])
    sys.path[:], authkey, preload = pickle.loads(requests.recv(MAX_PACKET))
    multiprocessing.current_process().authkey = authkey
    for module in preload:
        _preload(module)
    child = _serve(requests, statuses)
    if child is not None:
        _become(child)
        from shardline.launch.tether import child_main

        child_main(child.payload)


def _serve(requests: socket.socket, statuses: int) -> _Child | None:
    """Fork a child per request and report each child's end, until the requests' other end
    closes (None: the server ends, and its children with it). In a forked child, returns
    what the child becomes."""
    server = os.getpid()
    children: dict[int, int] = {}  # pidfd -> pid
    with selectors.DefaultSelector() as selector:
        selector.register(requests, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is not requests:
                    pidfd = key.fd
                    selector.unregister(pidfd)
                    pid = children.pop(pidfd)
                    os.close(pidfd)
                    _, status = os.waitpid(pid, 0)
                    os.write(statuses, f"{pid} {os.waitstatus_to_exitcode(status)}\n".encode())
                    continue
                data, fds, _, _ = socket.recv_fds(requests, MAX_PACKET, MAX_FDS)
                if not data:
                    return None
                name, env, numbers, module, cpus = pickle.loads(data)
                if module not in sys.modules:
                    _preload(module)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    requests.close()
                    os.close(statuses)
                    for other in children:
                        os.close(other)
                    return _Child(name, env, dict(zip(numbers, fds, strict=True)), server, cpus)
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                socket.send_fds(requests, [pickle.dumps(pid)], [pidfd])
                children[pidfd] = pid
                selector.register(pidfd, selectors.EVENT_READ)


def _preload(module: str) -> None:
    """Import ``module`` here, once for every child that runs a target of it."""
    # A module that fails here fails again in the child, which reports why.
    with contextlib.suppress(Exception):
        importlib.import_module(module)
    # What the server holds lives as long as each child: out of the cyclic collector's
    # sight, and no child's collection touches (and so copies) those pages.
    gc.collect()
    gc.freeze()


def _become(child: _Child) -> None:
    """Turn this freshly forked process into ``child`` (see the module docstring)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != child.server:  # the server died before the signal was asked for
        os._exit(128 + signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(OSError):  # a core gone offline since: the server's stay
        os.sched_setaffinity(0, child.cpus)
    # Out of the way of the numbers first, then placed; every other descriptor closed.
    above = max(*child.fds, *child.fds.values()) + 1
    moved = {number: os.dup2(fd, above + i) for i, (number, fd) in enumerate(child.fds.items())}
    for fd in child.fds.values():
        os.close(fd)
    for number, fd in moved.items():
        os.dup2(fd, number)
    low = 0
    for number in sorted(child.fds):
        if number > low:  # closerange(n, n) closes every descriptor from n (Python 3.11)
            os.closerange(low, number)
        low = number + 1
    os.closerange(low, 1 << 20)
    os.environ.clear()
    os.environ.update(child.env)
    _set_command_line(libc, child.name)


def _set_command_line(libc: ctypes.CDLL, title: str) -> None:
    """Write ``title`` over this process's argument area (what /proc/PID/cmdline and ``ps``
    show; cut to the area's length) and set its short name (``comm``).

    The area ends in a space, not a NUL: Linux then reads the command line as a string (up
    to its first NUL, as for setproctitle), so it is ``title`` alone, not padded with NULs.
    """
    libc.prctl(_PR_SET_NAME, title.encode()[:15])
    with open("/proc/self/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    # Fields 48 and 49 of stat (arg_start, arg_end); ``fields`` begins at field 3.
    start, end = int(fields[45]), int(fields[46])
    if end - start < 2:
        return
    text = title.encode()[: end - start - 2] + b"\0"
    ctypes.memset(start, ord(" "), end - start)
    ctypes.memmove(start, text, len(text))
