"""A Spawner's fork server (``Spawner(fork_server=True)``): children forked from one server
see what an exec'd child would (their passed descriptor at its number and no other beyond the
standard three, standard input from /dev/null, the environment given, SIGINT's default, their
name as their command line), report how they ended, and end with the spawner."""

import json
import os
import signal
import time

import pytest

from shardline.conformance.executors.checks import wait_gone
from shardline.launch.tether import Spawner
from support import fork_targets, slow_fork_targets
from support.processes import descendant_commands

pytestmark = pytest.mark.timeout(120)


def test_children_forked_from_one_server_see_what_an_execd_child_would(tmp_path):
    spawner = Spawner("shardline-test-spawner", fork_server=True)
    try:
        children, pipes = [], []
        for index in range(2):
            read_end, write_end = os.pipe()
            report = tmp_path / f"child-{index}.json"
            child = spawner.start(
                fork_targets.describe,
                (str(report), write_end),
                f"shardline-test-child-{index}",
                pass_fds=(write_end,),
                env={**os.environ, "FORK_TEST_MARKER": f"child {index}"},
            )
            os.close(write_end)  # the child has its own: the caller may close it at once
            children.append(child)
            pipes.append((read_end, write_end, report))
        for child, (read_end, write_end, report) in zip(children, pipes, strict=True):
            child.join(60)
            assert child.exitcode == 0
            assert int(os.read(read_end, 32)) == child.pid
            os.close(read_end)
            facts = json.loads(report.read_text())
            index = children.index(child)
            assert facts["cmdline"] == f"shardline-test-child-{index}"
            assert facts["marker"] == f"child {index}"
            assert facts["stdin"] == "/dev/null"
            assert facts["sigint_default"]
            # The standard three and the passed one; one more is listdir's own, while it lists.
            assert len(set(facts["open_fds"]) - {0, 1, 2, write_end}) <= 1, facts["open_fds"]
        parents = {json.loads(report.read_text())["parent"] for _, _, report in pipes}
        (server,) = parents
        assert server != os.getpid()
        assert "shardline.launch.fork_server" in descendant_commands(os.getpid())[server]
    finally:
        spawner.close()
    assert wait_gone([server], 5.0) == [], "the fork server outlived its spawner"


def test_exit_codes_say_how_each_child_ended_and_closing_ends_the_rest(tmp_path):
    spawner = Spawner("shardline-test-spawner", fork_server=True)
    marker = tmp_path / "late"
    try:
        failing = spawner.start(fork_targets.fail, (), "shardline-test-failing")
        killed = spawner.start(fork_targets.sleep_then_mark, (str(marker),), "shardline-killed")
        left = spawner.start(fork_targets.sleep_then_mark, (str(marker),), "shardline-left")
        failing.join(60)
        assert failing.exitcode == 1
        while killed.pid is None:  # forked once the server has imported the targets
            time.sleep(0.01)
        assert killed.is_alive() and killed.exitcode is None
        killed.kill()
        killed.join(10)
        assert killed.exitcode == -signal.SIGKILL
        while left.pid is None:
            time.sleep(0.01)
        assert left.is_alive()
    finally:
        spawner.close()
    left.join(10)
    assert left.exitcode == -signal.SIGKILL and wait_gone([left.pid], 5.0) == []
    assert not marker.exists()


def test_a_child_killed_before_the_server_forked_it_never_runs(tmp_path):
    spawner = Spawner("shardline-test-spawner", fork_server=True)
    marker = tmp_path / "ran"
    try:
        # The server spends a second importing the target's module: nothing is forked yet.
        child = spawner.start(slow_fork_targets.mark, (str(marker),), "shardline-early")
        assert child.pid is None and child.is_alive()
        child.kill()
        child.join(60)
        assert child.exitcode == -signal.SIGKILL
        other = spawner.start(slow_fork_targets.mark, (str(tmp_path / "other"),), "other")
        other.join(60)
        assert other.exitcode == 0 and (tmp_path / "other").exists()
    finally:
        spawner.close()
    assert not marker.exists()
