"""Simulated hosts (network, hostname and /dev/shm of their own, on a private bridge), and a
world that crosses them: torchrun with two nodes, one rank per host, gives transformers'
greedy tokens over gloo, and over custom_ar, which hands a group that spans hosts to its
base. Taking the hosts down leaves no process, namespace or interface behind."""

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardline.launch import hosts as simulated
from shardline.launch.launchers import launcher_environment
from support.cli import ROOT, shardline

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        simulated.unavailable_reason() is not None, reason=str(simulated.unavailable_reason())
    ),
]


@pytest.fixture(scope="module")
def two_hosts():
    with simulated.SimulatedHosts.up(2) as made:
        yield made


def _inside(host, *argv):
    return subprocess.run(host.command(argv), capture_output=True, text=True, timeout=30)


def test_each_host_has_its_own_name_shared_memory_and_address(two_hosts):
    h1, h2 = two_hosts.hosts
    assert _inside(h1, "hostname").stdout.strip() == "h1"
    assert _inside(h2, "hostname").stdout.strip() == "h2"
    assert _inside(h1, "sh", "-c", "touch /dev/shm/only-on-h1 && ls /dev/shm").stdout.split() == [
        "only-on-h1"
    ]
    assert _inside(h2, "ls", "/dev/shm").stdout.split() == []
    reach = (
        "import socket, sys\n"
        "try:\n"
        "    socket.create_connection((sys.argv[1], 9), timeout=3)\n"
        "except ConnectionRefusedError:\n"
        "    print('reached')\n"
    )
    assert _inside(h1, sys.executable, "-c", reach, h2.address).stdout.strip() == "reached"
    routes = _inside(h1, "ip", "-o", "route").stdout.splitlines()
    assert [line.split()[0] for line in routes] == [two_hosts.subnet]  # nowhere else


