"""Child processes tied to the process that starts them: they end when it dies, in every
phase of their life (importing, joining, loading, idle, mid-step), even when it is killed
with SIGKILL and can clean up nothing.

Each child first runs a few lines of Python that ask Linux for a parent-death signal
(``PR_SET_PDEATHSIG``), check that the parent which started them is still there (closing the
race with a parent that died first), and only then ``exec`` the real command, so nothing of
the child's own (imports included) runs untethered. The kernel sends that signal when the
*thread* that forked the child ends, not the process, so a :class:`Spawner` forks from a
thread of its own that lives until :meth:`Spawner.close`. Where ``prctl`` does not exist the
children start all the same; the ranks Shardline starts also watch their parent themselves.

Python children (:meth:`Spawner.start`) read their target and arguments from a pipe (pickled
with cloudpickle, after ``sys.path`` and the multiprocessing authkey are set to the parent's,
as multiprocessing's own children have them); file descriptors they need are passed by
number. A Spawner given :class:`~shardline.launch.fork_servers.ForkServers` forks them from
a fork server there (:mod:`shardline.launch.fork_server`), which imports the target's module
once for all of them, instead of starting an interpreter for each.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from shardline.launch.fork_server import MAX_FDS
from shardline.launch.process_exit import skip_final_collection

if TYPE_CHECKING:
    from shardline.launch.fork_servers import ForkServer, ForkServers

#: Runs before anything else in a child: argv is PARENT_PID SIGNAL PROGRAM [ARGS...].
_TETHER = """\
import ctypes, os, sys
parent, death_signal = int(sys.argv[1]), int(sys.argv[2])
try:
    ctypes.CDLL(None).prctl(1, death_signal)  # PR_SET_PDEATHSIG
except (AttributeError, OSError):
    pass
if os.getppid() != parent:
    os._exit(128 + death_signal)
os.execvp(sys.argv[3], sys.argv[3:])
"""


def tethered(command: Sequence[str], death_signal: int = signal.SIGKILL) -> list[str]:
    """``command`` behind the tether: the child gets ``death_signal`` when the thread that
    starts it (in this process) ends."""
    return [
        sys.executable,
        "-I",
        "-S",
        "-c",
        _TETHER,
        str(os.getpid()),
        str(int(death_signal)),
        *command,
    ]


class SpawnedChild(Protocol):
    """What :meth:`Spawner.start` returns, exec'd (:class:`ChildProcess`) or forked
    (:class:`ForkedChild`): ``multiprocessing.Process``'s waiting surface."""

    name: str
    #: Readable once the process has ended.
    sentinel: int

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...

    def close(self) -> None: ...


class ChildProcess:
    """A Python child exec'd by :meth:`Spawner.start` (a :class:`SpawnedChild`)."""

    def __init__(self, popen: subprocess.Popen, name: str) -> None:
        self._popen = popen
        self.name = name
        self.pid = popen.pid
        #: Readable once the process has ended (a pidfd).
        self.sentinel = os.pidfd_open(popen.pid)

    @property
    def exitcode(self) -> int | None:
        """None while running; the exit status, or minus the signal that ended it."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def kill(self) -> None:
        if self._popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._popen.kill()

    def close(self) -> None:
        """Release the sentinel (after the process has ended)."""
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


class ForkedChild:
    """A Python child forked by a fork server (a :class:`SpawnedChild`). ``pid`` is None
    until the server has forked it (the server may still be importing); its end and exit
    code come from the server. A child the server never forked (killed before, or the server
    gone) ends with -SIGKILL, as does one whose server died before saying how it ended (its
    children get SIGKILL then)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pid: int | None = None
        #: Readable once the process has ended (an eventfd).
        self.sentinel = os.eventfd(0, os.EFD_CLOEXEC)
        self._pidfd: int | None = None
        self._exitcode: int | None = None
        self._ended = threading.Event()
        self._killed = False
        self._lock = threading.Lock()

    @property
    def exitcode(self) -> int | None:
        """None while running; the exit status, or minus the signal that ended it."""
        return self._exitcode if self._ended.is_set() else None

    def is_alive(self) -> bool:
        return not self._ended.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._ended.wait(timeout)

    def kill(self) -> None:
        with self._lock:
            self._killed = True
            self._signal_kill()

    @property
    def killed(self) -> bool:
        """Whether :meth:`kill` was called (a child not yet forked then never is)."""
        return self._killed

    def close(self) -> None:
        """Release the sentinel and the pidfd (after the process has ended)."""
        with self._lock:
            for fd in (self.sentinel, self._pidfd):
                if fd is not None and fd >= 0:
                    os.close(fd)
            self.sentinel, self._pidfd = -1, None

    def forked(self, pid: int, pidfd: int) -> None:
        """The server forked this child as ``pid`` (``pidfd`` names it, kept here)."""
        with self._lock:
            self.pid, self._pidfd = pid, pidfd
            if self._killed:
                self._signal_kill()

    def ended(self, exitcode: int) -> None:
        """The child ended with ``exitcode`` (the first report counts)."""
        with self._lock:
            if self._ended.is_set():
                return
            self._exitcode = exitcode
            self._ended.set()
            if self.sentinel >= 0:
                os.eventfd_write(self.sentinel, 1)

    def _signal_kill(self) -> None:
        if self._pidfd is not None and not self._ended.is_set():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


