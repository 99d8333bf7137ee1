"""``shardline bench comm``: collective and point-to-point timings of several communicators
side by side, after the OSU micro-benchmarks and nccl-tests methods.

Sizes go from ``-b`` to ``-e`` by factor ``-f`` (bytes of the whole buffer: the all-reduced
tensor, all-gather's output, reduce-scatter's input, the broadcast tensor, the p2p message).
Each size runs ``--warmup`` untimed then ``--iters`` timed iterations, with a barrier before
each (not timed). An iteration's time runs from the last rank's start to the last rank's end
(ranks of a local world share the host's clock), so the skew with which ranks leave the
barrier is not counted. ``--back-to-back`` leaves the barriers out (one before the first
iteration): a rank starts an iteration when it ends the previous one, as a model's layers call
them. ``--python-fallback NAMES`` runs those communicators again with ``SHARDLINE_NATIVE=0``
(their pure-Python paths, e.g. custom_ar's), in the same run. The table shows the median over
iterations (min / max in the JSON), algorithm bandwidth (bytes / time) and bus bandwidth
(algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather and reduce-scatter, x 1 otherwise).
p2p is the OSU latency: half a ping-pong between ranks 0 and 1.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from shardline.cli.bench_comm_options import BenchSettings, sizes
from shardline.cli.table import render
from shardline.errors import ConfigError
from shardline.interfaces import Communicator
from shardline.launch.comm_world import CommunicatorSetup, RankContext
from shardline.launch.local_world import LocalWorld
from shardline.native import SWITCH as NATIVE_SWITCH
from shardline.registry import Registry


def measure(ctx: RankContext, *arguments: Any) -> list[tuple[float, float]] | None:
    """:func:`measure_on` the rank's world communicator, with the same other arguments."""
    return measure_on(ctx.comm, *arguments)


