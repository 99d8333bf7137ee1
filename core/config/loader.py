"""Layered configuration: defaults < a command's built-in layer < file < ``SHARDLINE_*``
environment < ``--set``.

Every value remembers where it came from, so errors and ``shardline config show`` can name
the file, variable or flag.

Environment variables: ``SHARDLINE_<SECTION>__<KEY>=value`` (double underscore between
section and key, e.g. ``SHARDLINE_PARALLEL__TENSOR_PARALLEL_SIZE=2``), plus the shorthands
``SHARDLINE_PLUGINS`` (comma-separated allow-list) and ``SHARDLINE_STRICT_PLUGINS``.
Values in the environment and in ``--set`` are read as YAML scalars (``2``, ``true``,
``[a, b]``).
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from shardline.config.schema import EngineConfig
from shardline.errors import ConfigError

CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json")
ENV_PREFIX = "SHARDLINE_"
DEFAULT_SOURCE = "default"


@dataclass(frozen=True)
class LoadedConfig:
    """A validated config and, for every key that was set, where it came from."""

    config: EngineConfig
    sources: Mapping[str, str]
    path: Path | None = None

    def source_of(self, key: str) -> str:
        """The source of dotted ``key`` (``"default"`` when nothing set it)."""
        return self.sources.get(key, DEFAULT_SOURCE)


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    base: tuple[str, Mapping[str, Any]] | None = None,
) -> LoadedConfig:
    """Read, merge and validate. ``base`` (source name, mapping) is a layer between the
    defaults and the file, e.g. a command's built-in config. Raises one
    :class:`ConfigError` listing every problem, each naming its source, field, value and
    what is allowed."""
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if base is not None:
        _merge(merged, sources, base[1], base[0])
    file_path = Path(path) if path is not None else None
    if file_path is not None:
        _merge(merged, sources, read_config_file(file_path), str(file_path))
    for key, value, source in _environment_values(environ):
        _merge(merged, sources, _nest(key, value), source)
    for item in overrides:
        key, value = _parse_assignment(item)
        _merge(merged, sources, _nest(key, value), f"--set {item}")
    try:
        config = EngineConfig.model_validate(merged)
    except ValidationError as error:
        raise ConfigError(_describe(error, sources, merged)) from None
    return LoadedConfig(config, sources, file_path)


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping in a ``.yaml``/``.yml``/``.toml``/``.json`` file."""
    if path.suffix not in CONFIG_SUFFIXES:
        raise ConfigError(
            f"{path}: unsupported config file type {path.suffix or '(none)'!r}; "
            f"allowed: {', '.join(CONFIG_SUFFIXES)}",
            source=str(path),
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(
            f"{path}: cannot read config file: {error.strerror}", source=str(path)
        ) from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(
            f"{path}: not valid {path.suffix[1:]}: {error}", source=str(path)
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of sections "
            f"({', '.join(EngineConfig.model_fields)}), got {type(data).__name__}",
            source=str(path),
        )
    return data


def _environment_values(environ: Mapping[str, str]):
    for name in sorted(environ):
        raw = environ[name]
        if name == "SHARDLINE_PLUGINS":
            names = [part.strip() for part in raw.split(",") if part.strip()]
            yield "plugins.allow", names, f"env {name}"
        elif name == "SHARDLINE_STRICT_PLUGINS":
            yield "plugins.strict", _scalar(raw), f"env {name}"
        elif name.startswith(ENV_PREFIX) and "__" in name:
            key = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            yield key, _scalar(raw), f"env {name}"


def _parse_assignment(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            f"--set {item!r}: expected section.key=value, e.g. parallel.tensor_parallel_size=2",
            source="--set",
        )
    return key, _scalar(raw)


def _scalar(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        return raw


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    result: Any = value
    for part in reversed(dotted.split(".")):
        result = {part: result}
    return result


def _merge(
    target: dict, sources: dict[str, str], update: Mapping, source: str, prefix: str = ""
) -> None:
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(target.get(key, {}), dict):
            child = target.setdefault(key, {})
            if not isinstance(child, dict):
                target[key] = child = {}
            _merge(child, sources, value, source, f"{dotted}.")
            if not value:
                sources[dotted] = source
        else:
            target[key] = value
            sources[dotted] = source


def _describe(error: ValidationError, sources: Mapping[str, str], data: Mapping) -> str:
    lines = []
    for item in error.errors():
        loc = [str(part) for part in item["loc"]]
        key = ".".join(loc)
        source = sources.get(key) or _nearest_source(sources, key)
        value = _lookup(data, loc)
        if item["type"] == "extra_forbidden":
            allowed = _allowed_keys(loc[:-1])
            close = difflib.get_close_matches(loc[-1], allowed, n=1)
            hint = f" Did you mean {'.'.join([*loc[:-1], close[0]])!r}?" if close else ""
            where = f"[{'.'.join(loc[:-1])}]" if loc[:-1] else "the top level"
            message = f"unknown key.{hint} Allowed in {where}: {', '.join(allowed)}"
        else:
            message = item["msg"]
        lines.append(f"{source}: {key} = {value!r}: {message}")
    header = "invalid configuration:" if len(lines) > 1 else "invalid configuration"
    return header + ("\n  " + "\n  ".join(lines) if len(lines) > 1 else ": " + lines[0])


def _allowed_keys(loc: Sequence[str]) -> list[str]:
    model: type[BaseModel] = EngineConfig
    for part in loc:
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _lookup(data: Any, loc: Sequence[str]) -> Any:
    for part in loc:
        if isinstance(data, Mapping) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return None
    return data


def _nearest_source(sources: Mapping[str, str], key: str) -> str:
    while "." in key:
        key = key.rsplit(".", 1)[0]
        if key in sources:
            return sources[key]
    return DEFAULT_SOURCE
