"""``parallel.cpu_binding``: parsed with clear errors, split over a host's cores, and applied for
real: mp workers each on their own cores with one torch thread per core, the driver beside the
rank that does not reply and given its cores back at shutdown; launched ranks bind themselves.
Unbound, a pipeline stage's C kernels take the cores of the stages that wait. The tokens stay
transformers'."""

import json
import os

import pytest
import torch

from shardline.config import load_config
from shardline.errors import ConfigError
from shardline.launch.core_binding import CoreBinding, auto_core_sets, bind_process
from shardline.launch.launchers import run_launched
from shardline.registry import Registry
from support.greedy_driver import GREEDY_TOKENS, run_script

CORES = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(
    len(CORES) < 2, reason="binding two ranks apart needs two cores this process may use"
)


def test_bindings_parse_into_core_sets():
    assert CoreBinding.parse("none").core_sets_for(2, [0, 1]) is None
    assert CoreBinding.parse("0-2|3,5-6").core_sets == (
        frozenset({0, 1, 2}),
        frozenset({3, 5, 6}),
    )
    assert CoreBinding.parse("4|4").core_sets_for(2, range(8)) == [{4}, {4}]
    # One core written as a number (YAML reads `cpu_binding: 3` so) is that core.
    config = load_config(overrides=["parallel.cpu_binding=3"], environ={}).config
    assert config.parallel.core_binding.core_sets == (frozenset({3}),)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (" ", "'' is not a core or a range of cores"),
        ("0-", "'0-' is not a core or a range of cores"),
        ("0|", "'' is not a core or a range of cores"),
        ("1,two", "'two' is not a core or a range of cores"),
        ("\u0663", "'\u0663' is not a core or a range of cores"),
        ("3-1", "the range '3-1' ends before it starts"),
        ("8192", "'8192' names a core above 8191"),
        ("|".join(["0-8191"] * 9), "its sets name 73728 cores, more than 65536"),
    ],
)
def test_a_bad_binding_names_the_value_and_what_is_allowed(text, reason):
    with pytest.raises(ConfigError) as raised:
        load_config(overrides=[f"parallel.cpu_binding={text}"], environ={})
    message = str(raised.value)
    assert f"cpu_binding = {text!r}: {reason}; allowed: 'none', 'auto'" in message


def test_auto_splits_the_cores_in_order():
    assert auto_core_sets([0, 1, 2, 3, 4], 2) == [{0, 1, 2}, {3, 4}]
    assert auto_core_sets([2, 3, 6, 7], 4) == [{2}, {3}, {6}, {7}]
    # Fewer cores than ranks: ranks take the cores in turn, one each.
    assert auto_core_sets([0, 1], 4) == [{0}, {1}, {0}, {1}]
    assert CoreBinding.parse("auto").core_sets_for(2, [5, 1]) == [{1}, {5}]


def test_explicit_sets_must_fit_the_ranks_and_the_allowed_cores():
    with pytest.raises(ConfigError, match=r"names 3 core sets for 2 ranks on this host"):
        CoreBinding.parse("0|1|2").core_sets_for(2, range(4))
    with pytest.raises(ConfigError) as raised:
        CoreBinding.parse("0-1|4-6,9").core_sets_for(2, range(4))
    assert "may not run on (4-6,9); allowed: 0-3" in str(raised.value)
    assert raised.value.field == "parallel.cpu_binding"


def _mp_executor(model, *extra):
    config = load_config(
        overrides=[
            f"model.path={model}",
            "cache.block_size=4",
            "cache.num_blocks=40",
            "parallel.tensor_parallel_size=2",
            "parallel.distributed_executor_backend=mp",
            *extra,
        ],
        environ={},
    ).config
    return Registry.load().get("executor", "mp").load_available()(config)


def _cores_and_threads(worker):
    return sorted(os.sched_getaffinity(0)), torch.get_num_threads()


@needs_two_cores
@pytest.mark.timeout(120)
def test_mp_auto_binds_each_worker_apart_and_the_driver_beside_the_other_rank(
    tiny_llama_dir, tiny_llama_greedy
):
    before = os.sched_getaffinity(0)
    executor = _mp_executor(tiny_llama_dir, "parallel.cpu_binding=auto")
    try:
        expected = auto_core_sets(CORES, 2)
        placed = executor.collective_rpc(_cores_and_threads)
        assert [set(cores) for cores, _ in placed] == expected
        assert [threads for _, threads in placed] == [len(cores) for cores in expected]
        other_rank = 1 - executor.output_rank
        assert os.sched_getaffinity(0) == expected[other_rank]
        tokens = run_script(lambda step: executor.execute_model(step).result(60), GREEDY_TOKENS)
        assert tokens == tiny_llama_greedy
    finally:
        executor.shutdown()
        restored = os.sched_getaffinity(0)
        bind_process(before)  # this test's process keeps its cores whatever happened
    assert restored == before


