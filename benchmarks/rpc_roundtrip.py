"""Round trip of ``execute_model`` through the mp executor, against a multiprocessing Pipe.

Starts the mp executor with 2 workers (TP=2) on the given model (SmolLM2-135M by default),
then times ``execute_model`` with a small scheduler output that schedules no tokens (so the
time is the executor's: the broadcast, the workers' dispatch and the output rank's reply). In
the same run it times a plain ``multiprocessing.Pipe`` echo to a child process (the baseline)
and the shared-memory ring alone, 2 readers, one echoing (the transport's floor). The
executor and the ring run twice in the same run: with the ring's C word operations (the
default where the extension is built) and with the pure-Python fallback
(``SHARDLINE_NATIVE=0``, inherited by the workers).
With the C ring the executor is also timed pinned, in the two placements three processes
have on two cores: the driver on one core with the output rank (the rank that replies) or
with the other rank (every thread of each process pinned; a placement the scheduler may pick
for the unpinned run), and bound by the executor itself (``parallel.cpu_binding=auto``: each
worker on its own core, the driver beside the rank that does not reply). As placed by the
scheduler, the core each of the three processes last ran on is sampled every 50 calls (between
calls, from ``/proc/PID/stat``), and the shares of the placements seen are printed below the
table: the time of that row depends on which two processes share a core. Prints median, p90,
p99 and mean in microseconds (the mean shows a reader that falls behind and catches up in
bursts, which percentiles can hide) and, for the executor, the driver's CPU time per call
(every thread's, its waits' spinning included), a table, and JSON with ``--json``.

    python benchmarks/rpc_roundtrip.py [--model smollm2-135m] [--iterations 2000]
        [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import pickle
import statistics
import sys
import time

from shardline.catalog import resolve_model_path
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
        "p99_us": ordered[int(0.99 * (len(ordered) - 1))] * 1e6,
        "mean_us": statistics.fmean(ordered) * 1e6,
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


@contextlib.contextmanager
def ring_path(native: bool):
    """``SHARDLINE_NATIVE`` for this process and the processes it starts meanwhile."""
    before = os.environ.get("SHARDLINE_NATIVE")
    os.environ["SHARDLINE_NATIVE"] = "1" if native else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["SHARDLINE_NATIVE"]
        else:
            os.environ["SHARDLINE_NATIVE"] = before


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
    prefix = f"shardline-bench-{os.getpid()}"
    calls = ShmRing.create(f"{prefix}-calls", readers=readers)
    replies = ShmRing.create(f"{prefix}-replies", readers=1)
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


def _pin_process(cores: set[int]) -> None:
    """Every thread of this process on ``cores`` (threads started later inherit it)."""
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(thread), cores)


def _pin_rank(worker, cores_by_rank: dict[int, set[int]]) -> None:
    """In a worker (through ``collective_rpc``): pin this rank's process."""
    _pin_process(cores_by_rank[worker.rank])


#: Where a placement runs the driver, and each rank.
Placement = tuple[set[int], dict[int, set[int]]]
#: Calls between two samples of where the processes run (as placed).
SAMPLE_EVERY = 50


def _process_id(worker) -> int:
    """In a worker (through ``collective_rpc``): its process id."""
    return os.getpid()


