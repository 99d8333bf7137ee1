"""Fork servers (``Spawner(fork_servers=ForkServers())``): children forked from a server see
what an exec'd child would (their passed descriptor at its number and no other beyond the
standard three, standard input from /dev/null, the environment given, SIGINT's default, their
name as their command line), report how they ended, and end with their spawner; spawners
share a server while their children's environments match, and it ends after the last lets
go."""

import json
import os
import signal
import time

import pytest

from shardline.conformance.executors.checks import wait_gone
from shardline.launch.fork_servers import ForkServers
from shardline.launch.tether import Spawner
from support import fork_targets, slow_fork_targets
from support.processes import descendant_commands

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def fork_servers():
    servers = ForkServers(linger_s=2.0, name="shardline-test-fork-servers")
    yield servers
    servers.close()


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def forked(child, seconds: float = 60.0) -> int:
    """``child``'s pid, once its server has forked it."""
    deadline = time.monotonic() + seconds
    while child.pid is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert child.pid is not None, "never forked"
    return child.pid


def test_children_forked_from_one_server_see_what_an_execd_child_would(tmp_path, fork_servers):
    spawner = Spawner("shardline-test-spawner", fork_servers)
    cores = sorted(os.sched_getaffinity(0))
    try:
        children, pipes = [], []
        for index in range(2):
            read_end, write_end = os.pipe()
            report = tmp_path / f"child-{index}.json"
            # The first asked for by a thread bound to one core runs there (as an exec'd
            # child would), not where the server runs; the second where this thread is.
            os.sched_setaffinity(0, cores[-1:] if index == 0 else cores)
            child = spawner.start(
                fork_targets.describe,
                (str(report), write_end),
                f"shardline-test-child-{index}",
                pass_fds=(write_end,),
                # One server for both (the environments differ only in pytest's variable):
                # each child sees its own.
                env={**os.environ, "FORK_TEST_MARKER": "given", "PYTEST_CURRENT_TEST": str(index)},
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
            # Its name alone, as one argument (no NULs padding the server's longer one).
            assert facts["cmdline"] == f"shardline-test-child-{index}\0"
            assert facts["marker"] == "given" and facts["test"] == str(index)
            assert facts["stdin"] == "/dev/null"
            assert facts["sigint_default"]
            assert facts["cpus"] == (cores[-1:] if index == 0 else cores)
            # The standard three and the passed one; one more is listdir's own, while it lists.
            assert len(set(facts["open_fds"]) - {0, 1, 2, write_end}) <= 1, facts["open_fds"]
        parents = {json.loads(report.read_text())["parent"] for _, _, report in pipes}
        (server,) = parents
        assert server != os.getpid()
        assert "shardline.launch.fork_server" in descendant_commands(os.getpid())[server]
    finally:
        os.sched_setaffinity(0, cores)
        spawner.close()
    # The server waits for other spawners a while (linger_s), then ends.
    assert wait_gone([server], 2.0 + 10.0) == [], "the fork server outlived its linger time"


def test_exit_codes_say_how_each_child_ended_and_closing_ends_the_rest(tmp_path, fork_servers):
    spawner = Spawner("shardline-test-spawner", fork_servers)
    marker = tmp_path / "late"
    try:
        failing = spawner.start(fork_targets.fail, (), "shardline-test-failing")
        killed = spawner.start(fork_targets.sleep_then_mark, (str(marker),), "shardline-killed")
        left = spawner.start(fork_targets.sleep_then_mark, (str(marker),), "shardline-left")
        failing.join(60)
        assert failing.exitcode == 1
        forked(killed)  # once the server has imported the targets
        assert killed.is_alive() and killed.exitcode is None
        killed.kill()
        killed.join(10)
        assert killed.exitcode == -signal.SIGKILL
        forked(left)
        assert left.is_alive()
    finally:
        spawner.close()
    left.join(10)
    assert left.exitcode == -signal.SIGKILL and wait_gone([left.pid], 5.0) == []
    assert not marker.exists()


def test_a_child_killed_before_the_server_forked_it_never_runs(tmp_path, fork_servers):
    spawner = Spawner("shardline-test-spawner", fork_servers)
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


def test_a_prepared_server_imports_the_module_before_any_child_is_asked_for(tmp_path, fork_servers):
    """``prepare`` starts a server that imports the module at once; the child asked for
    later comes from that server, which imported the module that one time."""
    record = tmp_path / "imported-by"
    environ = {**os.environ, slow_fork_targets.IMPORTED_BY: str(record)}
    fork_servers.prepare(environ, "support.slow_fork_targets")
    deadline = time.monotonic() + 60
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert record.exists(), "the prepared server never imported the module"
    spawner = Spawner("shardline-test-spawner", fork_servers)
    try:
        child = spawner.start(
            slow_fork_targets.mark, (str(tmp_path / "ran"),), "shardline-prepared", env=environ
        )
        child.join(60)
        assert child.exitcode == 0 and (tmp_path / "ran").exists()
    finally:
        spawner.close()
    importers = record.read_text().split()
    assert len(importers) == 1 and int(importers[0]) != os.getpid()
    assert (tmp_path / "ran").read_text() == importers[0]  # forked from that server


def test_an_unused_prepared_server_ends_at_once_and_a_used_or_held_one_does_not(fork_servers):
    """``end_if_unused`` ends a prepared server no world took (a refused config's); a server
    that a spawner holds, or that was asked for a child, stays (it ends as usual)."""
    unused = fork_servers.prepare({**os.environ, "FORK_TEST_MARKER": "unused"}, "json")
    fork_servers.end_if_unused(unused)
    assert wait_gone([unused.process.pid], 5.0) == []
    environ = {**os.environ, "FORK_TEST_MARKER": "used"}
    used = fork_servers.prepare(environ, "json")
    spawner = Spawner("shardline-test-spawner", fork_servers)
    try:
        child = spawner.start(fork_targets.fail, (), "asked", env=environ)
        fork_servers.end_if_unused(used)  # held by the spawner
        child.join(60)
        assert child.exitcode == 1  # it ran (and failed, as it should)
    finally:
        spawner.close()
    fork_servers.end_if_unused(used)  # let go, but it forked a child
    assert used.is_alive()


def test_spawners_share_a_server_while_their_childrens_environments_match(tmp_path, fork_servers):
    """Two spawners whose children's environments differ only in pytest's running-test
    variable share one server; another environment gets one of its own. Closing one spawner
    ends its children, not the other's; the server outlives its last spawner by linger_s
    (a spawner made meanwhile gets it again), then ends."""
    marker = tmp_path / "late"
    environ = {**os.environ, "FORK_TEST_MARKER": "shared"}
    spawners = [Spawner(f"shardline-test-spawner-{n}", fork_servers) for n in range(3)]
    try:
        children = [
            spawner.start(
                fork_targets.sleep_then_mark,
                (str(marker),),
                f"shardline-test-sharing-{n}",
                env={**environ, "PYTEST_CURRENT_TEST": f"test {n}"} if n < 2 else os.environ,
            )
            for n, spawner in enumerate(spawners)
        ]
        servers = [parent_of(forked(child)) for child in children]
        assert servers[0] == servers[1] != servers[2]
        for server in servers:
            assert "shardline.launch.fork_server" in descendant_commands(os.getpid())[server]
        spawners[0].close()
        children[0].join(10)
        assert children[0].exitcode == -signal.SIGKILL
        assert children[1].is_alive() and children[2].is_alive()
        spawners[1].close()
        # Within linger_s of the last let-go, a new spawner gets the same server.
        again = Spawner("shardline-test-spawner-again", fork_servers)
        spawners.append(again)
        late = again.start(fork_targets.sleep_then_mark, (str(marker),), "late", env=environ)
        children[1].join(10)
        assert children[1].exitcode == -signal.SIGKILL
        assert parent_of(forked(late)) == servers[0]
    finally:
        for spawner in spawners:
            spawner.close()
    assert wait_gone(servers, 2.0 + 10.0) == [], "a server outlived its linger time"
    assert not marker.exists()


def test_a_server_that_dies_ends_its_children_and_the_next_spawner_gets_a_new_one(
    tmp_path, fork_servers
):
    first = Spawner("shardline-test-spawner", fork_servers)
    second = Spawner("shardline-test-spawner-2", fork_servers)
    try:
        child = first.start(fork_targets.sleep_then_mark, (str(tmp_path / "a"),), "doomed")
        server = parent_of(forked(child))
        os.kill(server, signal.SIGKILL)
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
        report = tmp_path / "child.json"
        read_end, write_end = os.pipe()
        fresh = second.start(
            fork_targets.describe, (str(report), write_end), "fresh", pass_fds=(write_end,)
        )
        os.close(write_end)
        fresh.join(60)
        os.close(read_end)
        assert fresh.exitcode == 0
        assert json.loads(report.read_text())["parent"] not in (server, os.getpid())
    finally:
        first.close()
        second.close()


def test_closing_the_fork_servers_ends_their_children_and_later_requests_are_refused(tmp_path):
    servers = ForkServers(linger_s=60.0, name="shardline-test-fork-servers")
    spawner = Spawner("shardline-test-spawner", servers)
    try:
        child = spawner.start(fork_targets.sleep_then_mark, (str(tmp_path / "m"),), "held")
        server = parent_of(forked(child))
        servers.close()
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
        assert wait_gone([server], 5.0) == []
        with pytest.raises(RuntimeError, match="fork servers are closed"):
            spawner.start(fork_targets.fail, (), "too-late")
    finally:
        spawner.close()  # lets go of a server already ended: nothing to do
        servers.close()
