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
number.
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
from typing import Any

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


class ChildProcess:
    """A Python child started by :meth:`Spawner.start`: ``multiprocessing.Process``'s
    waiting surface (``pid``, ``sentinel``, ``exitcode``, ``join``, ``kill``)."""

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


class Spawner:
    """Starts tethered children from one thread of its own (see the module docstring).

    Closing it ends the thread, and with it every child still running: close it after the
    children have been stopped.
    """

    def __init__(self, name: str = "shardline-spawner") -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

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
    ) -> ChildProcess:
        """Run ``target(*args)`` in a new Python process, with ``env`` as its environment
        (default: this process's); ``pass_fds`` stay open there under the same numbers. Its
        exit code is 0 when ``target`` returns, 1 when it raises (the traceback goes to
        stderr)."""
        # sys.path first (the target may live anywhere the parent can import from), and the
        # parent's multiprocessing authkey, which tensors passed through connections need.
        setting = (list(sys.path), bytes(multiprocessing.current_process().authkey))
        payload = _frame(pickle.dumps(setting)) + _frame(
            _cloudpickle().dumps((target, tuple(args)))
        )
        read_end, write_end = os.pipe()
        try:
            program = "from shardline.launch.tether import child_main; child_main()"
            popen = self.popen(
                [sys.executable, "-c", program, str(read_end), name],
                stdin=subprocess.DEVNULL,
                pass_fds=(read_end, *pass_fds),
                env=None if env is None else dict(env),
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        child = ChildProcess(popen, name)
        # Written from a thread: a payload larger than the pipe must not block the caller
        # while the child is still starting.
        threading.Thread(
            target=_write_all, args=(write_end, payload), name=f"{name}-payload", daemon=True
        ).start()
        return child

    def close(self) -> None:
        """End the spawner's thread (and so every child still running). Idempotent."""
        if self._thread.is_alive():
            self._requests.put(None)
            self._thread.join()

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
                future.set_result(action())
            except BaseException as error:
                future.set_exception(error)


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


def child_main() -> None:
    """The body of a child of :meth:`Spawner.start` (argv: PAYLOAD_FD NAME)."""
    try:
        with os.fdopen(int(sys.argv[1]), "rb") as source:
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
