"""Round trip of ``execute_model`` through the mp executor, against a multiprocessing Pipe.

Starts the mp executor with 2 workers (TP=2) on the given model, then times ``execute_model``
with a small scheduler output that schedules no tokens (so the time is the executor's: the
broadcast, the workers' dispatch and the output rank's reply). In the same run it times a
plain ``multiprocessing.Pipe`` echo to a child process (the baseline) and the shared-memory
ring alone, 2 readers, one echoing (the transport's floor). Prints median and p90
in microseconds, a table, and JSON with ``--json``.

    python benchmarks/rpc_roundtrip.py --model PATH [--iterations 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import statistics
import sys
import time

from shardline.config import load_config
from shardline.interfaces.step import SchedulerOutput
from shardline.registry import Registry
from shardline_executors.shm_ring import ShmRing


def _echo(connection) -> None:
    while True:
        message = connection.recv()
        if message is None:
            return
        connection.send(message)


def _summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p90_us": ordered[int(0.9 * (len(ordered) - 1))] * 1e6,
        "iterations": len(ordered),
    }


def time_pipe(iterations: int, message: object) -> dict:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_echo, args=(child,), daemon=True)
    process.start()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        parent.send(message)
        parent.recv()
        samples.append(time.perf_counter() - start)
    parent.send(None)
    process.join(5)
    return _summary(samples)


def _ring_reader(rank: int, calls_handle, replies_handle) -> None:
    calls, replies = ShmRing.attach(calls_handle), ShmRing.attach(replies_handle)
    try:
        while (message := calls.get(rank)) != b"stop":
            if rank == 0:
                replies.put(message)
    finally:
        calls.close()
        replies.close()


def time_ring(iterations: int, message: bytes, readers: int = 2) -> dict:
    """The transport alone: the executor's ring, ``readers`` reader processes, reader 0
    echoing on a reply ring (what the executor adds on top is pickling and dispatch)."""
    calls, replies = ShmRing.create(readers=readers), ShmRing.create(readers=1)
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_ring_reader, args=(rank, calls.handle, replies.handle))
        for rank in range(readers)
    ]
    try:
        for process in processes:
            process.start()
        for _ in range(100):  # warm-up (also waits for the readers to start)
            calls.put(message)
            replies.get(0, deadline=time.monotonic() + 60)
        samples = []
        for _ in range(iterations):
            start = time.perf_counter()
            calls.put(message)
            replies.get(0)
            samples.append(time.perf_counter() - start)
        calls.put(b"stop")
        for process in processes:
            process.join(5)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        calls.close()
        replies.close()
    return _summary(samples)


def time_executor(model: str, iterations: int, step: SchedulerOutput) -> dict:
    config = load_config(
        overrides=[
            f"model.path={model}",
            "parallel.tensor_parallel_size=2",
            "parallel.distributed_executor_backend=mp",
        ],
        environ={},
    ).config
    executor = Registry.load().get("executor", "mp").load_available()(config)
    try:
        for _ in range(100):  # warm-up
            executor.execute_model(step).result()
        samples = []
        for _ in range(iterations):
            start = time.perf_counter()
            executor.execute_model(step).result()
            samples.append(time.perf_counter() - start)
    finally:
        executor.shutdown()
    return _summary(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF directory or GGUF file")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    step = SchedulerOutput(finished_req_ids={"r0"})
    results = {
        "mp execute_model (2 workers)": time_executor(args.model, args.iterations, step),
        "shm ring echo (2 readers)": time_ring(
            args.iterations, pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        ),
        "multiprocessing.Pipe echo": time_pipe(args.iterations, step),
    }
    print(f"{'round trip':<30} {'median us':>10} {'p90 us':>10}")
    for name, row in results.items():
        print(f"{name:<30} {row['median_us']:>10.1f} {row['p90_us']:>10.1f}")
    executor = results["mp execute_model (2 workers)"]["median_us"]
    for baseline, label in (
        ("multiprocessing.Pipe echo", "pipe"),
        ("shm ring echo (2 readers)", "ring"),
    ):
        print(f"executor / {label} median: {executor / results[baseline]['median_us']:.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
