"""Tests marked ``alone`` run while no other test does, also under ``pytest -n 2``.

Such a test judges how long something took with a tight slack (a fault must end within its
deadline + 1 s): beside another worker's test on 2 cores it would measure the neighbour. The
other tests run side by side. The workers share a reader-writer lock on two files in a folder
the controller makes when it configures its first worker: every test passes a turnstile, then
holds the lock shared (most tests) or exclusive (``alone``); a test waiting for the exclusive
lock keeps the turnstile, so the other worker starts nothing new meanwhile. The kernel drops a
dead worker's locks.

The ``alone`` tests come first in the run (:func:`first`), and a worker keeps the exclusive
lock from one ``alone`` test to the next: the other worker waits for one run of them, not once
per test behind whatever it started in between.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

MARKER = "alone: runs while no other test runs (it judges time with a tight slack)"
#: The key of the lock folder in a worker's ``workerinput``.
FOLDER_KEY = "shardline_alone_folder"
_FOLDER = pytest.StashKey[str]()
#: The descriptor of the lock a worker holds exclusively from one ``alone`` test to the next.
_HELD = pytest.StashKey[int]()


def first(items: list[pytest.Item]) -> None:
    """Put the ``alone`` tests first (in their order), the others after (in theirs)."""
    items.sort(key=lambda item: not _is_alone(item))


def _is_alone(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


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
def turn(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Hold the lock for ``item``'s whole run (setup, call, teardown), and on to ``nextitem``
    when both are ``alone``; nothing to hold when this process is not an xdist worker."""
    folder = getattr(item.config, "workerinput", {}).get(FOLDER_KEY)
    if folder is None:
        yield
        return
    exclusive = _is_alone(item)
    running = item.config.stash.get(_HELD, None)
    if running is None:
        running = os.open(Path(folder, "running"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        with open(Path(folder, "turnstile"), "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            fcntl.flock(running, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    try:
        yield
    finally:
        if exclusive and _is_alone(nextitem):
            item.config.stash[_HELD] = running
        else:
            if _HELD in item.config.stash:
                del item.config.stash[_HELD]
            os.close(running)  # closing the descriptor releases the lock
