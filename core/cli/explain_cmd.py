"""``shardline explain``: which backend each field selects, and why the others were not."""

from __future__ import annotations

import os

from shardline.config.loader import LoadedConfig
from shardline.config.selection import decide, is_error
from shardline.registry import Registry


def run(loaded: LoadedConfig) -> int:
    config = loaded.config
    registry = Registry.for_plugins(config.plugins)
    layout = config.parallel.layout
    print(
        f"layout: tp={layout.tensor_parallel_size} pp={layout.pipeline_parallel_size} "
        f"dp={layout.data_parallel_size} external_dp={layout.external_data_parallel_size} "
        f"-> world size {layout.world_size}, output rank {layout.output_rank}"
    )
    print(f"  tp groups: {layout.tp_groups()}")
    print(f"  pp groups: {layout.pp_groups()}")
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
    return 2 if failed else 0
