"""A launched rank that hangs in a start-up phase ends itself at the phase's deadline, naming
its rank and phase and showing where it hung; a finished start-up leaves nothing armed."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

HANGS = """
import time
from shardline.launch.startup_guard import StartupGuard
guard = StartupGuard(3, 0.5, "distributed init")
def plugin_hook_that_never_returns():
    time.sleep(30)
plugin_hook_that_never_returns()
"""

FINISHES = """
import time
from shardline.launch.startup_guard import StartupGuard
guard = StartupGuard(3, 0.3, "distributed init")
guard.phase("model load")
guard.done()
time.sleep(6.0)  # past both the timer and the lock-free backstop
print("still here")
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=40)


def test_a_hung_phase_ends_the_rank_with_where_it_hung():
    run = _run(HANGS)
    assert run.returncode == 1
    first = run.stderr.splitlines()[0]
    assert first == (
        "error: rank 3: start-up phase 'distributed init' did not end within 0.5 s "
        "(parallel.startup_timeout_s); ending this rank. Its threads:"
    )
    assert "plugin_hook_that_never_returns" in run.stderr


def test_a_finished_start_up_leaves_nothing_armed():
    run = _run(FINISHES)
    assert (run.returncode, run.stdout.strip(), run.stderr) == (0, "still here", "")
