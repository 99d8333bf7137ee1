"""The external_launcher executor: launcher variables parsed with clear errors, and real
2-rank worlds under torchrun and mpiexec giving transformers' greedy tokens, printed once,
with no process or shared-memory segment left."""

import json

import pytest
import torch

from shardline.config import load_config
from shardline.conformance.faults.scenarios import DEADLINE_SLACK_S, SHUTDOWN_LIMIT_S
from shardline.engine import LLM, SamplingParams
from shardline.errors import ConfigError
from shardline.launch.launcher_env import LaunchedRank, local_rank
from shardline.launch.launchers import run_launched
from shardline.worker.model_runner import rank_device
from shardline_executors.external_launcher import ExternalLauncherExecutor
from support.tiny_llama import write_tiny_llama
from support.tiny_tokenizer import add_tiny_tokenizer

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RESTART_COUNT": "2",
}


def test_torchrun_variables():
    launched = LaunchedRank.from_environ(TORCHRUN)
    assert (launched.launcher, launched.rank, launched.world_size) == ("torchrun", 1, 2)
    assert (launched.master_addr, launched.master_port) == ("10.0.0.1", 29500)
    assert launched.agent_store and launched.restart == 2


def test_mpiexec_variables():
    openmpi = LaunchedRank.from_environ(
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        }
    )
    assert (openmpi.launcher, openmpi.rank, openmpi.world_size) == ("mpiexec (OpenMPI)", 3, 4)
    assert openmpi.local_rank == 1 and openmpi.master_addr is None and not openmpi.agent_store
    mpich = LaunchedRank.from_environ({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_PORT": "7000"})
    assert (mpich.launcher, mpich.rank, mpich.master_port) == ("mpiexec (MPICH/PMI)", 0, 7000)


def test_a_rank_computes_on_the_device_of_its_local_rank():
    second_host = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    }
    assert local_rank(3, second_host) == 1
    assert rank_device("cuda", 3, second_host) == torch.device("cuda", 1)
    # Without a launcher every rank is on this host: the world rank is the local rank.
    assert local_rank(2, {}) == 2 and rank_device("cuda", 2, {}) == torch.device("cuda", 2)
    assert rank_device("cpu", 3, second_host) == torch.device("cpu")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "none of RANK/WORLD_SIZE"),
        ({**TORCHRUN, "RANK": "2"}, r"environment RANK = '2': expected an integer >= 0 and < "),
        ({**TORCHRUN, "WORLD_SIZE": "two"}, "environment WORLD_SIZE = 'two'"),
        ({**TORCHRUN, "MASTER_PORT": ""}, "MASTER_ADDR / MASTER_PORT are not both set"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_PORT": "-1"}, "MASTER_PORT = '-1'"),
    ],
)
def test_bad_launcher_variables_name_the_variable(environ, message):
    with pytest.raises(ConfigError, match=message):
        LaunchedRank.from_environ(environ)


def test_world_size_must_match_the_layout(tiny_llama_dir):
    config = load_config(
        overrides=[f"model.path={tiny_llama_dir}", "parallel.tensor_parallel_size=2"],
        environ={},
    ).config
    with pytest.raises(ConfigError, match=r"torchrun started 3 ranks but the .* layout needs 2"):
        ExternalLauncherExecutor(config, {**TORCHRUN, "WORLD_SIZE": "3"})


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("launcher", "tp", "pp"),
    [
        ("torchrun", 2, 1),
        ("torchrun", 1, 2),
        ("mpiexec", 2, 1),
        ("mpiexec", 1, 2),
        # MASTER_ADDR/MASTER_PORT given to mpiexec: rank 0 serves the store there, no mpi4py.
        ("mpiexec+master", 2, 1),
    ],
)
def test_launched_world_generates_transformers_tokens(
    tiny_llama_dir, tiny_llama_greedy, own_shm, launcher, tp, pp
):
    run = run_launched(
        launcher,
        2,
        ["-m", "support.launched_driver", str(tiny_llama_dir), str(tp), str(pp)],
        timeout_s=150,
        wrap=own_shm.wrap,
    )
    assert run.returncode == 0, f"{launcher} failed:\n{run.stdout}\n{run.stderr}"
    printed = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1, f"expected one report (rank 0 only), got:\n{run.stdout}"
    report = json.loads(printed[0])
    assert report["executor"] == "external_launcher"
    assert report["tokens"] == tiny_llama_greedy
    assert run.leftovers == []
    assert own_shm.entries() == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
