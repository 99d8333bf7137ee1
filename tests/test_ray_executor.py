"""The ray executor: where ranks go (pure placement rules); transformers' greedy tokens under TP=2
and TP=2 x PP=2 on a Ray instance the module shares; a Ray instance the executor starts itself
and stops, leaving nothing, also when its driver is SIGKILLed; a killed actor failing the step;
without ray, the reason it is unavailable; and a two-host Ray cluster on simulated hosts (the
executor's own ``prepare_hosts``: ``ray start --head`` in one, ``ray start --address`` in the
other): TP=2 with one rank on each host, and TP=2 inside each host x PP=2 across them, then
nothing left in either host. The executor contract itself is checked by the executor conformance
suite (tests/test_executor_conformance.py)."""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardline.config import load_config
from shardline.conformance.executors import probe
from shardline.conformance.executors.checks import alive, wait_gone
from shardline.errors import PeerLostError
from shardline.launch import hosts as simulated
from shardline.launch.launchers import launcher_environment
from shardline.registry import Registry
from shardline_ray.cluster import HEAD_PORT
from shardline_ray.placement import Node, RankPlace, bundles, place_ranks
from support.cli import ROOT
from support.greedy_driver import GREEDY_TOKENS, run_script

RAY_MISSING = importlib.util.find_spec("ray") is None
needs_ray = pytest.mark.skipif(RAY_MISSING, reason="the ray package is not installed")
TESTS = ROOT / "tests"

# ---- placement -----------------------------------------------------------------------------

A, B, C = (Node(f"node-{n}", f"10.0.0.{n}", f"h{n}") for n in (3, 1, 2))


def test_ranks_are_numbered_node_by_node_the_drivers_node_first():
    places = place_ranks([A, B, C], driver_node="node-2", world_size=6)
    assert [(p.rank, p.node.hostname, p.local_rank, p.ranks_on_node) for p in places] == [
        (0, "h2", 0, 2),
        (1, "h2", 1, 2),
        (2, "h1", 0, 2),  # then by address: 10.0.0.1 before 10.0.0.3
        (3, "h1", 1, 2),
        (4, "h3", 0, 2),
        (5, "h3", 1, 2),
    ]
    assert [p.bundle for p in places] == [2, 2, 1, 1, 0, 0]
    # A driver on no bundle's node: by address only.
    assert [p.node.hostname for p in place_ranks([A, B], "elsewhere", 2)] == ["h1", "h3"]


def groups_across_nodes(places: list[RankPlace], group_size: int) -> list[list[int]]:
    """The groups of ``group_size`` consecutive ranks (tensor-parallel groups) whose ranks
    are on more than one node."""
    groups = [places[start : start + group_size] for start in range(0, len(places), group_size)]
    return [
        [place.rank for place in group]
        for group in groups
        if len({place.node.node_id for place in group}) > 1
    ]


def test_tensor_parallel_groups_stay_inside_a_node_when_its_ranks_can_hold_them():
    places = place_ranks([A, B], driver_node="node-3", world_size=4)
    assert groups_across_nodes(places, 2) == []  # TP=2 inside a host, PP=2 across
    assert groups_across_nodes(places, 4) == [[0, 1, 2, 3]]
    across = place_ranks([A, B], driver_node="node-3", world_size=2)
    assert groups_across_nodes(across, 2) == [[0, 1]]  # TP=2 over two hosts, one rank each


def test_one_bundle_per_node_strictly_spread():
    specs, strategy = bundles(world_size=4, nnodes=2)
    assert strategy == "STRICT_SPREAD" and len(specs) == 2
    assert specs[0]["CPU"] == pytest.approx(0.2)  # two ranks of 0.1 CPU each
    assert bundles(world_size=2, nnodes=1)[1] == "PACK"
    with pytest.raises(ValueError, match="must divide"):
        bundles(world_size=3, nnodes=2)


def test_without_ray_the_executor_is_unavailable_and_says_why():
    program = (
        "import sys\n"
        "sys.modules['ray'] = None  # as if it were not installed\n"
        "from shardline.registry import Registry\n"
        "print(Registry.load().get('executor', 'ray').unavailable_reason())\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert done.stdout.strip() == (
        "the ray package is not installed (pip install 'shardline[ray]')"
    ), done.stderr


