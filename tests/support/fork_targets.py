"""Targets for children forked from a Spawner's fork server (tests/test_fork_server.py)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path


def describe(report: str, fd: int) -> None:
    """Write what this child sees to ``report`` (JSON), then write its pid to ``fd``."""
    with open("/proc/self/cmdline", "rb") as command:
        cmdline = command.read().decode()
    open_fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
    facts = {
        "pid": os.getpid(),
        "parent": os.getppid(),
        "cmdline": cmdline,
        "stdin": os.readlink("/proc/self/fd/0"),
        "open_fds": open_fds,
        "marker": os.environ.get("FORK_TEST_MARKER"),
        "test": os.environ.get("PYTEST_CURRENT_TEST"),
        "cpus": sorted(os.sched_getaffinity(0)),
        "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    }
    Path(report).write_text(json.dumps(facts))
    os.write(fd, str(os.getpid()).encode())


def fail() -> None:
    raise RuntimeError("this child fails on purpose")


def sleep_then_mark(marker: str) -> None:
    time.sleep(60)
    Path(marker).touch()