class Spawner:
    """Starts tethered children from one thread of its own (see the module docstring).

    Closing it ends the thread, and with it every child still running: close it after the
    children have been stopped. With ``fork_servers``, :meth:`start` forks Python children
    from a server there (held until :meth:`close`).
    """

    def __init__(
        self, name: str = "shardline-spawner", fork_servers: ForkServers | None = None
    ) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        self._fork_servers = fork_servers
        self._held: list[ForkServer] = []
        self._forked: list[ForkedChild] = []

    def popen(
        self, command: Sequence[str], death_signal: int = signal.SIGKILL, **popen_args: Any
    ) -> subprocess.Popen:
        """``subprocess.Popen(tethered(command), **popen_args)``, forked by the spawner's
        thread."""
        argv = tethered(command, death_signal)
        return self._call(lambda: subprocess.Popen(argv, **popen_args))

    def start(
        self,
        target: Callable[..., Any],
        args: Sequence[Any],
        name: str,
        pass_fds: Sequence[int] = (),
        env: Mapping[str, str] | None = None,
    ) -> SpawnedChild:
        """Run ``target(*args)`` in a new Python process, with ``env`` as its environment
        (default: this process's); ``pass_fds`` stay open there under the same numbers (the
        caller may close its own once this returns). Its exit code is 0 when ``target``
        returns, 1 when it raises (the traceback goes to stderr)."""
        # sys.path first (the target may live anywhere the parent can import from), and the
        # parent's multiprocessing authkey, which tensors passed through connections need.
        setting = (list(sys.path), bytes(multiprocessing.current_process().authkey))
        payload = _frame(pickle.dumps(setting)) + _frame(
            _cloudpickle().dumps((target, tuple(args)))
        )
        read_end, write_end = os.pipe()
        try:
            if self._fork_servers is not None:
                child: SpawnedChild = self._fork(
                    self._fork_servers, target, name, read_end, pass_fds, env
                )
            else:
                program = "import sys; from shardline.launch.tether import child_main; "
                program += "child_main(int(sys.argv[1]))"
                popen = self.popen(
                    [sys.executable, "-c", program, str(read_end), name],
                    stdin=subprocess.DEVNULL,
                    pass_fds=(read_end, *pass_fds),
                    env=None if env is None else dict(env),
                )
                child = ChildProcess(popen, name)
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        # Written from a thread: a payload larger than the pipe must not block the caller
        # while the child is still starting.
        threading.Thread(
            target=_write_all, args=(write_end, payload), name=f"{name}-payload", daemon=True
        ).start()
        return child

    def _fork(
        self,
        fork_servers: ForkServers,
        target: Callable[..., Any],
        name: str,
        payload: int,
        pass_fds: Sequence[int],
        env: Mapping[str, str] | None,
    ) -> ForkedChild:
        """Ask a fork server for ranks with ``env`` for the child; returns at once (the
        server may still be importing ``target``'s module)."""
        numbers = [payload, 0, 1, 2, *pass_fds]
        if len(numbers) > MAX_FDS:
            raise ValueError(f"pass_fds: {len(pass_fds)} given; allowed: at most {MAX_FDS - 4}")
        environ = dict(os.environ if env is None else env)
        server = fork_servers.acquire(environ)
        if server in self._held:
            fork_servers.release(server)  # held once per spawner
        else:
            self._held.append(server)
        child = ForkedChild(name)
        fds: list[int] = []
        try:
            fds.append(os.dup(payload))
            fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            fds += [os.dup(number) for number in numbers[2:]]
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        # The calling thread's cores, as an exec'd child inherits them (not the server's).
        cpus = sorted(os.sched_getaffinity(0))
        server.fork(child, environ, numbers, fds, target.__module__, cpus)
        # Children that ended need no kill at close: a long-lived spawner keeps only the rest.
        self._forked = [known for known in self._forked if known.is_alive()]
        self._forked.append(child)
        return child

    def close(self) -> None:
        """End the spawner's thread and every child still running (forked ones are killed;
        one not forked yet never is). Idempotent."""
        for child in self._forked:
            child.kill()
        if self._thread.is_alive():
            self._requests.put(None)
            self._thread.join()
        if self._fork_servers is not None:
            while self._held:
                self._fork_servers.release(self._held.pop())

    def _call(self, action: Callable[[], Any]) -> Any:
        if not self._thread.is_alive():
            raise RuntimeError("the spawner is closed")
        future: Future = Future()
        self._requests.put((action, future))
        return future.result()

    def _serve(self) -> None:
        while (request := self._requests.get()) is not None:
            action, future = request
            try:
                result = action()
            except BaseException as error:
                if future is not None:
                    future.set_exception(error)
            else:
                if future is not None:
                    future.set_result(result)


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data


def _read_frame(source: Any) -> bytes:
    size = int.from_bytes(source.read(8), "little")
    data = source.read(size)
    if len(data) != size or size == 0:
        raise EOFError("the parent closed the payload pipe early")
    return data


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError), os.fdopen(fd, "wb") as sink:
        sink.write(data)


def _cloudpickle():
    import cloudpickle

    return cloudpickle


def child_main(payload: int) -> None:
    """The body of a child of :meth:`Spawner.start`: run what the ``payload`` pipe holds."""
    skip_final_collection()
    try:
        with os.fdopen(payload, "rb") as source:
            sys.path[:], authkey = pickle.loads(_read_frame(source))
            call = _read_frame(source)
    except EOFError:  # the parent died before it sent the payload
        os._exit(1)
    multiprocessing.current_process().authkey = authkey
    target, args = pickle.loads(call)
    try:
        target(*args)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
