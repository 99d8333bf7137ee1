"""Plugins: the hook specifications, the component record, and the registry that loads them."""

from shardline.registry.component import Component
from shardline.registry.hookspecs import hookimpl, hookspec
from shardline.registry.registry import (
    ENTRY_POINT_GROUP,
    PluginFailure,
    Registry,
    installed_plugins,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Component",
    "PluginFailure",
    "Registry",
    "hookimpl",
    "hookspec",
    "installed_plugins",
]
