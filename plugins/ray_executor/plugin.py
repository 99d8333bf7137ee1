"""Entry point of the Ray executor (``shardline.plugins`` group, name ``ray``).

Imports nothing heavy: whether Ray can run here is decided by the executor's
``unavailable_reason`` (the ``ray`` package installed).
"""

from shardline.registry import Component, hookimpl


@hookimpl
def shardline_executors() -> list[Component]:
    return [
        Component(
            name="ray",
            target="shardline_ray.executor:RayExecutor",
            summary="one Ray actor per rank in a placement group, on the cluster RAY_ADDRESS "
            "names or a Ray instance started on this host",
        )
    ]
