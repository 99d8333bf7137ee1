"""Finds plugins through entry points and indexes what they provide."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pluggy

from shardline.errors import ConfigError, PluginError, echo
from shardline.registry import hookspecs
from shardline.registry.component import Component, check_kind, import_target

if TYPE_CHECKING:
    from shardline.config.schema import PluginsConfig

ENTRY_POINT_GROUP = "shardline.plugins"


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded: its entry-point name, target and error."""

    name: str
    target: str
    error: str


@dataclass(frozen=True)
class PluginInfo:
    """A loaded plugin: entry-point name, module, and the distribution that ships it."""

    name: str
    module: str
    distribution: str


class Registry:
    """Every component the allowed, loadable plugins provide, by kind and name.

    Build it with :meth:`load`. A registry is a plain object: pass it to whoever needs it.
    """

    def __init__(
        self,
        components: Iterable[Component],
        plugins: Sequence[PluginInfo] = (),
        failures: Sequence[PluginFailure] = (),
        skipped: Sequence[str] = (),
        hooks: pluggy.PluginManager | None = None,
    ) -> None:
        self._by_kind: dict[str, dict[str, Component]] = {
            k: {} for k in hookspecs.HOOK_KINDS.values()
        }
        for component in components:
            existing = self._by_kind[component.kind].get(component.name)
            if existing is not None:
                raise PluginError(
                    f"{component.kind} {component.name!r} is provided by two plugins: "
                    f"{existing.plugin!r} ({existing.target}) and {component.plugin!r} "
                    f"({component.target}); uninstall one, or leave one out of SHARDLINE_PLUGINS"
                )
            self._by_kind[component.kind][component.name] = component
        self._by_kind["communicator"] = {
            name: self._with_base_capabilities(component)
            for name, component in self._by_kind["communicator"].items()
        }
        self.plugins = list(plugins)
        self.failures = list(failures)
        self.skipped = list(skipped)
        self._hooks = hooks

    def _with_base_capabilities(self, component: Component) -> Component:
        """A wrapping communicator (``capabilities_of``) with its base's capabilities (None
        when no loaded plugin provides the base)."""
        if not component.capabilities_of:
            return component
        base = self._by_kind["communicator"].get(component.capabilities_of)
        return dataclasses.replace(component, capabilities=base.capabilities if base else None)

    @classmethod
    def load(cls, allow: Sequence[str] | None = None, strict: bool = False) -> Registry:
        """Load the plugins of the ``shardline.plugins`` entry-point group.

        ``allow``: entry-point names to load (None: all). A plugin that raises on import, or
        whose hooks raise, is recorded in :attr:`failures` and the rest still load; with
        ``strict`` that is a :class:`PluginError` instead. Names in ``allow`` that no entry
        point has are also a :class:`PluginError`, listing the installed names.
        """
        manager = pluggy.PluginManager(hookspecs.PROJECT)
        manager.add_hookspecs(hookspecs)
        plugins: list[PluginInfo] = []
        failures: list[PluginFailure] = []
        skipped: list[str] = []
        entry_points = _unique_entry_points()
        if allow is not None:
            unknown = sorted(set(allow) - {ep.name for ep in entry_points})
            if unknown:
                raise PluginError(
                    f"SHARDLINE_PLUGINS names {', '.join(map(repr, unknown))}, which no installed "
                    f"plugin provides; installed: {', '.join(ep.name for ep in entry_points)}"
                )
        components: list[Component] = []
        for ep in entry_points:
            if allow is not None and ep.name not in allow:
                skipped.append(ep.name)
                continue
            try:
                module = ep.load()
                manager.register(module, name=ep.name)
                components += _collect(manager, ep.name)
            except Exception as error:
                if manager.has_plugin(ep.name):
                    manager.unregister(name=ep.name)
                failure = PluginFailure(ep.name, ep.value, f"{type(error).__name__}: {error}")
                if strict:
                    raise PluginError(
                        f"plugin {ep.name!r} ({ep.value}) failed to load: {failure.error}"
                    ) from error
                failures.append(failure)
                continue
            dist = ep.dist.name if ep.dist is not None else "?"
            plugins.append(PluginInfo(ep.name, ep.value, dist))
        return cls(components, plugins, failures, skipped, manager)

    @classmethod
    def for_plugins(cls, plugins: PluginsConfig) -> Registry:
        """:meth:`load` with the config's ``plugins.allow`` and ``plugins.strict``."""
        return cls.load(allow=plugins.allow, strict=plugins.strict)

    def rank_starting(self, rank: int, world_size: int) -> None:
        """Run every loaded plugin's ``shardline_rank_starting`` hook (in this process)."""
        if self._hooks is not None:
            self._hooks.hook.shardline_rank_starting(rank=rank, world_size=world_size)

    def names(self, kind: str) -> list[str]:
        """Component names of ``kind``, sorted."""
        return sorted(self._by_kind[kind])

    def components(self, kind: str) -> list[Component]:
        """Components of ``kind``, sorted by name."""
        return [self._by_kind[kind][name] for name in self.names(kind)]

    def get(self, kind: str, name: str, field: str = "") -> Component:
        """The component selected by ``name``: a registered name or ``package.module:Class``.

        Raises :class:`ConfigError` naming ``field``, the value and the registered names (with
        a suggestion when one is close), or the import error of a ``module:Class`` path.
        """
        found = self._by_kind[kind].get(name)
        if found is not None:
            return found
        noun = kind.replace("_", " ")
        if ":" in name:
            try:
                target = import_target(name)
            except Exception as error:
                raise ConfigError(
                    f"{field or kind} = {echo(name)}: cannot import it ({type(error).__name__}: "
                    f"{error})",
                    field=field,
                ) from error
            try:
                check_kind(target, kind, name)
            except TypeError as error:
                raise ConfigError(
                    f"{field or kind} = {echo(name)}: {error}; allowed: a registered {noun} "
                    f"({', '.join(self.names(kind)) or 'none installed'}) or a "
                    "'package.module:Class' path to such a subclass",
                    field=field,
                ) from None
            return self._with_base_capabilities(
                Component(
                    name=name,
                    target=name,
                    summary=(target.__doc__ or "").strip().split("\n")[0],
                    capabilities=getattr(target, "capabilities", None),
                    capabilities_of=getattr(target, "base", "") if kind == "communicator" else "",
                    kind=kind,
                    plugin="(import path)",
                )
            )
        known = self.names(kind)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        failed = [f.name for f in self.failures]
        failed_note = f" (plugins that failed to load: {', '.join(failed)})" if failed else ""
        raise ConfigError(
            f"{field or kind} = {echo(name)}: no installed plugin provides this {noun}{hint}. "
            f"Allowed: {', '.join(known) or 'none'}, or a 'package.module:Class' path"
            f"{failed_note}",
            field=field,
        )


def _collect(manager: pluggy.PluginManager, plugin_name: str) -> list[Component]:
    components: list[Component] = []
    for hook_name, kind in hookspecs.HOOK_KINDS.items():
        caller = getattr(manager.hook, hook_name)
        for impl in caller.get_hookimpls():
            if impl.plugin_name != plugin_name:
                continue
            for component in impl.function() or []:
                if not isinstance(component, Component):
                    raise TypeError(f"{hook_name} must return Component objects, got {component!r}")
                components.append(component.claimed_by(kind, plugin_name))
    return components


def installed_plugins() -> list[str]:
    """Names of the installed plugins (entry points of ``ENTRY_POINT_GROUP``), none loaded."""
    return sorted({ep.name for ep in _unique_entry_points()})


def _unique_entry_points() -> list[importlib.metadata.EntryPoint]:
    seen: set[tuple[str, str]] = set()
    unique = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if (ep.name, ep.value) not in seen:
            seen.add((ep.name, ep.value))
            unique.append(ep)
    return sorted(unique, key=lambda ep: ep.name)
