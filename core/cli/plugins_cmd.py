"""``shardline plugins``: what every installed plugin provides, and whether it can run here."""

from __future__ import annotations

from shardline.cli.table import render
from shardline.config.schema import EngineConfig
from shardline.registry import Registry


def run(config: EngineConfig) -> int:
    registry = Registry.for_plugins(config.plugins)
    rows = []
    for kind in ("communicator", "executor", "model_runner"):
        for component in registry.components(kind):
            reason = component.unavailable_reason()
            status = "available" if reason is None else f"unavailable: {reason}"
            rows.append((component.plugin, f"{kind} {component.name}", status, component.summary))
    for failure in registry.failures:
        rows.append((failure.name, "-", f"failed to load: {failure.error}", failure.target))
    for name in registry.skipped:
        rows.append((name, "-", "not loaded: not in SHARDLINE_PLUGINS / plugins.allow", ""))
    print(render(("PLUGIN", "PROVIDES", "STATUS", "SUMMARY"), sorted(rows)))
    return 1 if registry.failures else 0