@pytest.mark.parametrize("communicator", ["gloo", "custom_ar"])
def test_torchrun_across_two_hosts_gives_transformers_tokens(
    two_hosts, tiny_llama_dir, tiny_llama_greedy, communicator, tmp_path
):
    h1 = two_hosts.hosts[0]
    environ = launcher_environment()
    environ["PYTHONPATH"] = f"{ROOT / 'tests'}:{environ['PYTHONPATH']}"
    environ["TMPDIR"] = str(tmp_path)  # torchrun's log folders go with the test's
    program = ["-m", "support.launched_driver", str(tiny_llama_dir), "2", "1"]
    runs = [
        subprocess.Popen(
            host.command(
                [
                    sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                    "--nproc-per-node=1", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={h1.address}:29400", f"--rdzv-id={communicator}",
                    f"--local-addr={host.address}",
                    *program, f"parallel.communicator={communicator}",
                ]
            ),
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host in two_hosts.hosts
    ]  # fmt: skip
    outputs = [run.communicate(timeout=240) for run in runs]
    for run, (_, err) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, err[-3000:]
    (report,) = [line for out, _ in outputs for line in out.splitlines() if line.startswith("{")]
    assert json.loads(report)["tokens"] == tiny_llama_greedy
    assert [host.started() for host in two_hosts.hosts] == [[], []]  # the worlds ended


def test_mpiexec_across_two_hosts_tp_inside_a_host_pp_across(
    two_hosts, tiny_llama_dir, tiny_llama_greedy
):
    """Two ranks per host: TP groups inside a host (custom_ar_mpi's shared memory), pipeline
    stages across (MPI over TCP on the bridge); OpenMPI reaches h2 through the hosts' agent."""
    h1 = two_hosts.host("h1")
    environ = launcher_environment()
    environ["PYTHONPATH"] = f"{ROOT / 'tests'}:{environ['PYTHONPATH']}"
    command = h1.command(
        [
            str(Path(sys.executable).with_name("mpiexec")), "--host", "h1:2,h2:2", "-n", "4",
            *two_hosts.mpiexec_options(),
            sys.executable, "-m", "support.launched_driver", str(tiny_llama_dir), "2", "2",
            "parallel.communicator=custom_ar_mpi",
        ]
    )  # fmt: skip
    run = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    (report,) = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert json.loads(report)["tokens"] == tiny_llama_greedy
    assert [host.started() for host in two_hosts.hosts] == [[], []]


def test_taking_hosts_down_kills_everything_in_them_and_removes_them():
    made = simulated.SimulatedHosts.up(2)
    h1 = made.host("h1")
    sleeper = subprocess.Popen(h1.command(["sleep", "600"]))
    try:
        # The process joins the host once nsenter has entered its namespaces (a moment on
        # a loaded machine).
        deadline = time.monotonic() + 10
        while h1.started() != [sleeper.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h1.started() == [sleeper.pid]
        made.down()
        assert sleeper.wait(5) == -9
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert f"sl{made.cluster}" not in names + links
        assert not (simulated.STATE_DIR / f"{made.cluster}.json").exists()
    finally:
        made.down()
        if sleeper.poll() is None:
            sleeper.kill()


def test_hosts_commands_make_enter_list_and_remove_a_cluster():
    cluster = f"t{secrets.token_hex(2)}"
    try:
        made = shardline("hosts", "up", "2", "--name", cluster)
        assert made.returncode == 0, made.stderr
        listed = shardline("hosts", "list").stdout
        assert f"cluster {cluster}:" in listed and "h2" in listed
        inside = shardline("hosts", "exec", cluster, "h2", "--", "hostname")
        assert (inside.returncode, inside.stdout.strip()) == (0, "h2")
        wrong = shardline("hosts", "exec", cluster, "h9", "--", "hostname")
        assert wrong.returncode == 2
        assert wrong.stderr.strip() == (
            f"error: hosts exec {cluster} 'h9': no such host; allowed: ['h1', 'h2']"
        )
        again = shardline("hosts", "up", "1", "--name", cluster)
        assert again.returncode == 2 and "up already" in again.stderr
        h2 = simulated.SimulatedHosts.load(cluster).host("h2")
        sleeper = subprocess.Popen(h2.command(["sleep", "600"]))
        one_host = shardline("hosts", "down", cluster, "h2")  # as a machine fails
        assert one_host.returncode == 0, one_host.stderr
        assert sleeper.wait(5) == -9
        assert [h.name for h in simulated.SimulatedHosts.load(cluster).hosts] == ["h1"]
        assert h2.netns not in subprocess.run(["ip", "netns"], capture_output=True).stdout.decode()
        assert shardline("hosts", "exec", cluster, "h1", "--", "true").returncode == 0
        assert shardline("hosts", "down", cluster).returncode == 0
        assert cluster not in simulated.clusters()
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"sl{cluster}" not in names
    finally:
        if cluster in simulated.clusters():
            simulated.SimulatedHosts.load(cluster).down()


def test_bench_comm_measures_inside_one_host_beside_across_two(tmp_path):
    report = tmp_path / "hosts.json"
    measured = shardline(
        "bench", "comm", "--across-hosts", "2", "-c", "gloo", "-b", "4", "-e", "64",
        "-f", "16", "--ops", "all_reduce,p2p", "-w", "1", "-i", "3", "--json", str(report),
        timeout=240,
    )  # fmt: skip
    assert measured.returncode == 0, measured.stderr
    rows = json.loads(report.read_text())["results"]
    cases = {(r["where"], r["operation"], r["bytes"]) for r in rows}
    assert cases == {
        (where, operation, size)
        for where in ("inside 1 host", "across 2 hosts")
        for operation in ("all_reduce", "p2p")
        for size in (4, 64)
    }
    assert all(r["median_us"] > 0 for r in rows)
    assert "across 2 hosts" in measured.stdout and "x" in measured.stdout.split("/ INSIDE")[1]


def test_bench_comm_across_hosts_that_do_not_divide_the_ranks_is_refused():
    refused = shardline("bench", "comm", "--across-hosts", "3", "-n", "2", "-c", "gloo")
    assert refused.returncode == 2
    assert refused.stderr == (
        "error: --across-hosts = 3 (2 ranks): allowed: 2 or more hosts that divide the "
        "ranks evenly\n"
    )


def test_mpiexec_pipeline_stages_on_two_hosts_send_without_a_poller(
    two_hosts, tiny_llama_dir, tiny_llama_greedy
):
    """One stage per host over MPI's TCP transport, every message above its eager limit: a
    send left pending while its rank waits for the next step never reaches the next stage
    (MPI advances only when polled), so the stage sends before it returns."""
    h1 = two_hosts.host("h1")
    environ = launcher_environment()
    environ["PYTHONPATH"] = f"{ROOT / 'tests'}:{environ['PYTHONPATH']}"
    command = h1.command(
        [
            str(Path(sys.executable).with_name("mpiexec")), "--host", "h1:1,h2:1", "-n", "2",
            *two_hosts.mpiexec_options(), "--mca", "btl_tcp_eager_limit", "256",
            sys.executable, "-m", "support.launched_driver", str(tiny_llama_dir), "1", "2",
            "parallel.communicator=mpi", "parallel.timeout_s=20",
        ]
    )  # fmt: skip
    run = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    (report,) = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert json.loads(report)["tokens"] == tiny_llama_greedy
    assert [host.started() for host in two_hosts.hosts] == [[], []]