def measure_on(
    comm: Communicator,
    operation: str,
    nbytes: int,
    dtype: str,
    warmup: int,
    iterations: int,
    back_to_back: bool = False,
) -> list[tuple[float, float]] | None:
    """This rank's (start, end) ``time.monotonic()`` pair per timed iteration of
    ``operation`` on ``nbytes`` over ``comm`` (None: rank not involved). The clock is the
    machine's, shared by the ranks of a local world (and by simulated hosts). A barrier
    precedes each iteration; ``back_to_back``: only the first, and an iteration starts where
    the previous one ended."""
    torch_dtype = getattr(torch, dtype)
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    count = max(1, nbytes // itemsize)
    if operation in ("all_gather", "reduce_scatter"):
        count = max(comm.world_size, count - count % comm.world_size)
    if operation == "all_gather":
        count //= comm.world_size
    tensor = torch.ones(count, dtype=torch_dtype)
    step, clock = _step(comm, operation, tensor), time.monotonic
    if back_to_back:  # the loop holds only the call and the clock: its cost is not the call's
        comm.barrier()
        ends = [0.0] * (warmup + iterations + 1)
        ends[0] = clock()
        for index in range(1, len(ends)):
            step()
            ends[index] = clock()
        samples = list(zip(ends[warmup:-1], ends[warmup + 1 :], strict=True))
    else:
        samples = []
        for index in range(warmup + iterations):
            comm.barrier()
            start = clock()
            step()
            end = clock()
            if index >= warmup:
                samples.append((start, end))
    return None if operation == "p2p" and comm.rank > 1 else samples


def _step(comm: Communicator, operation: str, tensor: torch.Tensor) -> Callable[[], object]:
    """One iteration of ``operation`` on ``tensor`` as a call of no arguments (p2p: rank 0
    sends and receives back, rank 1 the other way round, other ranks nothing)."""
    if operation == "all_reduce":
        return partial(comm.all_reduce, tensor)
    if operation == "all_gather":
        return partial(comm.all_gather, tensor)
    if operation == "reduce_scatter":
        return partial(comm.reduce_scatter, tensor)
    if operation == "broadcast":
        return partial(comm.broadcast, tensor, 0)
    if comm.rank > 1:
        return lambda: None
    peer = 1 - comm.rank

    def round_trip() -> None:
        if comm.rank == 0:
            comm.send(tensor, peer)
            comm.recv(tensor, peer)
        else:
            comm.recv(tensor, peer)
            comm.send(tensor, peer)

    return round_trip


def collective_times(per_rank: list[list[tuple[float, float]]], operation: str) -> list[float]:
    """Seconds per iteration: from the last rank's start to the last rank's end (the skew of
    the barrier before it is not the collective's); p2p: half of rank 0's round trip."""
    if operation == "p2p":
        return [(end - start) / 2 for start, end in per_rank[0]]
    return [
        max(end for _, end in pairs) - max(start for start, _ in pairs)
        for pairs in zip(*per_rank, strict=True)
    ]


def bus_factor(operation: str, ranks: int) -> float:
    if operation == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if operation in ("all_gather", "reduce_scatter"):
        return (ranks - 1) / ranks
    return 1.0


def communicator_launchers(settings: BenchSettings) -> dict[str, str | None]:
    """Each communicator of ``settings`` -> the launcher its ranks need (None: any).
    ConfigError when one is unknown or unavailable here, or p2p is asked of one rank."""
    registry = Registry.load()
    launchers = {}
    for name in settings.communicators:
        component = registry.get("communicator", name, "--communicators")
        component.load_available()
        capabilities = component.capabilities
        launchers[name] = capabilities.launcher if capabilities is not None else None
    if "p2p" in settings.operations and settings.ranks < 2:
        raise ConfigError("-n = 1 with p2p: p2p needs 2 ranks; allowed: -n 2 or more")
    return launchers


def run(settings: BenchSettings, json_path: str | None) -> int:
    launchers = communicator_launchers(settings)
    rows: list[dict] = []
    progress = sys.stderr.isatty()  # a live progress line on a terminal only
    plan = [(op, size) for op in settings.operations for size in sizes(settings)]
    runs = [(name, name, True) for name in settings.communicators]
    runs += [(f"{name}/py", name, False) for name in settings.python_fallback]
    for label, name, native in runs:
        # The pure-Python paths: SHARDLINE_NATIVE=0 in the ranks' environment.
        environ = None if native else {**os.environ, NATIVE_SWITCH: "0"}
        with LocalWorld(
            settings.ranks,
            CommunicatorSetup(name, settings.timeout_s),
            call_timeout_s=settings.timeout_s + 60,
            launcher=launchers[name],
            environ=environ,
        ) as world:
            for done, (operation, nbytes) in enumerate(plan, 1):
                if progress:
                    line = f"{label}: {operation} {human_size(nbytes)} ({done}/{len(plan)})"
                    print(f"\r{line:<60}", end="", file=sys.stderr, flush=True)
                per_rank = [
                    samples
                    for samples in world.run(
                        measure,
                        operation,
                        nbytes,
                        settings.dtype,
                        settings.warmup,
                        settings.iterations,
                        settings.back_to_back,
                    )
                    if samples is not None
                ]
                times = collective_times(per_rank, operation)
                median = statistics.median(times)
                algbw = nbytes / median / 1e9
                rows.append(
                    {
                        "communicator": label,
                        "operation": operation,
                        "bytes": nbytes,
                        "median_us": median * 1e6,
                        "min_us": min(times) * 1e6,
                        "max_us": max(times) * 1e6,
                        "algbw_GBps": algbw,
                        "busbw_GBps": algbw * bus_factor(operation, settings.ranks),
                    }
                )
    if progress:
        print(f"\r{'':<60}\r", end="", file=sys.stderr, flush=True)
    print(_table(rows, settings))
    if json_path:
        with open(json_path, "w") as handle:
            json.dump({"settings": settings.__dict__, "results": rows}, handle, indent=1)
    return 0


def _table(rows: list[dict], settings: BenchSettings) -> str:
    names = settings.columns
    by_key = {(r["communicator"], r["operation"], r["bytes"]): r for r in rows}
    header = ["OPERATION", "SIZE"]
    for name in names:
        header += [f"{name} µs", f"{name} busbw GB/s"]
    header += [f"{name}/{names[0]}" for name in names[1:]]
    lines = []
    for operation in settings.operations:
        for nbytes in sizes(settings):
            cells = [operation, human_size(nbytes)]
            first = by_key[(names[0], operation, nbytes)]["median_us"]
            for name in names:
                row = by_key[(name, operation, nbytes)]
                cells += [f"{row['median_us']:.1f}", f"{row['busbw_GBps']:.3f}"]
            cells += [
                f"{by_key[(name, operation, nbytes)]['median_us'] / first:.2f}"
                for name in names[1:]
            ]
            lines.append(tuple(cells))
    start = "end of the previous iteration" if settings.back_to_back else "start"
    title = (
        f"{settings.ranks} ranks, {settings.dtype}, {settings.warmup} warm-up + "
        f"{settings.iterations} timed iterations"
        f"{', back to back' if settings.back_to_back else ', a barrier before each'}; median "
        f"time from the last rank's {start} to the last rank's end"
    )
    return title + "\n" + render(tuple(header), lines)


def human_size(nbytes: int) -> str:
    """``4B``, ``64K``, ``16M``: the largest power-of-1024 unit that divides ``nbytes``."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"