@pytest.mark.timeout(60)
def test_mp_refuses_a_binding_that_does_not_fit_before_starting_anything(tiny_llama_dir):
    with pytest.raises(ConfigError, match=r"names 3 core sets for 2 ranks on this host"):
        _mp_executor(tiny_llama_dir, "parallel.cpu_binding=0|0|0")


@needs_two_cores
@pytest.mark.timeout(180)
def test_launched_ranks_bind_themselves(tiny_llama_dir, tiny_llama_greedy, own_shm):
    binding = f"{CORES[1]}|{CORES[0]}"
    run = run_launched(
        "torchrun",
        2,
        ["-m", "support.launched_driver", str(tiny_llama_dir), "2", "1",
         f"parallel.cpu_binding={binding}"],
        timeout_s=150,
        wrap=own_shm.wrap,
    )  # fmt: skip
    assert run.returncode == 0, f"torchrun failed:\n{run.stdout}\n{run.stderr}"
    placed = {}
    for line in run.stdout.splitlines():
        if line.startswith("cores "):
            _, rank, cores, threads = line.split(" ", 3)
            placed[int(rank)] = (json.loads(cores), int(threads))
    assert placed == {0: ([CORES[1]], 1), 1: ([CORES[0]], 1)}
    (report,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert report["tokens"] == tiny_llama_greedy
    assert run.leftovers == []
    assert own_shm.entries() == []


def test_bench_decode_runs_each_case_once_per_binding_and_refuses_a_bad_one():
    from shardline.cli.bench_decode import _executor_cell, plan

    cases = plan("m", 8, 2, ["tp1", "tp2"], {"gloo": None}, [2], 60, cpu_bindings=("none", "auto"))
    shardline = [(case.layout, case.cpu_binding) for case in cases if case.engine == "shardline"]
    assert shardline == [("tp1", "none"), ("tp1", "auto"), ("tp2", "none"), ("tp2", "auto")]
    assert _executor_cell({"executor": "mp", "cpu_binding": "auto"}) == "mp, cores auto"
    with pytest.raises(ConfigError, match=r"--cpu-binding: cpu_binding = 'x': 'x' is not a core"):
        plan("m", 8, 2, ["tp2"], {"gloo": None}, [], 60, cpu_bindings=("x",))


def _threads_of_torch_and_kernels(worker):
    kernels = worker.model_runner.model.kernels
    team = getattr(kernels, "team", None)  # the C path's, where the extension runs
    native = getattr(kernels, "native", None)
    return torch.get_num_threads(), None if native is None else native.team_threads(team)


@pytest.mark.parametrize(
    ("overrides", "at_once"),
    [
        (["parallel.pipeline_parallel_size=2"], 1),  # one stage computes at a time
        (["parallel.pipeline_parallel_size=2", "parallel.tensor_parallel_size=2"], 2),
        (["parallel.tensor_parallel_size=2"], 2),
        (["parallel.data_parallel_size=2", "parallel.data_parallel_rank=0",
          "parallel.pipeline_parallel_size=2"], 2),  # two worlds side by side
    ],
)  # fmt: skip
def test_a_stage_s_kernels_take_the_cores_of_the_stages_that_wait(overrides, at_once):
    from shardline.launch.threads import stage_threads

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a rank's share of a host it shares with others
    try:
        parallel = load_config(overrides=overrides, environ={}).config.parallel
        assert stage_threads(parallel, {}) == max(1, len(CORES) // at_once)
        # Bound ranks, ranks on several hosts and a thread count the user chose keep torch's.
        for kept, env in (
            (["parallel.cpu_binding=auto"], {}),
            (["parallel.nnodes=2"], {}),
            ([], {"OMP_NUM_THREADS": "1"}),
        ):
            parallel = load_config(overrides=[*overrides, *kept], environ={}).config.parallel
            assert stage_threads(parallel, env) == 1
    finally:
        torch.set_num_threads(threads)


@needs_two_cores
@pytest.mark.skipif(
    "OMP_NUM_THREADS" in os.environ, reason="OMP_NUM_THREADS set: ranks keep the threads it says"
)
@pytest.mark.timeout(120)
def test_pp2_workers_share_every_core_in_their_kernels(tiny_llama_dir, tiny_llama_greedy):
    executor = _mp_executor(
        tiny_llama_dir, "parallel.tensor_parallel_size=1", "parallel.pipeline_parallel_size=2"
    )
    try:
        placed = executor.collective_rpc(_threads_of_torch_and_kernels)
        cores_each = max(1, len(CORES) // 2)
        assert [torch_threads for torch_threads, _ in placed] == [cores_each] * 2
        if placed[0][1] is not None:  # the C kernels: a team of every core of the host
            assert [team for _, team in placed] == [len(CORES)] * 2
        tokens = run_script(lambda step: executor.execute_model(step).result(60), GREEDY_TOKENS)
        assert tokens == tiny_llama_greedy
    finally:
        executor.shutdown()
