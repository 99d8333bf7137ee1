"""Entry point of the NCCL plugin (``shardline.plugins`` group, name ``nccl``).

Imports nothing heavy; whether NCCL can run here is decided by the backend's
``unavailable_reason`` (a CUDA build of torch, and CUDA devices).
"""

from shardline.interfaces import Capabilities
from shardline.registry import Component, hookimpl

NCCL_CAPABILITIES = Capabilities(
    # CUDA tensors natively; CPU tensors are staged through the rank's device.
    devices=frozenset({"cuda", "cpu"}),
    dtypes=frozenset({"float32", "float16", "bfloat16", "int32", "int64", "uint8"}),
    reduce_ops=frozenset({"sum", "max", "min"}),
    same_host_only=False,
    async_p2p=True,
)


@hookimpl
def shardline_communicators() -> list[Component]:
    return [
        Component(
            name="nccl",
            target="shardline_nccl.communicator:NcclBackend",
            summary="torch.distributed NCCL on cuda:{local_rank}; needs one CUDA device per rank",
            capabilities=NCCL_CAPABILITIES,
            auto_preference=30,
        )
    ]