def test_a_ranks_actor_imports_no_torch():
    # The actor only relays bytes; its rank's process is the one that computes.
    program = "import sys\nimport shardline_ray.actor\nprint('torch' in sys.modules)\n"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


# ---- on a Ray instance on this host -----------------------------------------------------------


@pytest.fixture(scope="module")
def ray_instance():
    """One Ray instance on this host for the module's executors (they share this process's
    connection; the last user, this fixture, stops it)."""
    if RAY_MISSING:
        pytest.skip("the ray package is not installed")
    from shardline_ray import session

    connection = session.connect({}, cpus=4)
    yield connection
    connection.release()


def _executor(model_dir, tp=1, pp=1, extra=()):
    config = load_config(
        overrides=[
            f"model.path={model_dir}",
            "cache.block_size=4",
            "cache.num_blocks=40",
            f"parallel.tensor_parallel_size={tp}",
            f"parallel.pipeline_parallel_size={pp}",
            "parallel.distributed_executor_backend=ray",
            *extra,
        ],
        environ={},
    ).config
    return Registry.load().get("executor", "ray").load_available()(config)


@needs_ray
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2)], ids=["tp2", "tp2xpp2"])
def test_ray_generates_transformers_tokens(ray_instance, tiny_llama_dir, tiny_llama_greedy, tp, pp):
    executor = _executor(tiny_llama_dir, tp, pp)
    try:
        assert [place.local_rank for place in executor.places] == list(range(tp * pp))
        tokens = run_script(lambda step: executor.execute_model(step).result(60), GREEDY_TOKENS)
        assert tokens == tiny_llama_greedy
        assert executor.output_rank == tp * pp - tp
        pids = [pid for _, pid in executor.collective_rpc(probe.rank_and_pid)]
    finally:
        executor.shutdown()
    assert wait_gone(pids, 5.0) == []


