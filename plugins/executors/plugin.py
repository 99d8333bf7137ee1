"""Entry point of the built-in executors (``shardline.plugins`` group, name ``executors``)."""

import os
from collections.abc import Callable
from typing import Any

from shardline.registry import Component, hookimpl
from shardline.sdk import ForkServers


@hookimpl
def shardline_executors() -> list[Component]:
    return [
        Component(
            name="uni",
            target="shardline_executors.uni:UniProcExecutor",
            summary="one rank, in this process",
        ),
        Component(
            name="mp",
            target="shardline_executors.mp:MultiprocExecutor",
            summary="one process per rank on this host, driven through shared memory",
            prestart="shardline_executors.plugin:prestart_mp",
        ),
        Component(
            name="external_launcher",
            target="shardline_executors.external_launcher:ExternalLauncherExecutor",
            summary="every rank started by torchrun or mpiexec runs its own engine",
        ),
    ]


def prestart_mp(config: Any) -> Callable[[], None]:
    """The ``mp`` executor's head start: the fork server its ranks come from (this process's,
    for this environment) imports their module while the engine checks the config. Returns
    what ends that server at once where the config is refused (unless another world has
    used or holds it); unused otherwise, it ends ``linger_s`` later (or with this process)."""
    servers = ForkServers.process_wide()
    server = servers.prepare(os.environ, "shardline_executors.mp_worker")
    return lambda: servers.end_if_unused(server)
