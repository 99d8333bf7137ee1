"""A driver of the ray executor that waits to be killed: it starts the executor (its own Ray
instance where RAY_ADDRESS is not set), prints one JSON line with what Ray it is connected to
and its ranks' pids, then sleeps.

    python -m support.ray_idle_driver MODEL
"""

import json
import sys
import time

from shardline.config import load_config
from shardline.conformance.executors import probe
from shardline.registry import Registry


def main(model_path: str) -> None:
    config = load_config(
        overrides=[
            f"model.path={model_path}",
            "cache.block_size=4",
            "cache.num_blocks=40",
            "parallel.tensor_parallel_size=2",
            "parallel.distributed_executor_backend=ray",
        ],
        environ={},
    ).config
    executor = Registry.load().get("executor", "ray").load_available()(config)
    ranks = [pid for _, pid in executor.collective_rpc(probe.rank_and_pid)]
    print(json.dumps({"connection": executor.ray_connection, "ranks": ranks}), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1])
