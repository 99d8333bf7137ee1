"""Entry point of the built-in executors (``shardline.plugins`` group, name ``executors``)."""

from shardline.registry import Component, hookimpl


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
        ),
        Component(
            name="external_launcher",
            target="shardline_executors.external_launcher:ExternalLauncherExecutor",
            summary="every rank started by torchrun or mpiexec runs its own engine",
        ),
    ]
