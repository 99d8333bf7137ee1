"""A driver of the ray executor: the scripted greedy steps, then one JSON line with the tokens,
the host and pid of each rank, what Ray this process was connected to, and which of the
processes Ray started for it were still running after shutdown.

    python -m support.ray_driver MODEL TP PP [KEY=VALUE ...]   (extra config overrides)
"""

import json
import os
import sys
from pathlib import Path

from shardline.config import load_config
from shardline.conformance.executors import probe
from shardline.conformance.executors.checks import wait_gone
from shardline.registry import Registry
from support.greedy_driver import GREEDY_TOKENS, run_script


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().split()[3]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def main(model_path: str, tp: int, pp: int, extra: list[str]) -> None:
    config = load_config(
        overrides=[
            f"model.path={model_path}",
            "cache.block_size=4",
            "cache.num_blocks=40",
            f"parallel.tensor_parallel_size={tp}",
            f"parallel.pipeline_parallel_size={pp}",
            "parallel.distributed_executor_backend=ray",
            "parallel.timeout_s=60",
            *extra,
        ],
        environ={},
    ).config
    executor = Registry.load().get("executor", "ray").load_available()(config)
    started = children(os.getpid())
    try:
        tokens = run_script(
            lambda step: executor.execute_model(step).result(timeout=60), GREEDY_TOKENS
        )
        hosts = [place.node.hostname for place in executor.places]
        ranks = [pid for _, pid in executor.collective_rpc(probe.rank_and_pid)]
        connection = executor.ray_connection
    finally:
        executor.shutdown()
    report = {
        "tokens": tokens,
        "hosts": hosts,
        "ranks": ranks,
        "connection": connection,
        "left": wait_gone(started, 5.0),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
