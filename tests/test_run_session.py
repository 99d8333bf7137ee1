"""run_session's bookkeeping of a run's processes: those a launcher starts in sessions of
their own (torchrun's ranks are session leaders) count as the run's, are listed as left
over and killed, also when one holds the run's output open past the deadline."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardline.launch.launchers import RUN_MARKER, launcher_environment, run_session

#: Starts a detached grandchild in a session of its own (as torchrun starts a rank), prints
#: its pid and exits; the grandchild sleeps, with the run's output open unless told to close.
DETACHING = """
import subprocess, sys
keep_output = sys.argv[1] == "keep-output"
child = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(600)"],
    start_new_session=True,
    stdout=None if keep_output else subprocess.DEVNULL,
    stderr=None if keep_output else subprocess.DEVNULL,
)
print(child.pid, flush=True)
"""


def _alive(pid: int, within_s: float = 5.0) -> bool:
    """Whether ``pid`` is still alive ``within_s`` from now (a SIGKILL takes a moment)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        if state == "Z":
            return False
        time.sleep(0.05)
    return True


def _kill_if_left(pid: int) -> None:
    """SIGKILL the sleeper this test's run started, should it have survived (through a pidfd,
    and only while it still runs the sleeper's command)."""
    with contextlib.suppress(ProcessLookupError):
        pidfd = os.pidfd_open(pid)
        try:
            if b"time.sleep(600)" in Path(f"/proc/{pid}/cmdline").read_bytes():
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)


@pytest.mark.timeout(60)
def test_a_process_in_a_session_of_its_own_is_left_over_and_killed():
    run = run_session([sys.executable, "-c", DETACHING, "close-output"], launcher_environment(), 30)
    pid = int(run.stdout.split()[0])
    try:
        assert run.returncode == 0 and not run.timed_out
        assert run.leftovers == [pid]
        assert not _alive(pid)
    finally:
        _kill_if_left(pid)


@pytest.mark.timeout(60)
def test_a_process_holding_the_output_past_the_deadline_is_killed_and_the_run_ends():
    began = time.monotonic()
    run = run_session([sys.executable, "-c", DETACHING, "keep-output"], launcher_environment(), 3)
    pid = int(run.stdout.split()[0])
    try:
        assert run.timed_out
        assert time.monotonic() - began < 20  # before: blocked on the output for 600 s
        assert not _alive(pid)
    finally:
        _kill_if_left(pid)


def test_another_process_with_a_similar_environment_is_not_the_runs():
    """The marker is the run's own: a process started outside the run is never touched."""
    outsider = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, RUN_MARKER: "not-this-run"},
    )
    try:
        run = run_session([sys.executable, "-c", "pass"], launcher_environment(), 30)
        assert run.leftovers == []
        assert outsider.poll() is None
    finally:
        outsider.kill()
        outsider.wait()
