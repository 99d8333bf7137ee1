"""The whole plugin API: three hooks returning the components a plugin provides, and one
called in every rank process as it starts.

A plugin is a plain module named by an entry point in the ``shardline.plugins`` group::

    # pyproject.toml of your package
    [project.entry-points."shardline.plugins"]
    mycomm = "mycomm.plugin"

    # mycomm/plugin.py
    from shardline.interfaces import Capabilities
    from shardline.registry import Component, hookimpl

    @hookimpl
    def shardline_communicators():
        return [Component(name="mycomm", target="mycomm.backend:MyBackend",
                          summary="what it is", capabilities=Capabilities(...))]

Implement any subset of the hooks. Keep the plugin module cheap to import: ``target`` is a
``"module:attribute"`` string imported only when the component is used. Component names are
global per kind: two plugins providing the same name is an error naming both.
"""

from __future__ import annotations

import pluggy

from shardline.registry.component import Component

PROJECT = "shardline"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def shardline_communicators() -> list[Component]:
    """Communicator backends. ``target`` resolves to a
    :class:`~shardline.interfaces.CommunicatorBackend` subclass; ``capabilities`` must equal
    that class's ``capabilities``."""


@hookspec
def shardline_executors() -> list[Component]:
    """Executors. ``target`` resolves to an :class:`~shardline.interfaces.Executor` subclass."""


@hookspec
def shardline_model_runners() -> list[Component]:
    """Model runners. ``target`` resolves to a :class:`~shardline.interfaces.ModelRunner`
    subclass."""


@hookspec
def shardline_rank_starting(rank: int, world_size: int) -> None:
    """Called in every rank's process (driver-owned workers and launched ranks alike) after
    the plugins loaded and before the rank joins its worlds: per-process setup such as CPU
    pinning, logging or environment. An exception here fails the rank's start-up; a hook that
    never returns is a rank that never joins (the others' start-up deadline names it)."""


#: Hook name -> component kind, in the order the CLI lists them.
HOOK_KINDS: dict[str, str] = {
    "shardline_communicators": "communicator",
    "shardline_executors": "executor",
    "shardline_model_runners": "model_runner",
}
