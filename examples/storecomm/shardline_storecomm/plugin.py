"""Entry point (``shardline.plugins`` group): what this plugin provides."""

from shardline.interfaces import Capabilities
from shardline.registry import Component, hookimpl

CAPABILITIES = Capabilities(
    devices=frozenset({"cpu"}),
    dtypes=frozenset({"float32", "float16", "bfloat16", "int32", "int64", "uint8"}),
    reduce_ops=frozenset({"sum", "max", "min"}),
    same_host_only=False,
    async_p2p=True,
)


@hookimpl
def shardline_communicators():
    return [
        Component(
            name="storecomm",
            target="shardline_storecomm.backend:StoreBackend",
            summary="example plugin: messages through the rendezvous key-value store",
            capabilities=CAPABILITIES,
        )
    ]
