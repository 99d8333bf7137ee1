"""Running a command with a /dev/shm of its own, so that what it leaves there is its own and
no other job's segment is seen or touched: the fault suite's leak check, and tests of whole
commands (``shardline run``, worlds under torchrun or mpiexec).

The command runs in a new mount namespace (``unshare``: as root, or where unprivileged user
namespaces are allowed) in which a directory made for the run inside the host's /dev/shm is
bind-mounted over /dev/shm. Whatever the run creates in /dev/shm lands in that directory,
which :meth:`PrivateShm.entries` lists and :meth:`PrivateShm.close` removes, leaks included.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

#: Mounts the run's directory (argument 0) over /dev/shm, then runs the command in place.
_MOUNT_AND_RUN = 'mount --bind "$0" /dev/shm && exec "$@"'


@functools.cache
def unavailable_reason() -> str | None:
    """Why a private /dev/shm cannot be made here, or None (probed once per process)."""
    if shutil.which("unshare") is None:
        return "the unshare command (util-linux) is not installed"
    with tempfile.TemporaryDirectory(prefix="shardline-probe-", dir=_shm_root()) as folder:
        probe = subprocess.run(
            [*_unshare(), "sh", "-c", _MOUNT_AND_RUN, folder, "true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    if probe.returncode != 0:
        return (
            "cannot make a mount namespace (needs root, or unprivileged user namespaces): "
            f"{probe.stderr.strip()[:200]}"
        )
    return None


class PrivateShm:
    """A directory standing in for /dev/shm in the commands :meth:`wrap` runs. Use as a
    context manager; raises RuntimeError with :func:`unavailable_reason` where it cannot
    work."""

    def __init__(self) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"no private /dev/shm here: {reason}")
        self.directory = Path(tempfile.mkdtemp(prefix="shardline-private-shm-", dir=_shm_root()))

    def wrap(self, command: Sequence[str]) -> list[str]:
        """``command`` run with this directory as its /dev/shm (the same process: it receives
        the caller's signals)."""
        return [*_unshare(), "sh", "-c", _MOUNT_AND_RUN, str(self.directory), *command]

    def entries(self) -> list[str]:
        """What the runs left in their /dev/shm."""
        return sorted(os.listdir(self.directory))

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PrivateShm:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _unshare() -> list[str]:
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--mount", "--propagation", "private", "--"]


def _shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
