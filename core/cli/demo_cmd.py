"""``shardline demo``: a real world of ranks on this host running the parallel collectives a
model step uses (TP all-reduce, a pipeline hop with TP-assisted transfer), checked and timed."""

from __future__ import annotations

import os
import statistics
import time

import torch

from shardline.cli.flags import MAX_REPEATS, check_count, check_host_memory
from shardline.cli.table import render
from shardline.config.loader import LoadedConfig
from shardline.config.schema import MAX_COUNT
from shardline.config.selection import check_config
from shardline.launch.comm_world import ParallelRankContext, ParallelSetup
from shardline.launch.local_world import LocalWorld
from shardline.registry import Registry

#: Bytes a rank holds per element of ``--hidden``, at most: the all-reduce's input and
#: output, the pipeline hop's [4, hidden] state sent and received, and room for copies.
_BYTES_PER_HIDDEN = 16 * 4


def run(loaded: LoadedConfig, rounds: int, hidden: int) -> int:
    check_count("--rounds", rounds, 1, MAX_REPEATS)
    check_count("--hidden", hidden, 1, MAX_COUNT)
    registry = Registry.for_plugins(loaded.config.plugins)
    config = check_config(loaded, registry, os.environ).config
    layout = config.parallel.layout
    check_host_memory(
        f"--hidden {hidden} on {layout.world_size} ranks",
        layout.world_size * hidden * _BYTES_PER_HIDDEN,
        "a smaller --hidden",
    )
    print(
        f"starting {layout.world_size} ranks (tp={layout.tensor_parallel_size}, "
        f"pp={layout.pipeline_parallel_size}, dp={layout.data_parallel_size}) with "
        f"{config.parallel.communicator} (data) and "
        f"{config.parallel.control_communicator} (control)"
    )
    started = time.monotonic()
    with LocalWorld(
        layout.world_size,
        ParallelSetup(config),
        start_timeout_s=config.parallel.startup_timeout_s,
        call_timeout_s=config.parallel.timeout_s,
    ) as world:
        print(f"world ready in {time.monotonic() - started:.1f} s")
        results = world.run(demo_step, rounds, hidden)
    rows = [
        (
            r["rank"],
            r["tp_group"],
            r["pp_group"],
            f"{r['all_reduce_us']:.0f}",
            r["pipeline"],
            "ok" if r["correct"] else "WRONG",
        )
        for r in results
    ]
    print(
        render(
            (
                "RANK",
                "TP GROUP",
                "PP GROUP",
                f"ALL_REDUCE [{hidden}] MEDIAN µs",
                "PIPELINE HOP",
                "CHECK",
            ),
            rows,
        )
    )
    return 0 if all(r["correct"] for r in results) else 1


def demo_step(ctx: ParallelRankContext, rounds: int, hidden: int) -> dict:
    """One rank's part: ``rounds`` timed TP all-reduces of ``[hidden]`` floats, then one
    pipeline hop of a ``[4, hidden]`` hidden state, sliced across the TP group."""
    state = ctx.state
    tp, pp = state.tp, state.pp
    value = torch.full((hidden,), float(state.rank + 1))
    expected = float(sum(r + 1 for r in tp.ranks))
    correct = True
    timings = []
    for _ in range(rounds):
        start = time.perf_counter()
        result = tp.all_reduce(value)
        timings.append(time.perf_counter() - start)
        correct = correct and bool(torch.all(result == expected))
    pipeline = "-"
    stage_input = torch.arange(4 * hidden, dtype=torch.float32).reshape(4, hidden)
    if not pp.is_last_rank:
        pp.isend_tensor_dict(
            {"hidden_states": stage_input + pp.rank_in_group}, all_gather_group=tp
        ).wait()
        pipeline = f"sent to rank {pp.ranks[pp.next_rank]}"
    if not pp.is_first_rank:
        received = pp.irecv_tensor_dict(all_gather_group=tp).wait()
        correct = correct and torch.equal(received["hidden_states"], stage_input + pp.prev_rank)
        pipeline = f"got from rank {pp.ranks[pp.prev_rank]}" + (
            "" if pipeline == "-" else f", {pipeline}"
        )
    state.world.barrier()
    return {
        "rank": state.rank,
        "tp_group": tp.ranks,
        "pp_group": pp.ranks,
        "all_reduce_us": statistics.median(timings) * 1e6 if timings else 0.0,
        "pipeline": pipeline,
        "correct": correct,
    }
