"""The MPI communicator: the whole conformance suite at world sizes 1-4 (ranks started by
mpiexec), the model's greedy tokens over MPI under mpiexec, refusal under an executor that
starts its own processes, and no MPI initialization (or /dev/shm segment) outside mpiexec."""

import json
import os
import subprocess
import sys

import pytest

from shardline.errors import BackendUnavailableError
from shardline.interfaces import Rendezvous
from shardline.launch.launchers import run_launched
from support.cli import shardline

SUITE_TIMEOUT = 900


@pytest.mark.timeout(SUITE_TIMEOUT + 60)
def test_mpi_passes_the_whole_suite(tmp_path, own_shm):
    report_path = tmp_path / "mpi.json"
    # World sizes 2 and 4 here (CI time); `shardline conformance mpi` runs 1-4 by default.
    result = shardline(
        "conformance",
        "mpi",
        "--world-sizes=2,4",
        "--report",
        str(report_path),
        timeout=SUITE_TIMEOUT,
        wrap=own_shm.wrap,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    report = json.loads(report_path.read_text())
    assert report["summary"] == {"passed": report["summary"]["passed"]}
    assert report["summary"]["passed"] > 500
    assert {case["world_size"] for case in report["cases"]} == {2, 4}
    assert report["matrix"]["all_reduce[sum]"]["bfloat16"] == dict.fromkeys("24", "passed")
    assert own_shm.entries() == []


@pytest.mark.timeout(180)
def test_model_over_mpi_under_mpiexec(tiny_llama_dir, tiny_llama_greedy, own_shm):
    run = run_launched(
        "mpiexec",
        2,
        [
            "-m",
            "support.launched_driver",
            str(tiny_llama_dir),
            "1",
            "2",
            "parallel.communicator=mpi",
            "parallel.control_communicator=mpi",
        ],
        timeout_s=150,
        wrap=own_shm.wrap,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert json.loads(line)["tokens"] == tiny_llama_greedy
    assert run.leftovers == [] and own_shm.entries() == []


@pytest.mark.timeout(180)
def test_native_all_reduce_under_mpiexec_sums_as_all_reduce_and_times_out_as_it(own_shm):
    """The MPI communicator's C entry point (the one decode_layers calls between layers): 3
    ranks, same bits as ``all_reduce`` on every rank, calls go on after it, an MPI error code
    comes back as MPI's text, and a rank that never joins makes the others' call fail with
    all_reduce's timeout error at the group's 2 s deadline (after which the job ends itself
    with MPI_Abort, as after any MPI timeout)."""
    pytest.importorskip("shardline_mpi._native", reason="the MPI extension is not built")
    pytest.importorskip("shardline.layers._kernels", reason="the kernels extension is not built")
    run = run_launched(
        "mpiexec", 3, ["-m", "support.mpi_native_runs", "5", "1"], timeout_s=150, wrap=own_shm.wrap
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("[")]
    assert len(lines) == 1, run.stdout[-2000:] + run.stderr[-3000:]
    reports = json.loads(lines[0])
    for rank, report in enumerate(reports):
        assert report["native"] and report["failures"] == [None] * 5, report
        assert report["same_bits"], f"rank {rank}: native sums differ from all_reduce's"
        assert report["after"] == [3.0] * 3
        # MPI's own text reaches the error, with the rank, typed as the Python path types it.
        mpi_error = report["mpi_error"]
        assert mpi_error["type"] == "CommunicationError", mpi_error
        assert mpi_error["message"].startswith(f"mpi all_reduce on rank {rank} of 3: MPI_ERR_OP")
        assert "(MPI error code " in mpi_error["message"]
    assert reports[1]["silent"] is None
    for rank in (0, 2):
        silent = reports[rank]["silent"]
        assert silent["type"] == "CommTimeoutError"
        assert silent["message"] == (
            f"mpi all_reduce on rank {rank} of 3: no answer from peers within 2 s"
        )
        assert 2.0 <= silent["seconds"] < 3.5
    assert "MPI_ABORT was invoked" in run.stderr
    assert run.leftovers == [] and own_shm.entries() == []


def test_mpi_is_refused_under_an_executor_that_starts_processes():
    result = shardline(
        "config",
        "validate",
        "--set",
        "parallel.communicator=mpi",
        "--set",
        "parallel.tensor_parallel_size=2",
    )
    assert result.returncode == 2
    assert (
        "parallel.communicator = 'mpi': needs ranks started by mpiexec (executor "
        "external_launcher under mpiexec), but the executor 'mp' starts its own processes; "
        "allowed here: custom_ar, gloo" in result.stderr
    )
    # explain says the same of the alternatives it lists (it once called mpi "fits").
    explained = shardline("explain", "--set", "parallel.tensor_parallel_size=2").stdout
    block = explained.split("parallel.communicator:")[1].split("\n\n")[0]
    (mpi_line,) = [line for line in block.splitlines() if line.split()[:1] == ["mpi"]]
    assert "needs ranks started by mpiexec" in mpi_line, block


def test_outside_mpiexec_nothing_initializes_mpi(own_shm):
    probe = (
        "import sys\n"
        "from shardline.registry import Registry\n"
        "registry = Registry.load()\n"
        "assert registry.get('communicator', 'mpi').unavailable_reason() is None\n"
        "backend = registry.get('communicator', 'mpi').load_available()()\n"
        "print('mpi4py' in sys.modules and hasattr(sys.modules['mpi4py'], 'MPI'))\n"
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI"))}
    result = subprocess.run(
        own_shm.wrap([sys.executable, "-c", probe]),
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
    )
    assert result.stdout.strip() == "False", result.stderr
    assert own_shm.entries() == []


def test_init_world_outside_mpiexec_names_the_launcher(monkeypatch):
    from shardline_mpi.communicator import MpiBackend

    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(BackendUnavailableError, match="needs ranks started by mpiexec"):
        MpiBackend().init_world(0, 1, Rendezvous("127.0.0.1", 1), 5.0)
