"""Layered configuration: defaults < a command's built-in layer < file < ``SHARDLINE_*``
environment < ``--set``.

Every value remembers where it came from, so errors and ``shardline config show`` can name
the file, variable or flag.

Environment variables: ``SHARDLINE_<SECTION>__<KEY>=value`` (double underscore between
section and key, e.g. ``SHARDLINE_PARALLEL__TENSOR_PARALLEL_SIZE=2``), plus the shorthands
``SHARDLINE_PLUGINS`` (comma-separated allow-list) and ``SHARDLINE_STRICT_PLUGINS``.
Values in the environment and in ``--set`` are read as YAML scalars (``2``, ``true``,
``[a, b]``). Any other ``SHARDLINE_*`` variable that is not one Shardline reads (see
:data:`OTHER_VARIABLES`) makes a warning, so a mistyped key is never ignored in silence.

Config files are untrusted input: at most :data:`MAX_FILE_BYTES`, UTF-8, no duplicate keys,
and YAML aliases may not expand past :data:`MAX_YAML_NODES` nodes. Values echoed in errors
are cut (:func:`shardline.errors.echo`).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from shardline.config.schema import EngineConfig
from shardline.errors import ECHO_CHARS, ConfigError, cut, echo
from shardline.native import SWITCH, switch_problem

CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json")
ENV_PREFIX = "SHARDLINE_"
DEFAULT_SOURCE = "default"
#: ``SHARDLINE_*`` variables that are not config keys (read by other parts of Shardline).
OTHER_VARIABLES = frozenset(
    {
        "SHARDLINE_API_KEY",
        "SHARDLINE_DEBUG",
        "SHARDLINE_JOB_SECRET",
        "SHARDLINE_MODELS",
        "SHARDLINE_TEST_MODELS",
        "SHARDLINE_LOCAL_WORLD_AUTHKEY",
        "SHARDLINE_FAULT_PLAN",
        "SHARDLINE_RUN_MARKER",
        SWITCH,
    }
)
#: The largest config file read; real ones are a few hundred bytes.
MAX_FILE_BYTES = 1 << 20
#: The most nodes a YAML document may have once its aliases are expanded.
MAX_YAML_NODES = 10_000
#: Problems listed in one error at most (the rest are counted).
MAX_PROBLEMS = 20


@dataclass(frozen=True)
class LoadedConfig:
    """A validated config and, for every key that was set, where it came from."""

    config: EngineConfig
    sources: Mapping[str, str]
    path: Path | None = None
    #: Things that did not stop loading but look like mistakes (e.g. a mistyped variable).
    warnings: tuple[str, ...] = field(default=())

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
        _merge(merged, sources, _nest(key, value), f"--set {cut(item, ECHO_CHARS)}")
    try:
        config = EngineConfig.model_validate(merged)
    except ValidationError as error:
        raise ConfigError(_describe(error, sources, merged)) from None
    warnings = [*_unknown_variables(environ), switch_problem(environ)]
    return LoadedConfig(config, sources, file_path, tuple(w for w in warnings if w))


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping in a ``.yaml``/``.yml``/``.toml``/``.json`` file (see the module docstring
    for what a file may hold)."""
    if path.suffix not in CONFIG_SUFFIXES:
        raise ConfigError(
            f"{path}: unsupported config file type {echo(path.suffix or '(none)')}; "
            f"allowed: {', '.join(CONFIG_SUFFIXES)}",
            source=str(path),
        )
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        raise ConfigError(
            f"{path}: cannot read config file: {error.strerror}", source=str(path)
        ) from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(
            f"{path}: config file larger than {MAX_FILE_BYTES} bytes; allowed: at most "
            f"{MAX_FILE_BYTES} bytes",
            source=str(path),
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{raw[error.start]:02x} at offset {error.start}); "
            "allowed: a UTF-8 text file",
            source=str(path),
        ) from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text, object_pairs_hook=_refuse_duplicate_json_keys)
        else:
            data = _load_yaml(text)
    except (yaml.YAMLError, json.JSONDecodeError, tomllib.TOMLDecodeError, ValueError) as error:
        raise ConfigError(
            f"{path}: not valid {path.suffix[1:]}: {cut(_parse_problem(error), 400)}",
            source=str(path),
        ) from None
    except RecursionError:
        raise ConfigError(
            f"{path}: not valid {path.suffix[1:]}: nested too deeply", source=str(path)
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


class _ConfigYamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys in a mapping and reads floats as YAML
    1.2 (and JSON, TOML, Python) write them: ``1e3`` and ``1.5e-3`` are numbers, where YAML
    1.1 wants a dot and a signed exponent (``1.0e+3``) and reads the rest as text."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.value == "<<":
                continue
            line = key_node.start_mark.line + 1
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {echo(key_node.value)} (lines {seen[key_node.value]} and "
                    f"{line}); allowed: each key once",
                    key_node.start_mark,
                )
            seen[key_node.value] = line
        return super().construct_mapping(node, deep)


_ConfigYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


class _TooLarge(yaml.YAMLError):
    """A YAML document whose aliases expand past the bound."""


def _load_yaml(text: str) -> Any:
    """One YAML document, refused when its aliases expand past :data:`MAX_YAML_NODES`
    nodes (the "billion laughs" shape) before anything is built from it."""
    loader = _ConfigYamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {})
        if size > MAX_YAML_NODES:
            raise _TooLarge(
                f"its aliases expand to more than {MAX_YAML_NODES} nodes; allowed: at most "
                f"{MAX_YAML_NODES} (a config needs a few dozen)"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Nodes in ``node`` with every alias expanded, counted without expanding (a node
    reached again through an alias is counted from ``sizes``). A node that contains itself
    counts as too large."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    sizes[key] = MAX_YAML_NODES + 1  # a cycle back here is refused
    if isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    total = 1
    for child in children:
        total += _expanded_size(child, sizes)
        if total > MAX_YAML_NODES:
            break
    sizes[key] = total
    return total


def _parse_problem(error: Exception) -> str:
    """A parser's complaint in one line, with the line and column where it has them."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem:
        mark = error.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        return f"{error.problem}{where}"
    return str(error)


def _refuse_duplicate_json_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {echo(key)}; allowed: each key once")
        result[key] = value
    return result


def _unknown_variables(environ: Mapping[str, str]):
    """A warning for each ``SHARDLINE_*`` variable that is neither a config key
    (``SHARDLINE_<SECTION>__<KEY>``) nor one Shardline reads elsewhere."""
    known = {"SHARDLINE_PLUGINS", "SHARDLINE_STRICT_PLUGINS", *OTHER_VARIABLES}
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or "__" in name or name in known:
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        guess = next(
            (
                f"{ENV_PREFIX}{section.upper()}__{rest[len(section) + 1 :].upper()}"
                for section in EngineConfig.model_fields
                if rest.startswith(f"{section}_")
            ),
            None,
        )
        hint = f"; did you mean {guess}?" if guess else ""
        yield (
            f"environment variable {name} is ignored: config variables are "
            f"SHARDLINE_<SECTION>__<KEY>, with two underscores between section and key{hint}"
        )


def _environment_values(environ: Mapping[str, str]):
    for name in sorted(environ):
        raw = environ[name]
        if name == "SHARDLINE_PLUGINS":
            names = [part.strip() for part in raw.split(",") if part.strip()]
            yield "plugins.allow", names, f"env {name}"
        elif name == "SHARDLINE_STRICT_PLUGINS":
            flag = raw.strip().lower()
            value = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
            yield "plugins.strict", value.get(flag, raw), f"env {name}"
        elif name.startswith(ENV_PREFIX) and "__" in name:
            key = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            yield key, _scalar(raw, f"env {name}"), f"env {name}"


def _parse_assignment(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            f"--set {echo(item)}: expected section.key=value, e.g. parallel.tensor_parallel_size=2",
            source="--set",
        )
    return key, _scalar(raw, f"--set {cut(key, ECHO_CHARS)}")


def _scalar(raw: str, source: str) -> Any:
    """A value from ``--set`` or the environment, read as YAML (with the file's alias bound);
    text that is not YAML stays text."""
    try:
        return _load_yaml(raw) if raw.strip() else raw
    except _TooLarge as error:
        raise ConfigError(f"{source}: {error}", source=source) from None
    except (yaml.YAMLError, RecursionError):
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
    items = _merge_union_members(error.errors(), data)
    for item in items[:MAX_PROBLEMS]:
        loc = [str(part) for part in item["loc"]]
        key = ".".join(loc)
        source = _source_of(sources, key)
        value = _lookup(data, loc)
        if item["type"] == "extra_forbidden":
            allowed = _allowed_keys(loc[:-1])
            meant = _meant_keys(loc)
            hint = f" Did you mean {' or '.join(map(repr, meant))}?" if meant else ""
            where = f"[{'.'.join(loc[:-1])}]" if loc[:-1] else "the top level"
            message = f"unknown key.{hint} Allowed in {where}: {', '.join(allowed)}"
        else:
            message = item["msg"]
        lines.append(f"{source}: {cut(key, ECHO_CHARS)} = {echo(value)}: {message}")
    if len(items) > MAX_PROBLEMS:
        lines.append(f"... and {len(items) - MAX_PROBLEMS} more problems")
    header = "invalid configuration:" if len(lines) > 1 else "invalid configuration"
    return header + ("\n  " + "\n  ".join(lines) if len(lines) > 1 else ": " + lines[0])


def _merge_union_members(items: list[dict], data: Mapping) -> list[dict]:
    """One problem per field: pydantic reports a value that fits no member of a union
    (``int | 'auto'``) once per member, at the field's location plus the member's name; those
    become one problem at the field, its messages joined ("Input should be a valid integer or
    'auto'")."""
    merged: list[dict] = []
    by_field: dict[tuple, dict] = {}
    for item in items:
        loc = tuple(str(part) for part in item["loc"])
        field_loc = loc[: _depth_in(data, loc)] if item["type"] != "extra_forbidden" else loc
        if field_loc == loc or not field_loc:
            merged.append(item)
            continue
        message = item["msg"].replace("None", "null")  # a config file writes null
        if field_loc in by_field:
            known = by_field[field_loc]
            prefix = "Input should be "
            if message.startswith(prefix) and known["msg"].startswith(prefix):
                message = message[len(prefix) :]
            known["msg"] = f"{known['msg']} or {message}"
            continue
        by_field[field_loc] = {**item, "loc": field_loc, "msg": message}
        merged.append(by_field[field_loc])
    return merged


def _meant_keys(loc: Sequence[str]) -> list[str]:
    """The dotted keys an unknown key at ``loc`` most likely meant: the same name in another
    section (``timeout_s`` at the top level: ``parallel.timeout_s``), else a close name at the
    same level, else a close name anywhere."""
    name, parent = loc[-1], list(loc[:-1])
    every_key = list(_schema_keys(EngineConfig, ()))
    same_name = [key for key in every_key if key[-1] == name]
    if same_name:
        return [".".join(key) for key in same_name]
    close = difflib.get_close_matches(name, _allowed_keys(parent), n=1)
    if close:
        return [".".join([*parent, close[0]])]
    close = difflib.get_close_matches(name, [key[-1] for key in every_key], n=1)
    return [".".join(key) for key in every_key if close and key[-1] == close[0]]


def _schema_keys(model: type[BaseModel], prefix: tuple[str, ...]):
    """Every key of ``model`` and of the sections inside it, as a tuple of names."""
    for name, info in model.model_fields.items():
        key = (*prefix, name)
        yield key
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            yield from _schema_keys(info.annotation, key)


def _allowed_keys(loc: Sequence[str]) -> list[str]:
    model: type[BaseModel] = EngineConfig
    for part in loc:
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _lookup(data: Any, loc: Sequence[str]) -> Any:
    """The value at ``loc`` in ``data``, None where ``loc`` leads nowhere."""
    depth, value = _walk(data, loc)
    return value if depth == len(loc) else None


def _depth_in(data: Any, loc: Sequence[str]) -> int:
    """How many parts of ``loc`` lead through ``data`` (mapping keys, list indices)."""
    return _walk(data, loc)[0]


def _walk(data: Any, loc: Sequence[str]) -> tuple[int, Any]:
    """Follow ``loc`` into ``data`` as far as it leads: (parts followed, the value there)."""
    for depth, part in enumerate(loc):
        if isinstance(data, Mapping) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return depth, data
    return len(loc), data


def _source_of(sources: Mapping[str, str], key: str) -> str:
    """Where ``key``'s value came from: its own source, else the source that set something
    inside it (``--set a.b.c=1`` for an error at ``a.b``), else the nearest enclosing one."""
    if key in sources:
        return sources[key]
    inside = sorted({source for name, source in sources.items() if name.startswith(f"{key}.")})
    if inside:
        return ", ".join(inside)
    while "." in key:
        key = key.rsplit(".", 1)[0]
        if key in sources:
            return sources[key]
    return DEFAULT_SOURCE
