"""``shardline config show | validate | schema``."""

from __future__ import annotations

import json
import os

from shardline.cli.table import render
from shardline.config.loader import LoadedConfig
from shardline.config.schema import EngineConfig
from shardline.config.selection import check_config
from shardline.registry import Registry


def show(loaded: LoadedConfig) -> int:
    rows = [
        (key, json.dumps(value), loaded.source_of(key))
        for key, value in _flatten(loaded.config.model_dump())
    ]
    print(render(("KEY", "VALUE", "SOURCE"), rows))
    return 0


def validate(loaded: LoadedConfig) -> int:
    config = loaded.config
    registry = Registry.for_plugins(config.plugins)
    check_config(loaded, registry, os.environ)
    where = str(loaded.path) if loaded.path else "the configuration (defaults, environment, --set)"
    print(f"{where}: valid (world size {config.parallel.world_size})")
    return 0


def schema() -> int:
    print(json.dumps(EngineConfig.model_json_schema(), indent=2))
    return 0


def _flatten(data: dict, prefix: str = ""):
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
