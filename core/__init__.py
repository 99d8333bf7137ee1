"""Shardline: transformer inference across ranks, with every moving part chosen from config.

The import package is light on purpose: importing ``shardline`` does not import torch or any
plugin. ``from shardline import LLM, SamplingParams`` works as in vLLM; those two names load
``shardline.engine`` (and torch) on first use. The other public pieces live in sub-packages
(``shardline.interfaces`` for the contracts, ``shardline.distributed`` for groups and layout,
``shardline.registry`` for plugins, ``shardline.config`` for configuration,
``shardline.conformance`` for the suite).
"""

import importlib

__version__ = "0.2.0"

_ENGINE_NAMES = ("LLM", "SamplingParams")

__all__ = ["__version__", *_ENGINE_NAMES]


def __getattr__(name: str):
    """Import ``shardline.engine`` the first time ``LLM`` or ``SamplingParams`` is asked for."""
    if name in _ENGINE_NAMES:
        return getattr(importlib.import_module("shardline.engine"), name)
    raise AttributeError(f"module 'shardline' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_ENGINE_NAMES})
