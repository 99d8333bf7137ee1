"""``shardline config show | validate | schema``."""

from __future__ import annotations

import dataclasses
import json
import os

from shardline.catalog import known_names, resolve_model_path
from shardline.cli.table import render
from shardline.config.capacity import size_text
from shardline.config.loader import LoadedConfig
from shardline.config.schema import EngineConfig
from shardline.config.selection import check_config
from shardline.errors import ConfigError
from shardline.registry import Registry


def show(loaded: LoadedConfig) -> int:
    rows = [
        (key, json.dumps(value), loaded.source_of(key))
        for key, value in _flatten(loaded.config.model_dump())
    ]
    print(render(("KEY", "VALUE", "SOURCE"), rows))
    return 0


def validate(loaded: LoadedConfig) -> int:
    """Every check ``shardline run`` makes before starting anything, the model's included
    when ``model.path`` is set (a cataloged model must have been pulled: nothing is fetched)."""
    loaded, note = with_local_model(loaded)
    config = loaded.config
    registry = Registry.for_plugins(config.plugins)
    checked = check_config(loaded, registry, os.environ)
    built_in = sorted({s for s in loaded.sources.values() if s.startswith("built-in")})
    layers = ", ".join(["defaults", *built_in, "environment", "--set"])
    where = str(loaded.path) if loaded.path else f"the configuration ({layers})"
    capacity = checked.capacity
    fit = (
        f"; the ranks on this host need {size_text(capacity.total)} of the "
        f"{size_text(capacity.budget)} allowed: `shardline explain` shows the plan"
        if capacity.max_model_len is not None
        else ""
    )
    print(f"{where}: valid (world size {config.parallel.world_size}{fit})")
    if note:
        print(note)
    return 0


def with_local_model(loaded: LoadedConfig) -> tuple[LoadedConfig, str | None]:
    """``loaded`` with a cataloged ``model.path`` replaced by its cached file, and a note
    when the model checks cannot run (a cataloged model not pulled yet: nothing is fetched)."""
    path = loaded.config.model.path
    if path is None:
        return loaded, None
    try:
        local = resolve_model_path(path, pull_missing=False)
    except ConfigError as error:
        if path not in known_names():
            raise
        return loaded, f"note: the model checks did not run: {error}"
    model = loaded.config.model.model_copy(update={"path": local})
    config = loaded.config.model_copy(update={"model": model})
    return dataclasses.replace(loaded, config=config), None


def schema() -> int:
    print(json.dumps(EngineConfig.model_json_schema(), indent=2))
    return 0


def _flatten(data: dict, prefix: str = ""):
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
