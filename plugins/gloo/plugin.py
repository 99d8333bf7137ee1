"""Entry point of the gloo plugin (``shardline.plugins`` group, name ``gloo``).

Kept free of heavy imports: the registry reads the component list without importing torch.
"""

from shardline.interfaces import Capabilities
from shardline.registry import Component, hookimpl

GLOO_CAPABILITIES = Capabilities(
    devices=frozenset({"cpu"}),
    dtypes=frozenset({"float32", "float16", "bfloat16", "int32", "int64", "uint8"}),
    reduce_ops=frozenset({"sum", "max", "min"}),
    same_host_only=False,
    async_p2p=True,
)


@hookimpl
def shardline_communicators() -> list[Component]:
    return [
        Component(
            name="gloo",
            target="shardline_gloo.communicator:GlooBackend",
            summary="torch.distributed gloo over TCP; CPU tensors, any number of hosts",
            capabilities=GLOO_CAPABILITIES,
            auto_preference=10,
        )
    ]
