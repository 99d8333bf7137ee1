"""A driver killed with SIGKILL (so it cleans up nothing) takes its ranks with it within two
seconds in every phase of their lives: still importing, stalled before joining, loading,
idle, in a call; for the mp executor and for LocalWorld (the worlds of the conformance
suites). The shared-memory segments the run mapped are gone too. ``shardline run`` stopped
with SIGTERM while its workers load ends cleanly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardline.conformance.executors.checks import (
    alive,
    mapped_segments,
    unlinked_segments,
    wait_gone,
)
from support.cli import SHARDLINE
from support.fake_plugins import install_plugin
from support.processes import descendant_commands
from support.smollm2 import smollm2_gguf

pytestmark = pytest.mark.timeout(120)

TESTS = Path(__file__).parent
STALL_PLUGIN = """
import os, time
from pathlib import Path
from shardline.registry import hookimpl

@hookimpl
def shardline_rank_starting(rank, world_size):
    if os.environ.get("STALL_JOIN") == "1" and rank == 1:
        Path(os.environ["STALL_MARKERS"], "joining-1").touch()
        time.sleep(120)
"""


# Ranks that start slowly, as under load (100 ranks importing torch on 2 cores took
# minutes): with STALL_STARTUP=1, Python stalls while it starts the fork server the ranks
# are forked from (after the tether, in the server's own interpreter), so no rank exists yet.
FORK_SERVER = "shardline.launch.fork_server"
SLOW_START = f"""
import os, time
if os.environ.get("STALL_STARTUP") == "1":
    with open("/proc/self/cmdline", "rb") as command:
        line = command.read()
    if b"{FORK_SERVER}" in line:
        time.sleep(60)
"""


def _children(pid: int, name: str) -> list[int]:
    """Live descendants of ``pid`` whose command line mentions ``name``."""
    return [child for child, command in descendant_commands(pid).items() if name in command]


def _wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize(
    ("kind", "phase"),
    [
        ("mp", "spawn"),
        ("mp", "join"),
        ("mp", "load"),
        ("mp", "idle"),
        ("mp", "step"),
        ("local_world", "spawn"),
        ("local_world", "load"),
        ("local_world", "step"),
    ],
)
def test_ranks_end_with_a_killed_driver_in_every_phase(tmp_path, kind, phase):
    markers, plugins = tmp_path / "markers", tmp_path / "plugins"
    markers.mkdir()
    plugins.mkdir()
    install_plugin(plugins, "stall-plugin", "stall", "stall_plugin", STALL_PLUGIN)
    (plugins / "sitecustomize.py").write_text(SLOW_START)
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(plugins)]),
        "STALL_MARKERS": str(markers),
        "STALL_JOIN": "1" if phase == "join" else "0",
        "STALL_STARTUP": "1" if phase == "spawn" else "0",
    }
    rank_name = "shardline-worker" if kind == "mp" else "shardline-rank"
    with open(tmp_path / "driver.err", "w") as errors:
        driver = subprocess.Popen(
            [sys.executable, str(TESTS / "support" / "orphan_driver.py"), kind, phase],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=environ,
        )
    ranks: list[int] = []
    servers: list[int] = []
    try:
        assert json.loads(driver.stdout.readline())["phase"] == "starting"
        if phase == "spawn":
            # The ranks' fork server exists and is still starting (slowly, see SLOW_START).
            _wait_for(lambda: len(_children(driver.pid, FORK_SERVER)) == 1, 60, "a fork server")
            time.sleep(0.5)
            assert _children(driver.pid, rank_name) == []
        else:
            if phase in ("idle", "step"):
                line = driver.stdout.readline()
                assert json.loads(line)["phase"] == phase, (tmp_path / "driver.err").read_text()
            wanted = {
                "join": ["joining-1"],
                "load": ["loading-0", "loading-1"],
                "step": ["stepping-0", "stepping-1"],
            }.get(phase, [])
            _wait_for(lambda: all((markers / m).exists() for m in wanted), 60, str(wanted))
        ranks = _children(driver.pid, FORK_SERVER if phase == "spawn" else rank_name)
        assert len(ranks) == (1 if phase == "spawn" else 2)
        if kind == "mp" and phase != "spawn":
            # Once every worker has mapped the rings (and said so), their names go.
            _wait_for(lambda: not mapped_segments([driver.pid, *ranks]), 10, "names gone")
            assert unlinked_segments(ranks)
        segments = mapped_segments([driver.pid, *ranks])
        servers = _children(driver.pid, FORK_SERVER)
        assert len(servers) == 1
        driver.kill()
        driver.wait(10)
        assert wait_gone(ranks, 2.0) == [], "ranks alive 2 s after the driver was killed"
        assert wait_gone(servers, 1.0) == [], "the ranks' fork server outlived the driver"
        _wait_for(lambda: not any(path.exists() for path in segments), 5, f"{segments} removed")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(10)
        for pid in alive(ranks + servers):
            os.kill(pid, signal.SIGKILL)


def test_shardline_run_stopped_with_sigterm_while_loading_ends_cleanly():
    """``timeout`` stops a command with SIGTERM: the run shuts its workers down and exits
    with 143 and one line, leaving no worker and no segment behind."""
    environ = {**os.environ, "SHARDLINE_MODELS": str(smollm2_gguf().parent)}
    run = subprocess.Popen(
        [SHARDLINE, "run", "--set", "parallel.communicator=gloo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environ,
    )
    try:
        _wait_for(lambda: len(_children(run.pid, "shardline-worker")) == 2, 60, "two workers")
        workers = _children(run.pid, "shardline-worker")
        time.sleep(1.0)  # importing or loading
        segments = mapped_segments([run.pid, *workers])
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=15)
        assert run.returncode == 143, err
        assert err.strip().splitlines()[-1] == "error: terminated (SIGTERM)", err
        assert wait_gone(workers, 2.0) == []
        assert not any(path.exists() for path in segments)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(10)
