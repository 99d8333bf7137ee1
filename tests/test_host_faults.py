"""Host faults across simulated hosts: the second host killed, taken down, cut off and stopped
while the first waits in an all-reduce, and its rank hanging before it joins; the survivor
(rank 0 under torchrun, the driver of a Ray cluster on the hosts) names the lost rank and its
host within the deadline + 1 s, and nothing is left on either host."""

import importlib.util
import json
import signal
import subprocess

import pytest

from shardline.conformance.faults import across_hosts
from shardline.conformance.faults.scenarios import HOST_SCENARIOS
from support.cli import ROOT, SHARDLINE

pytestmark = pytest.mark.skipif(
    across_hosts.unavailable_reason() is not None,
    reason=str(across_hosts.unavailable_reason()),
)
# The tests that run fault scenarios are marked ``alone``: faults must end within the
# deadline + 1 s, judged while no other test runs. The refusal runs beside other tests.


def faults(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """``shardline faults ARGS``; past ``timeout`` it gets SIGTERM (it unwinds: its hosts and
    clusters are taken down) and, 60 s later, SIGKILL."""
    process = subprocess.Popen(
        [SHARDLINE, "faults", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=ROOT,
    )  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _survivors_named_the_host_in_time(document: dict, role: str) -> None:
    settings = document["settings"]
    for result in document["results"]:
        (survivor,) = [p for p in result["processes"] if p["role"] == role]
        assert "rank 1 on host h2" in survivor["message"], survivor["message"]
        deadline = settings["timeout_s"]
        if HOST_SCENARIOS[result["scenario"]].deadline == "startup":  # a rank never joins
            deadline = settings["startup_timeout_s"]
        assert survivor["elapsed_s"] <= deadline + 1
        # A survivor whose executor never started (a peer never joined) has nothing to shut down.
        assert survivor.get("shutdown", "clean") == "clean"


@pytest.mark.alone
@pytest.mark.timeout(600)
def test_a_lost_host_is_named_by_the_survivors_in_time(tmp_path):
    report = tmp_path / "hosts.json"
    run = faults(
        "--across-hosts", "--communicators", "gloo", "--json", str(report),
        # Its phases start in ~1 s here; the rank that never joins is waited for this long.
        "--startup-timeout", "10", timeout=540,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:]
    document = json.loads(report.read_text())
    assert document["counts"] == {
        "external_launcher (torchrun, 2 hosts) x gloo": {"passed": len(HOST_SCENARIOS)}
    }
    _survivors_named_the_host_in_time(document, "rank-0")


@pytest.mark.alone
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
@pytest.mark.timeout(180)
def test_a_ray_driver_names_the_rank_of_a_host_that_died_in_time(tmp_path):
    """A Ray cluster on the scenario's hosts (the executor's ``prepare_hosts``), the driver in
    h1: every process of h2 killed (its Ray node with it) mid-step."""
    report = tmp_path / "ray.json"
    run = faults(
        "--across-hosts", "--executors", "ray", "--communicators", "gloo",
        "--scenarios", "host dies mid-step", "--json", str(report), timeout=150,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:]
    document = json.loads(report.read_text())
    assert document["counts"] == {"ray (2 hosts) x gloo": {"passed": 1}}
    _survivors_named_the_host_in_time(document, "driver")


def test_across_hosts_refuses_an_executor_whose_ranks_stay_on_one_host():
    run = faults("--across-hosts", "--executors", "mp", timeout=60)
    assert run.returncode == 2
    assert run.stderr.startswith(
        "error: --executors = 'mp': executor mp runs every rank on the driver's host (spans_hosts "
        "is false); allowed with --across-hosts: external_launcher"
    ), run.stderr
