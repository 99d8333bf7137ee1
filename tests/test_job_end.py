"""Ending a launched job at exit after a failure (``abort_job_at_exit``), outside MPI: a
process a launcher started exits 1 whatever its script returns, after the exit handlers
registered since and its logs are written out; a process no launcher started is left
alone."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import atexit, logging, sys
from shardline.launch.job_end import abort_job_at_exit
atexit.register(print, "registered before")
print("armed", abort_job_at_exit(), abort_job_at_exit(), flush=True)
atexit.register(print, "registered after")
handler = logging.StreamHandler(sys.stderr)
handler.flush = lambda: sys.stderr.write("log handler flushed\\n")
logging.getLogger().addHandler(handler)
"""


def _run(extra_environ: dict[str, str]) -> subprocess.CompletedProcess:
    environ = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("TORCHELASTIC_", "OMPI_", "PMI_"))
    }
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=environ | extra_environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "launcher_variable", ["TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
)
def test_a_launched_process_that_saw_a_failure_exits_1_after_the_later_exit_handlers(
    launcher_variable,
):
    run = _run({launcher_variable: "2"})
    assert run.returncode == 1, run.stderr
    assert run.stdout.splitlines() == ["armed True True", "registered after"]
    assert "log handler flushed" in run.stderr


def test_a_process_no_launcher_started_keeps_its_exit_status():
    run = _run({})
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["armed False False", "registered after", "registered before"]
    assert "log handler flushed" in run.stderr
