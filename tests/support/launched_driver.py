"""A rank of a launched world (torchrun / mpiexec): builds the executor ``auto`` picks for
this process, runs the scripted greedy steps, and, in the process that reports results,
prints one JSON line with the executor's name and the generated tokens. Every rank also
prints ``cores RANK [CORES] THREADS``: the cores it may run on once its executor is built, and
torch's intra-op threads.

    python -m support.launched_driver MODEL TP PP [KEY=VALUE ...]   (extra config overrides)
"""

import json
import os
import sys

import torch

from shardline.config import load_config
from shardline.config.selection import choose_executor
from shardline.registry import Registry
from support.greedy_driver import GREEDY_TOKENS, run_script


def main(model_path: str, tp: int, pp: int, extra: list[str]) -> None:
    config = load_config(
        overrides=[
            f"model.path={model_path}",
            "cache.block_size=4",
            "cache.num_blocks=40",
            f"parallel.tensor_parallel_size={tp}",
            f"parallel.pipeline_parallel_size={pp}",
            "parallel.timeout_s=60",
            *extra,
        ],
        environ={},
    ).config
    registry = Registry.load()
    decision = choose_executor(config, registry, os.environ)
    executor = registry.get("executor", decision.chosen).load_available()(config)
    cores = json.dumps(sorted(os.sched_getaffinity(0)), separators=(",", ":"))
    rank = getattr(executor, "rank", 0)
    print(f"cores {rank} {cores} {torch.get_num_threads()}", flush=True)
    try:

        def execute(step):
            return executor.execute_model(step).result(timeout=60)

        tokens = run_script(execute, GREEDY_TOKENS)
    finally:
        executor.shutdown()
    if executor.reports_results:
        print(json.dumps({"executor": decision.chosen, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
