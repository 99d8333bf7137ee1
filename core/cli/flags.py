"""Checks of command-line numbers, each refusing with one message that names the flag, the
value and what is allowed (exit code 2), before the command starts anything."""

from __future__ import annotations

import math
import os
from pathlib import Path

from shardline.config.capacity import DEFAULT_MEMORY_FRACTION, HostMemory, size_text
from shardline.config.schema import MAX_TIMEOUT_S
from shardline.errors import ConfigError

#: The most repetitions (iterations, rounds) a command-line flag may ask for.
MAX_REPEATS = 1_000_000


def check_seconds(flag: str, value: float) -> None:
    """A deadline: more than 0, at most :data:`MAX_TIMEOUT_S` (nan and inf refused)."""
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise ConfigError(
            f"{flag} = {value:g}: allowed: more than 0, up to {MAX_TIMEOUT_S:g} s", field=flag
        )


def check_count(flag: str, value: int, low: int, high: int, why: str = "") -> None:
    """``low <= value <= high``; ``why`` explains the bound in the message."""
    if not low <= value <= high:
        reason = f" ({why})" if why else ""
        raise ConfigError(f"{flag} = {value}: allowed: {low}..{high}{reason}", field=flag)


def check_host_memory(what: str, need: int, allowed: str) -> None:
    """``need`` bytes (for ``what``) fit the share of this host's available memory a job may
    take; else ConfigError with the figures and ``allowed`` (what to change)."""
    host = HostMemory.read()
    if need > host.available * DEFAULT_MEMORY_FRACTION:
        raise ConfigError(
            f"{what}: needs {size_text(need)}; this host has {size_text(host.available)} "
            f"available ({host.source}), {DEFAULT_MEMORY_FRACTION:g} of it usable; allowed: "
            f"{allowed}"
        )


def check_output_file(flag: str, path: str) -> None:
    """``path`` (where a command writes its results when it ends) can be written: its folder
    exists and is writable, and it is no folder itself. Checked before anything runs, so a
    long benchmark does not end in an error with its results lost."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        problem = "a folder"
    elif not folder.is_dir():
        problem = f"its folder {str(folder)!r} does not exist"
    elif not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        problem = "not writable here"
    else:
        return
    raise ConfigError(
        f"{flag} = {path!r}: {problem}; allowed: a file in an existing, writable folder",
        field=flag,
    )
