"""Tests marked ``alone`` run while no other test does, also under ``pytest -n 2``.

Such a test judges how long something took with a tight slack (a fault must end within its
deadline + 1 s): beside another worker's test on 2 cores it would measure the neighbour. The
other tests run side by side. The workers share a reader-writer lock on two files in a folder
the controller makes when it configures its first worker: every test passes a turnstile, then
holds the lock shared (most tests) or exclusive (``alone``); a test waiting for the exclusive
lock keeps the turnstile, so the other worker starts nothing new meanwhile. The kernel drops a
dead worker's locks.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

MARKER = "alone: runs while no other test runs (it judges time with a tight slack)"
#: The key of the lock folder in a worker's ``workerinput``.
FOLDER_KEY = "shardline_alone_folder"
_FOLDER = pytest.StashKey[str]()


def hand_to_worker(node) -> None:
    """Give a worker (xdist's node) the controller's lock folder, made for the first one."""
    stash = node.config.stash
    if _FOLDER not in stash:
        stash[_FOLDER] = tempfile.mkdtemp(prefix="shardline-test-locks-")
    node.workerinput[FOLDER_KEY] = stash[_FOLDER]


def remove_folder(config: pytest.Config) -> None:
    folder = config.stash.get(_FOLDER, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def turn(item: pytest.Item) -> Iterator[None]:
    """Hold the lock for ``item``'s whole run (setup, call, teardown); nothing to hold when
    this process is not an xdist worker."""
    folder = getattr(item.config, "workerinput", {}).get(FOLDER_KEY)
    if folder is None:
        yield
        return
    exclusive = item.get_closest_marker("alone") is not None
    with (
        open(Path(folder, "turnstile"), "a") as turnstile,
        open(Path(folder, "running"), "a") as running,
    ):
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(running, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # closing the file releases the lock
