"""The native (C) paths of Shardline's plugins: each plugin builds its own optional extension,
and one switch, ``SHARDLINE_NATIVE=0`` in the environment, makes every one of them run its
pure-Python fallback instead."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType


def native_extension(module: str, environ: Mapping[str, str]) -> ModuleType | None:
    """The extension ``module`` (a dotted name), or None where it was not built (the
    install had no compiler) or ``SHARDLINE_NATIVE=0`` in ``environ`` asks for the
    pure-Python path."""
    if environ.get("SHARDLINE_NATIVE", "1") == "0":
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