def _last_core(pid: int) -> int:
    """The core process ``pid``'s main thread last ran on (field 39 of ``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as stat:
        after_name = stat.read().rsplit(")", 1)[1].split()  # fields 3 onwards
    return int(after_name[36])


def _shared_core(driver: int, output_rank: int, other_rank: int) -> str:
    """Which processes share a core, from the cores they last ran on."""
    if driver == output_rank:
        return "driver beside the output rank"
    if driver == other_rank:
        return "driver beside the other rank"
    if output_rank == other_rank:
        return "the two ranks on one core"
    return "each on its own core"


def placements(output_rank: int, pinned: bool) -> dict[str, Placement | None]:
    """Where the driver and the two ranks run, by row suffix: as the scheduler places them
    (None), and, when ``pinned`` and this process may use two cores or more, the driver
    pinned to one core with the output rank (the rank that replies) or with the other rank,
    the third process alone on a second core."""
    cores = sorted(os.sched_getaffinity(0))
    other_rank = 1 - output_rank
    found: dict[str, Placement | None] = {"": None}
    if pinned and len(cores) >= 2:
        first, second = {cores[0]}, {cores[1]}
        found[", driver on the output rank's core"] = (
            first,
            {output_rank: first, other_rank: second},
        )
        found[", driver on the other rank's core"] = (
            first,
            {other_rank: first, output_rank: second},
        )
    return found


def time_executor(
    model: str, iterations: int, step: SchedulerOutput, pinned: bool, binding: str = "none"
) -> dict[str, dict]:
    """The executor's round trip in each of :func:`placements` (only as placed unless
    ``pinned``), by the placement's row suffix; each also with the driver's CPU time per
    call (all its threads). With a ``binding`` (``parallel.cpu_binding``) the executor
    places its processes itself: one row, suffixed with it."""
    config = load_config(
        overrides=[
            f"model.path={model}",
            "parallel.tensor_parallel_size=2",
            "parallel.distributed_executor_backend=mp",
            f"parallel.cpu_binding={binding}",
        ],
        environ={},
    ).config
    executor = Registry.load().get("executor", "mp").load_available()(config)
    own_cores = os.sched_getaffinity(0)
    results = {}
    pids = executor.collective_rpc(_process_id)
    output_pid, other_pid = pids[executor.output_rank], pids[1 - executor.output_rank]
    bound = binding != "none"
    chosen = (
        {f", cpu_binding={binding}": None} if bound else placements(executor.output_rank, pinned)
    )
    try:
        for suffix, placement in chosen.items():
            if not bound:
                driver, ranks = placement or (own_cores, {0: own_cores, 1: own_cores})
                _pin_process(driver)
                executor.collective_rpc(_pin_rank, (ranks,))
            for _ in range(100):  # warm-up
                executor.execute_model(step).result()
            samples, seen = [], {}
            as_placed = placement is None and not bound
            cpu_start = time.process_time()
            for index in range(iterations):
                if as_placed and index % SAMPLE_EVERY == 0:
                    cores = [_last_core(pid) for pid in (os.getpid(), output_pid, other_pid)]
                    shared = _shared_core(*cores)
                    seen[shared] = seen.get(shared, 0) + 1
                start = time.perf_counter()
                executor.execute_model(step).result()
                samples.append(time.perf_counter() - start)
            cpu_us = (time.process_time() - cpu_start) / iterations * 1e6
            results[suffix] = _summary(samples) | {"driver_cpu_us": cpu_us}
            if seen:
                total = sum(seen.values())
                results[suffix]["placements"] = {k: n / total for k, n in seen.items()}
    finally:
        _pin_process(own_cores)
        executor.shutdown()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="smollm2-135m", help="catalog name, HF directory or GGUF file"
    )
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument(
        "--repeats", type=int, default=1, help="run everything this many times (medians)"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    model = str(resolve_model_path(args.model))
    step = SchedulerOutput(finished_req_ids={"r0"})
    message = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for native, path in ((True, "C"), (False, "Python")):
            with ring_path(native):
                timed = time_executor(model, args.iterations, step, pinned=native)
                if native:
                    timed |= time_executor(model, args.iterations, step, False, "auto")
                for suffix, summary in timed.items():
                    runs.setdefault(f"mp execute_model, 2 workers ({path}){suffix}", []).append(
                        summary
                    )
                runs.setdefault(f"shm ring echo, 2 readers ({path})", []).append(
                    time_ring(args.iterations, message)
                )
        runs.setdefault("multiprocessing.Pipe echo", []).append(time_pipe(args.iterations, step))
    results = {
        name: {
            key: statistics.median(run[key] for run in repeats)
            for key in ("median_us", "p90_us", "p99_us", "mean_us", "driver_cpu_us")
            if key in repeats[0]
        }
        | {"repeats": repeats}
        for name, repeats in runs.items()
    }
    print(f"{args.repeats} repeat(s) of {args.iterations} round trips; medians over repeats")
    width = max(len(name) for name in results)
    print(
        f"{'round trip':<{width}} {'median us':>10} {'p90 us':>10} {'p90/median':>11}"
        f" {'p99 us':>10} {'mean us':>10} {'driver CPU us/call':>19}"
    )
    for name, row in results.items():
        ratio = row["p90_us"] / row["median_us"]
        cpu = f"{row['driver_cpu_us']:.1f}" if "driver_cpu_us" in row else "-"
        print(
            f"{name:<{width}} {row['median_us']:>10.1f} {row['p90_us']:>10.1f} {ratio:>11.2f}"
            f" {row['p99_us']:>10.1f} {row['mean_us']:>10.1f} {cpu:>19}"
        )
    for name, row in results.items():
        for index, repeat in enumerate(row["repeats"]):
            if "placements" in repeat:
                shares = ", ".join(
                    f"{where} {share:.0%}" for where, share in sorted(repeat["placements"].items())
                )
                print(
                    f"{name}, repeat {index + 1}: median {repeat['median_us']:.1f} us; where the"
                    f" processes last ran, sampled every {SAMPLE_EVERY} calls: {shares}"
                )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
