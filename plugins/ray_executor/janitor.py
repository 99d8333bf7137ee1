"""Cleans up after a local Ray instance once the process that started it is gone, however it
ended (a SIGKILL included): ends the instance's processes still running and removes its
folder. Run as ``python -m shardline_ray.janitor FOLDER PID`` with a pipe from process PID
on stdin (:func:`watch_over`): the janitor waits for the pipe's end, which the kernel closes
when that process dies, or which it closes itself once it has stopped the instance.

Ray's processes rename themselves (``ray::DashboardAgent``), so the instance's are told by
what they hold open: a process with a file open under FOLDER is the instance's (its logs
are there), PID itself excepted. Nothing else is signalled.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

#: How long the janitor keeps ending processes and removing the folder (a Ray agent may still
#: be writing its logs there) before it gives up.
_SETTLE_S = 30.0
#: How long the process that started the instance waits for the janitor after closing its
#: pipe.
_JOIN_S = 10.0


def watch_over(folder: str) -> subprocess.Popen:
    """Start the janitor of ``folder`` (in a session of its own, so that a Ctrl-C or a hang-up
    of this process's terminal does not end it first); :func:`dismiss` ends it."""
    return subprocess.Popen(
        [sys.executable, "-m", "shardline_ray.janitor", folder, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


def dismiss(janitor: subprocess.Popen) -> None:
    """Close the janitor's pipe (the instance is stopped: it has nothing left to end) and wait
    for it."""
    janitor.stdin.close()
    try:
        janitor.wait(_JOIN_S)
    except subprocess.TimeoutExpired:
        janitor.kill()
        janitor.wait()


def clean(folder: str, spared: int, settle_s: float = _SETTLE_S) -> None:
    """End the processes holding files under ``folder`` open (but ``spared``) and remove it,
    again until neither is left or ``settle_s`` has passed."""
    deadline = time.monotonic() + settle_s
    while True:
        for pid in holders(folder, spared):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
        left = holders(folder, spared)
        if (not os.path.exists(folder) and not left) or time.monotonic() > deadline:
            return
        time.sleep(0.5)


def holders(folder: str, spared: int) -> list[int]:
    """The processes, but this one and ``spared``, with a file under ``folder`` open."""
    inside = os.path.join(folder, "")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (os.getpid(), spared):
            continue
        try:
            descriptors = os.listdir(f"/proc/{entry}/fd")
        except OSError:  # gone, or not ours to read
            continue
        for descriptor in descriptors:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/fd/{descriptor}").startswith(inside):
                    found.append(int(entry))
                    break
    return found


def main(argv: list[str]) -> int:
    folder, starter = argv
    sys.stdin.buffer.read()  # until the pipe's end: its process is gone or has cleaned up
    clean(folder, spared=int(starter))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
