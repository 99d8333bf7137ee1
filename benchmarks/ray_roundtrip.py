"""Round trip of an empty ``execute_model`` through the ray executor beside the mp executor, in
the same run.

Each executor starts 2 ranks (TP=2) on the given model, one after the other, and ``execute_model``
is timed with a step that schedules no tokens (so the time is the executor's: the broadcast,
the ranks' dispatch and the output rank's reply). In the same Ray instance as the ray executor
(the cluster ``RAY_ADDRESS`` names, or one started on this host) it also times a call of an
empty method of one Ray actor: the floor Ray itself sets. Prints median and p90 in
microseconds, a table, the ratio ray / mp, and JSON with ``--json``.

    python benchmarks/ray_roundtrip.py --model PATH [--iterations 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import ray

from shardline.catalog import resolve_model_path
from shardline.config import load_config
from shardline.interfaces.step import SchedulerOutput
from shardline.registry import Registry
from shardline_ray import session

WARM_UP = 50


def _summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p90_us": ordered[int(0.9 * (len(ordered) - 1))] * 1e6,
        "iterations": len(ordered),
    }


def _timed(call: Callable[[], object], iterations: int) -> dict:
    for _ in range(WARM_UP):
        call()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return _summary(samples)


def time_executor(name: str, model: str, iterations: int) -> dict:
    config = load_config(
        overrides=[
            f"model.path={model}",
            "parallel.tensor_parallel_size=2",
            f"parallel.distributed_executor_backend={name}",
        ],
        environ={},
    ).config
    executor = Registry.load().get("executor", name).load_available()(config)
    step = SchedulerOutput(finished_req_ids={"r0"})
    try:
        return _timed(lambda: executor.execute_model(step).result(), iterations)
    finally:
        executor.shutdown()


class _Empty:
    def call(self) -> None:
        return None


def time_ray_actor(iterations: int) -> dict:
    actor = ray.remote(num_cpus=0.1)(_Empty).remote()
    try:
        return _timed(lambda: ray.get(actor.call.remote()), iterations)
    finally:
        ray.kill(actor)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF directory, GGUF file or catalog name")
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.model = resolve_model_path(args.model)
    results = {"mp execute_model (2 ranks)": time_executor("mp", args.model, args.iterations)}
    # One Ray connection for both Ray rows (a started instance lives until it is released).
    connection = session.connect(os.environ, cpus=2)
    try:
        results["ray execute_model (2 ranks)"] = time_executor("ray", args.model, args.iterations)
        results["ray actor, empty method"] = time_ray_actor(args.iterations)
    finally:
        connection.release()
    print(f"{'round trip':<30} {'median us':>10} {'p90 us':>10}")
    for name, row in results.items():
        print(f"{name:<30} {row['median_us']:>10.1f} {row['p90_us']:>10.1f}")
    ray_us = results["ray execute_model (2 ranks)"]["median_us"]
    ratios = {
        "ray / mp": ray_us / results["mp execute_model (2 ranks)"]["median_us"],
        "ray / ray actor": ray_us / results["ray actor, empty method"]["median_us"],
    }
    for label, ratio in ratios.items():
        print(f"{label} median: {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"results": results, "ratios": ratios}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
