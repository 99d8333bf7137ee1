"""Worker + ModelRunner end to end: scripted steps (mixed prefill and decode, a prompt split
over two steps, growing block tables, an empty step) give transformers' greedy tokens under
the uni executor (TP=1) and through the mp executor in real gloo worlds (TP=2, TP=4, PP=2,
TP=2 x PP=2)."""

import pytest

from shardline.config import load_config
from shardline.interfaces.step import SamplingParams
from shardline.registry import Registry
from support.greedy_driver import GREEDY_TOKENS, PROMPT_A, PROMPT_B, run_script

pytestmark = pytest.mark.timeout(300)


def _config(tiny_llama_dir, tp=1, pp=1, executor="auto"):
    return load_config(
        overrides=[
            f"model.path={tiny_llama_dir}",
            "cache.block_size=4",
            "cache.num_blocks=40",
            f"parallel.tensor_parallel_size={tp}",
            f"parallel.pipeline_parallel_size={pp}",
            f"parallel.distributed_executor_backend={executor}",
        ],
        environ={},
    ).config


def test_uni_executor_generates_transformers_tokens(tiny_llama_dir, tiny_llama_greedy):
    config = _config(tiny_llama_dir, executor="uni")
    executor = Registry.load().get("executor", "uni").load_available()(config)
    try:
        assert executor.output_rank == 0
        assert run_script(lambda s: executor.execute_model(s).result(), GREEDY_TOKENS) == (
            tiny_llama_greedy
        )
        assert executor.collective_rpc(lambda worker: worker.rank) == [0]
        assert executor.collective_rpc("load_model", non_block=True).result() == [None]
        executor.check_health()
    finally:
        executor.shutdown()
        executor.shutdown()  # idempotent
    with pytest.raises(Exception, match="shut down"):
        executor.check_health()


@pytest.mark.parametrize(
    ("tp", "pp"), [(2, 1), (4, 1), (1, 2), (2, 2)], ids=["tp2", "tp4", "pp2", "tp2pp2"]
)
def test_workers_generate_transformers_tokens(tiny_llama_dir, tiny_llama_greedy, tp, pp):
    """Through the mp executor, every rank's reply collected: only the output rank returns
    something."""
    config = _config(tiny_llama_dir, tp, pp, executor="mp")
    output_rank = config.parallel.layout.output_rank
    replies_seen = []
    executor = Registry.load().get("executor", "mp").load_available()(config)
    try:

        def execute(step):
            replies = executor.collective_rpc("execute_model", (step,))
            replies_seen.append([r is not None for r in replies])
            return replies[output_rank]

        assert run_script(execute, GREEDY_TOKENS) == tiny_llama_greedy
    finally:
        executor.shutdown()
    # Only the output rank ever returned something.
    for seen in replies_seen[:-1]:
        assert seen == [rank == output_rank for rank in range(tp * pp)]


def _runner_steps(worker, steps):
    """Run steps through this rank's ModelRunner directly (TP ranks of the last stage all
    sample)."""
    return [worker.model_runner.execute_model(step, None) for step in steps]


def test_every_tp_rank_samples_the_same_tokens(tiny_llama_dir):
    from shardline.interfaces.step import CachedRequest, NewRequest, SamplingParams, SchedulerOutput

    hot = SamplingParams(temperature=1.5, top_k=50, top_p=0.95, seed=1234)
    steps = [
        SchedulerOutput(
            new_requests=[
                NewRequest("A", PROMPT_A, hot, [0, 1, 2]),
                NewRequest("B", PROMPT_B, hot, [3]),
            ],
            num_scheduled_tokens={"A": len(PROMPT_A), "B": len(PROMPT_B)},
        )
    ]
    for i in range(4):
        steps.append(
            SchedulerOutput(
                cached_requests=[
                    CachedRequest("A", [10 + i], [], len(PROMPT_A) + i),
                    CachedRequest("B", [20 + i], [4] if i == 1 else [], len(PROMPT_B) + i),
                ],
                num_scheduled_tokens={"A": 1, "B": 1},
            )
        )
    config = _config(tiny_llama_dir, tp=2, executor="mp")
    executor = Registry.load().get("executor", "mp").load_available()(config)
    try:
        per_rank = executor.collective_rpc(_runner_steps, (steps,))
    finally:
        executor.shutdown()
    assert per_rank[0] == per_rank[1]
    assert all(token is not None for output in per_rank[0] for token in output.sampled_token_ids)


def test_runner_refuses_inconsistent_schedules(tiny_llama_dir):
    from shardline.errors import WorkerError
    from shardline.interfaces.step import CachedRequest, NewRequest, SchedulerOutput

    executor = (
        Registry.load()
        .get("executor", "uni")
        .load_available()(_config(tiny_llama_dir, executor="uni"))
    )
    try:
        too_few_blocks = SchedulerOutput(
            new_requests=[NewRequest("A", PROMPT_A, SamplingParams(), [0])],
            num_scheduled_tokens={"A": 8},
        )
        with pytest.raises(
            WorkerError, match=r"request 'A': 8 tokens need 2 cache blocks, the scheduler gave 1"
        ) as raised:
            executor.execute_model(too_few_blocks).result()
        assert raised.value.exc_type == "ValueError" and raised.value.rank == 0
        unknown = SchedulerOutput(
            cached_requests=[CachedRequest("Z", [1], [], 0)], num_scheduled_tokens={"Z": 1}
        )
        with pytest.raises(WorkerError, match="continued request 'Z', which this rank never saw"):
            executor.execute_model(unknown).result()
    finally:
        executor.shutdown()
