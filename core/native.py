"""The native (C) paths of Shardline's plugins: each plugin builds its own optional extension,
and one switch, ``SHARDLINE_NATIVE=0`` in the environment, makes every one of them run its
pure-Python fallback instead."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType

SWITCH = "SHARDLINE_NATIVE"
#: Values of the switch that turn the native paths off, and those that leave them on.
OFF = frozenset({"0", "false", "no", "off"})
ON = frozenset({"", "1", "true", "yes", "on"})


def native_extension(module: str, environ: Mapping[str, str]) -> ModuleType | None:
    """The extension ``module`` (a dotted name), or None where it was not built (the
    install had no compiler) or ``SHARDLINE_NATIVE`` in ``environ`` is one of :data:`OFF`
    (``0``) and asks for the pure-Python path."""
    if environ.get(SWITCH, "1").strip().lower() in OFF:
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def switch_problem(environ: Mapping[str, str]) -> str | None:
    """A warning when ``SHARDLINE_NATIVE`` holds a value that is neither on nor off (the
    native paths then run), else None."""
    value = environ.get(SWITCH)
    if value is None or value.strip().lower() in OFF | ON:
        return None
    return (
        f"{SWITCH} = {value!r} is not understood; allowed: 0, false, no or off (the "
        "pure-Python paths), 1, true, yes or on (the C paths, where built): the C paths run"
    )
