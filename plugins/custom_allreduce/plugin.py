"""Entry point of the custom all-reduce plugin (``shardline.plugins`` group, name
``custom_allreduce``): ``custom_ar`` over gloo and ``custom_ar_mpi`` over MPI."""

from dataclasses import replace

from shardline.interfaces.capabilities import Capabilities
from shardline.registry import Component, hookimpl

#: Everything but the all-reduce is the base's: these are gloo's capabilities.
CUSTOM_AR_CAPABILITIES = Capabilities(
    devices=frozenset({"cpu"}),
    dtypes=frozenset({"float32", "float16", "bfloat16", "int32", "int64", "uint8"}),
    reduce_ops=frozenset({"sum", "max", "min"}),
    same_host_only=False,
    async_p2p=True,
)
CUSTOM_AR_MPI_CAPABILITIES = replace(CUSTOM_AR_CAPABILITIES, launcher="mpiexec")


@hookimpl
def shardline_communicators() -> list[Component]:
    return [
        Component(
            name="custom_ar",
            target="shardline_custom_allreduce.communicator:CustomAllReduceBackend",
            summary="shared-memory all-reduce on one host, over gloo for everything else",
            capabilities=CUSTOM_AR_CAPABILITIES,
        ),
        Component(
            name="custom_ar_mpi",
            target="shardline_custom_allreduce.communicator:CustomAllReduceOverMpi",
            summary="shared-memory all-reduce on one host, over MPI for everything else",
            capabilities=CUSTOM_AR_MPI_CAPABILITIES,
        ),
    ]
