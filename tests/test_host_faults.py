"""Host faults across simulated hosts: the second host killed, taken down, cut off and stopped
while the first waits in an all-reduce, and its rank hanging before it joins; rank 0 names the
lost rank and its host within the deadline + 1 s, and nothing is left on either host."""

import json

import pytest

from shardline.conformance.faults import across_hosts
from shardline.conformance.faults.scenarios import HOST_SCENARIOS
from support.cli import shardline

pytestmark = pytest.mark.skipif(
    across_hosts.unavailable_reason() is not None, reason=str(across_hosts.unavailable_reason())
)


@pytest.mark.timeout(600)
def test_a_lost_host_is_named_by_the_survivors_in_time(tmp_path):
    report = tmp_path / "hosts.json"
    run = shardline(
        "faults", "--across-hosts", "--communicators", "gloo", "--json", str(report),
        timeout=540,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:]
    document = json.loads(report.read_text())
    assert document["counts"] == {
        "external_launcher (torchrun, 2 hosts) x gloo": {"passed": len(HOST_SCENARIOS)}
    }
    for result in document["results"]:
        (survivor,) = [p for p in result["processes"] if p["role"] == "rank-0"]
        assert "rank 1 on host h2" in survivor["message"], survivor["message"]
        assert survivor["elapsed_s"] <= document["settings"]["timeout_s"] + 1
        # A rank whose executor never started (a peer never joined) has nothing to shut down.
        assert survivor.get("shutdown", "clean") == "clean"


def test_across_hosts_refuses_executors_with_the_reason():
    run = shardline("faults", "--across-hosts", "--executors", "mp")
    assert run.returncode == 2
    assert run.stderr.startswith("error: --executors does not apply with --across-hosts")