@needs_ray
@pytest.mark.timeout(120)
def test_a_killed_actor_fails_the_step_naming_the_rank_and_takes_its_rank_along(
    ray_instance, tiny_llama_dir
):
    executor = _executor(tiny_llama_dir, pp=2)
    try:
        pids = [pid for _, pid in executor.collective_rpc(probe.rank_and_pid)]
        actor = _parent(pids[1])  # the rank's process is its actor's child
        pending = executor.collective_rpc(probe.sleep_on_rank, (1, 60.0), non_block=True)
        time.sleep(0.2)
        os.kill(actor, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(PeerLostError, match=r"worker rank 1 .*Ray actor is gone") as error:
            pending.result(timeout=30)
        assert time.monotonic() - killed < 2.0
        assert error.value.rank == 1
        with pytest.raises(PeerLostError):
            executor.check_health()
        assert wait_gone([pids[1]], 2.0) == []  # tethered to its actor
    finally:
        executor.shutdown()
    assert alive(pids) == []


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@needs_ray
@pytest.mark.timeout(240)
def test_without_a_cluster_the_executor_starts_a_ray_instance_and_stops_it(
    tiny_llama_dir, tiny_llama_greedy, tmp_path
):
    """In a process of its own (no connection to share), under a TMPDIR too long for Ray's
    socket paths (the instance's folder goes under /tmp instead): the instance's processes
    and folder are gone after shutdown."""
    environ = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    environ["PYTHONPATH"] = f"{TESTS}:{launcher_environment()['PYTHONPATH']}"
    long_tmpdir = tmp_path / ("a-temporary-folder-with-a-long-name-" * 2)
    long_tmpdir.mkdir()
    environ["TMPDIR"] = str(long_tmpdir)
    run = subprocess.run(
        [sys.executable, "-m", "support.ray_driver", str(tiny_llama_dir), "2", "1"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["tokens"] == tiny_llama_greedy
    assert report["connection"].startswith("a Ray instance started on this host")
    assert report["left"] == []
    folder = report["connection"].split("(in ")[1].rstrip(")")
    assert Path(folder).parent == Path("/tmp")
    assert not Path(folder).exists()


@needs_ray
@pytest.mark.timeout(200)
def test_a_hard_killed_driver_leaves_neither_its_ray_instance_nor_its_folder(tiny_llama_dir):
    """SIGKILL on a driver that started its own Ray instance: its janitor ends what of the
    instance still runs (Ray's agents outlive their raylet by a minute or more) and removes the
    instance's folder, within seconds, then ends itself."""
    environ = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    environ["PYTHONPATH"] = f"{TESTS}:{launcher_environment()['PYTHONPATH']}"
    driver = subprocess.Popen(
        [sys.executable, "-m", "support.ray_idle_driver", str(tiny_llama_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env=environ,
        start_new_session=True,  # what the driver starts stays in its session
    )
    try:
        report = json.loads(driver.stdout.readline())
        folder = Path(report["connection"].split("(in ")[1].rstrip(")"))
        assert folder.is_dir() and len(_in_session(driver.pid)) > 3  # driver, Ray, ranks
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
        deadline = time.monotonic() + 15.0
        while (folder.exists() or _in_session(driver.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not folder.exists()
        assert [_command(pid) for pid in _in_session(driver.pid)] == []
        assert alive(report["ranks"]) == []
        janitors = [pid for pid in _all_pids() if str(folder) in _command(pid)]
        assert wait_gone(janitors, 5.0) == []
    finally:
        for pid in [driver.pid, *_in_session(driver.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        driver.wait(10)


def _all_pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _in_session(session: int) -> list[int]:
    """The processes of session ``session`` (its leader may be gone)."""
    found = []
    for pid in _all_pids():
        with contextlib.suppress(OSError):
            if os.getsid(pid) == session:
                found.append(pid)
    return found


# ---- a Ray cluster of two simulated hosts ---------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    """Two simulated hosts with the Ray executor's cluster on them (the head in h1, a worker
    node in h2: :func:`shardline_ray.cluster.cluster_on`); yields the hosts and the driver's
    environment. Once the cluster is stopped, nothing may be left in either host."""
    if RAY_MISSING:
        pytest.skip("the ray package is not installed")
    if simulated.unavailable_reason() is not None:
        pytest.skip(simulated.unavailable_reason())
    from shardline_ray.executor import RayExecutor

    with simulated.SimulatedHosts.up(2) as hosts:
        with RayExecutor.prepare_hosts(hosts.hosts, launcher_environment()) as environ:
            environ["PYTHONPATH"] = f"{TESTS}:{environ['PYTHONPATH']}"
            yield hosts, environ
        left = {host.name: [_command(pid) for pid in host.started()] for host in hosts.hosts}
    assert left == {"h1": [], "h2": []}


@needs_ray
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("tp", "pp", "extra", "hosts_by_rank"),
    [
        (2, 1, [], ["h1", "h2"]),
        (2, 2, ["parallel.communicator=custom_ar"], ["h1", "h1", "h2", "h2"]),
    ],
    ids=["tp2-across-hosts", "tp2-inside-hosts-x-pp2-across"],
)
def test_a_two_host_ray_cluster_gives_transformers_tokens(
    ray_cluster, tiny_llama_dir, tiny_llama_greedy, tp, pp, extra, hosts_by_rank
):
    """The driver in h1, ``parallel.nnodes: 2``: ranks numbered host by host, the driver's
    first; the rank processes end with the run."""
    hosts, environ = ray_cluster
    h1 = hosts.host("h1")
    driver = subprocess.run(
        h1.command(
            [sys.executable, "-m", "support.ray_driver", str(tiny_llama_dir), str(tp), str(pp),
             "parallel.nnodes=2", *extra]
        ),
        env=environ,
        capture_output=True,
        text=True,
        timeout=200,
    )  # fmt: skip
    assert driver.returncode == 0, driver.stderr[-3000:]
    report = json.loads(driver.stdout.splitlines()[-1])
    assert report["tokens"] == tiny_llama_greedy
    assert report["hosts"] == hosts_by_rank
    assert report["connection"] == f"the Ray cluster at {h1.address}:{HEAD_PORT} (RAY_ADDRESS)"
    assert wait_gone(report["ranks"], 5.0) == []


def _command(pid: int) -> str:
    with contextlib.suppress(OSError):
        state, parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:120]
        return f"{pid} (parent {parent}, state {state}): {command.strip()}"
    return f"{pid} (gone)"
