"""Starting replicas' executors one after another or all at once (shardline.engine.starting)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from shardline.engine.starting import start_all


class Starts:
    """Records what was started and stopped; ``before(index)`` runs in each start."""

    def __init__(self, before=lambda index: None, failing=()) -> None:
        self.before = before
        self.failing = set(failing)
        self.started: list[int] = []
        self.stopped: list[str] = []
        self.lock = threading.Lock()

    def start(self, index: int) -> str:
        with self.lock:
            self.started.append(index)
        self.before(index)
        if index in self.failing:
            raise RuntimeError(f"start {index} failed")
        return f"executor {index}"

    def stop(self, value: str) -> None:
        with self.lock:
            self.stopped.append(value)


def test_one_after_another_a_failure_stops_those_started_and_starts_no_more():
    starts = Starts(failing={1})
    assert start_all(Starts().start, 3, False, starts.stop) == [
        "executor 0",
        "executor 1",
        "executor 2",
    ]
    with pytest.raises(RuntimeError, match="start 1 failed"):
        start_all(starts.start, 3, False, starts.stop)
    assert starts.started == [0, 1]
    assert starts.stopped == ["executor 0"]


def test_concurrently_every_start_runs_at_once_and_the_values_keep_their_order():
    meeting = threading.Barrier(3, timeout=20)  # broken unless all three wait at once
    starts = Starts(before=lambda index: meeting.wait())
    assert start_all(starts.start, 3, True, starts.stop) == [
        "executor 0",
        "executor 1",
        "executor 2",
    ]
    assert sorted(starts.started) == [0, 1, 2]
    assert starts.stopped == []


def _eventually_stopped(starts: Starts, count: int) -> list[str]:
    """What ``starts`` stopped once ``count`` values were (a start still running when the
    error was raised stops its own value when it returns), each stopped once."""
    deadline = time.monotonic() + 20
    while len(starts.stopped) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # a second stop of any would show by now
    return sorted(starts.stopped)


def test_concurrently_a_failure_stops_every_start_that_succeeded_and_raises_it():
    meeting = threading.Barrier(4, timeout=20)
    starts = Starts(before=lambda index: meeting.wait(), failing={1, 3})
    with pytest.raises(RuntimeError, match=r"start [13] failed"):
        start_all(starts.start, 4, True, starts.stop)
    assert _eventually_stopped(starts, 2) == ["executor 0", "executor 2"]


def test_concurrently_a_failure_is_raised_without_waiting_for_a_start_still_running():
    """A replica that fails ends the start at once, while another still waits for its
    ranks; that one stops its own value once its start returns."""
    release = threading.Event()
    starts = Starts(before=lambda index: index == 0 and release.wait(20), failing={1})
    begun = time.monotonic()
    with pytest.raises(RuntimeError, match="start 1 failed"):
        start_all(starts.start, 2, True, starts.stop)
    assert time.monotonic() - begun < 10, "the failure waited for the start still running"
    assert starts.stopped == []
    release.set()
    assert _eventually_stopped(starts, 1) == ["executor 0"]


#: Run in a process of its own: a test runner's worker may ignore SIGINT, or run tests in a
#: thread other than the main one, where no signal interrupts a wait.
_INTERRUPTED = """
import signal, threading, time
from shardline.engine.starting import start_all

signal.signal(signal.SIGINT, signal.default_int_handler)
release, lock, stopped = threading.Event(), threading.Lock(), []
main = threading.main_thread().ident

def start(index):
    if index == 1:
        signal.pthread_kill(main, signal.SIGINT)
        release.wait(20)
    return f"executor {index}"

def stop(value):
    with lock:
        stopped.append(value)

try:
    start_all(start, 2, True, stop)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted, executor 1 stopped:", "executor 1" in stopped)
release.set()
deadline = time.monotonic() + 20
while len(stopped) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.1)  # a second stop of either would show by now
print("stopped:", sorted(stopped))
"""


def test_an_interrupt_while_starting_raises_at_once_and_every_value_is_stopped_once():
    """The waiting thread is interrupted (SIGINT) while start 1 still runs: the interrupt is
    raised without waiting for it; start 0's value is stopped (by the waiting thread, or by
    its own once it sees the interrupt), start 1's by its own thread once it returns."""
    result = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "interrupted, executor 1 stopped: False",
        "stopped: ['executor 0', 'executor 1']",
    ]
