"""A rank stopped with SIGSTOP in the middle of a step, on a loaded host: the error names the
stopped rank, never the rank that was waiting on it, and arrives within the deadline + 1 s
of the stop; shutting down afterwards takes under a second."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from shardline.config import load_config
from shardline.conformance.executors import probe
from shardline.errors import CommTimeoutError, WorkerError
from shardline.registry import Registry
from support.slow_runner import COMPUTE_S

pytestmark = [pytest.mark.timeout(180), pytest.mark.alone]  # named within the deadline

DEADLINE_S = 3.0
HOG = "while True: pass"


@pytest.fixture
def loaded_host():
    """Two processes spinning on this host's CPUs for the length of the test."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2)]
    yield
    for hog in hogs:
        hog.kill()
        hog.wait()


def _executor():
    config = load_config(
        overrides=[
            "parallel.tensor_parallel_size=2",
            "parallel.distributed_executor_backend=mp",
            "parallel.communicator=gloo",
            f"parallel.timeout_s={DEADLINE_S}",
            "model.runner=support.slow_runner:SlowCollectiveRunner",
        ],
        environ={},
    ).config
    return Registry.load().get("executor", "mp").load_available()(config)


@pytest.mark.parametrize("attempt", range(3))
def test_a_stopped_rank_is_named_within_the_deadline(loaded_host, attempt):
    executor = _executor()
    pids = [pid for _, pid in executor.collective_rpc(probe.rank_and_pid)]
    outcome = {}

    def step():
        try:
            executor.execute_model(probe_step()).result()
        except (CommTimeoutError, WorkerError) as error:
            outcome["error"], outcome["at"] = error, time.monotonic()

    try:
        caller = threading.Thread(target=step)
        caller.start()
        # Rank 1 stops while computing; rank 0 then waits for it in the all-reduce, which it
        # enters a second after the call began (so a deadline counted from the call would
        # fire before rank 0's own and blame rank 0).
        time.sleep(COMPUTE_S / 4)
        os.kill(pids[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        caller.join(DEADLINE_S + 30)
        error = outcome["error"]
        elapsed = outcome["at"] - stopped_at
        message = str(error)
        heartbeat = re.search(r"rank 1 \(pid \d+, no heartbeat for [\d.]+ s\) stopped", message)
        assert heartbeat or "rank 1 did not report" in message, message  # the watchdog's words
        assert elapsed <= DEADLINE_S + 1.0, f"named after {elapsed:.2f} s: {message}"
    finally:
        started = time.monotonic()
        executor.shutdown()
        shutdown_s = time.monotonic() - started
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert shutdown_s < 1.0, f"shutdown took {shutdown_s:.1f} s"


def probe_step():
    from shardline.interfaces.step import NewRequest, SamplingParams, SchedulerOutput

    return SchedulerOutput(
        new_requests=[NewRequest("probe", [1, 2, 3], SamplingParams(temperature=0.0), [0])],
        num_scheduled_tokens={"probe": 3},
    )
