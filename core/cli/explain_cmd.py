"""``shardline explain``: which backend each field selects and why the others were not, and
the memory plan of the ranks on this host."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shardline.cli.config_cmd import with_local_model
from shardline.cli.table import render
from shardline.config.capacity import PROCESS_BYTES, CapacityPlan, size_text
from shardline.config.loader import LoadedConfig
from shardline.config.schema import EngineConfig
from shardline.config.selection import capacity_plan, decide, is_error, resolved
from shardline.distributed.layout import ParallelLayout
from shardline.errors import ConfigError
from shardline.interfaces.communicator_backend import CommunicatorBackend
from shardline.interfaces.executor import Executor
from shardline.launch.launcher_env import LaunchedRank
from shardline.registry import Registry


def run(loaded: LoadedConfig) -> int:
    loaded, note = with_local_model(loaded)
    config = loaded.config
    registry = Registry.for_plugins(config.plugins)
    layout = config.parallel.layout
    print(
        f"layout: tp={layout.tensor_parallel_size} pp={layout.pipeline_parallel_size} "
        f"dp={layout.data_parallel_size} external_dp={layout.external_data_parallel_size} "
        f"-> world size {layout.world_size}, output rank {layout.output_rank}"
    )
    print(f"  tp groups: {_groups(layout.tp_groups())}")
    print(f"  pp groups: {_groups(layout.pp_groups())}")
    decisions = decide(config, registry, os.environ)
    failed = any(is_error(d, config) for d in decisions)
    for decision in decisions:
        source = loaded.source_of(decision.field)
        print(f"\n{decision.field}: {decision.chosen} ({decision.reason}; set by {source})")
        if decision.problem:
            print(f"  problem: {decision.problem}")
        for name, verdict in decision.alternatives:
            print(f"  {name:<20} {verdict}")
        if not decision.alternatives:
            print("  (no installed plugin provides this kind yet)")
    for failure in registry.failures:
        print(f"\nplugin {failure.name!r} failed to load and was not considered: {failure.error}")
    executor = next(d for d in decisions if d.field == "parallel.distributed_executor_backend")
    executor_class = None
    if executor.problem is None:
        executor_class = registry.get("executor", executor.chosen).load()
        print(f"\nrendezvous store: {executor_class.rendezvous_note(config, os.environ)}")
    communicator = next(d for d in decisions if d.field == "parallel.communicator")
    if communicator.problem is None:
        backend = registry.get("communicator", communicator.chosen).load()
        print()
        print(describe_hosts(layout, hosts_of_ranks(config, executor_class, os.environ), backend))
    if not failed:
        try:
            plan = capacity_plan(
                loaded, resolved(config, decisions), decisions, registry, os.environ
            )
        except ConfigError as error:
            print(f"\nmemory plan: problem: {error}")
            failed = True
        else:
            print()
            print(describe_plan(plan))
    if note:
        print(f"\n{note}")
    return 2 if failed else 0


@dataclass(frozen=True)
class RankHosts:
    """The host (0, 1, ...) each rank runs on, and how that was decided."""

    host_of: tuple[int, ...]
    why: str


def hosts_of_ranks(
    config: EngineConfig, executor: type[Executor] | None, environ: Mapping[str, str]
) -> RankHosts:
    """Ranks are numbered host by host, the same count on each: under a launcher, its
    ranks per host (``LOCAL_WORLD_SIZE``); otherwise ``parallel.nnodes`` hosts."""
    world = config.parallel.world_size
    if executor is not None and executor.launched:
        launched = LaunchedRank.from_environ(environ)
        per_host = launched.local_world_size
        why = f"{launched.launcher}: {per_host} ranks on each host"
    else:
        per_host = max(1, world // config.parallel.nnodes)
        why = f"parallel.nnodes = {config.parallel.nnodes}, ranks numbered host by host"
    return RankHosts(tuple(rank // per_host for rank in range(world)), why)


def describe_hosts(
    layout: ParallelLayout, hosts: RankHosts, backend: type[CommunicatorBackend]
) -> str:
    """Which hosts each group spans, whether it crosses a host boundary, and what carries
    its all-reduces (the first 8 groups of each kind)."""
    count = len(set(hosts.host_of))
    lines = [f"hosts: {count} ({hosts.why}):"]
    rows = []
    for kind, groups in (("tp", layout.tp_groups()), ("pp", layout.pp_groups())):
        for group in groups[:8]:
            spanned = sorted({hosts.host_of[rank] for rank in group})
            rows.append(
                (
                    kind,
                    _span(tuple(group)),
                    ",".join(map(str, spanned)),
                    "yes" if len(spanned) > 1 else "no",
                    backend.all_reduce_route(len(spanned)),
                )
            )
        if len(groups) > 8:
            rows.append((kind, f"... ({len(groups)} groups)", "", "", ""))
    headers = ("GROUP", "RANKS", "HOSTS", "CROSSES", "ALL-REDUCE")
    lines += ["  " + line for line in render(headers, rows).splitlines()]
    return "\n".join(lines)


def describe_plan(plan: CapacityPlan) -> str:
    """The memory plan as a table: one row per (stage, TP rank) position on this host. A
    rank's peak (EACH) counts the larger of LOADING (freed before the first step) and
    ACTIVATIONS."""
    lines = [
        f"memory plan on this host ({plan.placement.why}; {size_text(plan.host.available)} "
        f"available, {plan.host.source}; cache.memory_fraction {plan.memory_fraction:g} "
        f"allows {size_text(plan.budget)}):"
    ]
    rows = [
        (
            _span(share.ranks),
            share.pp_rank,
            share.tp_rank,
            size_text(share.memory.weights),
            size_text(share.kv_cache),
            size_text(share.memory.loading),
            size_text(share.memory.activations),
            size_text(PROCESS_BYTES) if share.new_processes else "(this one)",
            size_text(share.peak + (PROCESS_BYTES if share.new_processes else 0)),
        )
        for share in plan.shares
    ]
    headers = (
        "RANKS",
        "STAGE",
        "TP",
        "WEIGHTS",
        "KV CACHE",
        "LOADING",
        "ACTIVATIONS",
        "PROCESS",
        "EACH",
    )
    lines += ["  " + line for line in render(headers, rows).splitlines()]
    cache = (
        f"; KV cache: {plan.num_blocks} blocks per rank, sequences up to "
        f"{plan.max_model_len} tokens"
        if plan.max_model_len is not None
        else "; no model planned (only the rank processes are counted)"
    )
    lines.append(f"  total {size_text(plan.total)}, headroom {size_text(plan.headroom)}{cache}")
    return "\n".join(lines)


def _span(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _groups(groups: list[list[int]]) -> str:
    """The groups, or the first 8 of them and how many there are."""
    if len(groups) <= 8:
        return str(groups)
    return f"{str(groups[:8])[:-1]}, ...] ({len(groups)} groups)"