def test_pipeline_stages_overlapping_steps_give_the_same_answers(tmp_path, own_shm, launcher):
    """PP=2 with six conversations at once: the last stage sends each step's result as soon as
    it has it and the first stage receives it when its engine asks (two steps in flight).
    Every answer and the embedding equal one process's (uni) on the same model."""
    model = add_tiny_tokenizer(write_tiny_llama(tmp_path / "model", max_position_embeddings=256))
    questions = [f"question {i}: {'why ' * i}" for i in range(6)]
    run = run_launched(
        launcher,
        2,
        ["-m", "support.llm_driver", str(model), "12", *questions, "--embed", "a text",
         "--", "parallel.pipeline_parallel_size=2", "parallel.timeout_s=60"],
        timeout_s=200,
        wrap=own_shm.wrap,
    )  # fmt: skip
    assert run.returncode == 0, f"{launcher} failed:\n{run.stdout}\n{run.stderr}"
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("{")]
    report = json.loads(line)
    assert report["executor"] == "external_launcher"
    with LLM(overrides=[f"model.path={model}"]) as llm:
        conversations = [[{"role": "user", "content": q}] for q in questions]
        expected = llm.chat(conversations, SamplingParams(max_tokens=12))
        (embedding,) = llm.embed("a text")
    assert report["tokens"] == [output.token_ids for output in expected]
    assert all(len(tokens) == 12 for tokens in report["tokens"])
    torch.testing.assert_close(torch.tensor(report["embedding"]), embedding)
    assert run.leftovers == []
    assert own_shm.entries() == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("launcher", "communicator"),
    [("torchrun", "gloo"), ("mpiexec", "mpi")],
)
def test_a_hung_last_stage_ends_the_world_in_time(tmp_path, own_shm, launcher, communicator):
    """PP=2: the last stage (the output rank) hangs inside a step while the first stage
    waits for that step's result. The first stage raises CommTimeoutError naming rank 1
    within the deadline + 1 s, its engine shuts down cleanly (its pending send to the hung
    stage is dropped, not waited on), and its exit ends the world although its script
    catches the error and returns 0 (MPI_Abort in an MPI job, else exit status 1); nothing
    is left."""
    model = add_tiny_tokenizer(write_tiny_llama(tmp_path / "model", max_position_embeddings=256))
    timeout_s = 3.0
    run = run_launched(
        launcher,
        2,
        ["-m", "support.stalled_stage_driver", str(model), "--",
         "parallel.pipeline_parallel_size=2", f"parallel.timeout_s={timeout_s}",
         f"parallel.communicator={communicator}",
         f"parallel.control_communicator={communicator}"],
        timeout_s=150,
        wrap=own_shm.wrap,
    )  # fmt: skip
    reports = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    (hung,) = [report for report in reports if "hung_at" in report]
    (first,) = [report for report in reports if report.get("rank") == 0]
    assert first["error"] == "CommTimeoutError", first
    assert "from rank 1" in first["message"], first  # gloo: recv from rank 1; mpi: no answer from
    assert first["raised_at"] - hung["hung_at"] <= timeout_s + DEADLINE_SLACK_S, first
    assert first["shutdown"] == "clean" and first["shutdown_s"] <= SHUTDOWN_LIMIT_S, first
    assert run.returncode != 0  # the launcher ended the hung rank when rank 0 exited 1
    assert run.leftovers == []
    assert own_shm.entries() == []


def test_a_last_pipeline_send_that_fails_at_shutdown_raises_after_the_meeting_is_left():
    """shutdown in a healthy world closes the Worker (which waits for its last pipeline
    send); when that send fails, the error comes out only after this rank has counted itself
    closing and closed its meeting (before, the meeting stayed open and the store-serving
    rank waited its full closing time for this one)."""
    from unittest import mock

    from shardline.errors import CommTimeoutError

    executor = object.__new__(ExternalLauncherExecutor)
    store = mock.Mock()
    store.add.return_value = 1
    meeting = mock.Mock(served_store=None)
    context = mock.Mock()
    context.close.side_effect = CommTimeoutError("send to rank 1: no answer within 3 s")
    executor.world_size, executor._failure, executor._result_send = 2, None, None
    executor._meeting, executor._context, executor._store = meeting, context, store
    with pytest.raises(CommTimeoutError, match="no answer"):
        executor.shutdown()
    context.close.assert_called_once_with(finish_sends=True)
    store.add.assert_any_call("closing", 1)
    meeting.close.assert_called_once_with()
    assert executor._meeting is None and executor._context is None
