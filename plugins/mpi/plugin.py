"""Entry point of the MPI plugin (``shardline.plugins`` group, name ``mpi``).

Imports nothing heavy: importing mpi4py initializes MPI, which only a rank started by
mpiexec should do (an OpenMPI singleton leaves a shared-memory segment behind).
"""

from shardline.interfaces import Capabilities
from shardline.registry import Component, hookimpl

MPI_CAPABILITIES = Capabilities(
    devices=frozenset({"cpu"}),
    dtypes=frozenset({"float32", "float16", "bfloat16", "int32", "int64", "uint8"}),
    reduce_ops=frozenset({"sum", "max", "min"}),
    same_host_only=False,
    async_p2p=True,
    progresses_alone=False,
    launcher="mpiexec",
)


@hookimpl
def shardline_communicators() -> list[Component]:
    return [
        Component(
            name="mpi",
            target="shardline_mpi.communicator:MpiBackend",
            summary="MPI through mpi4py; CPU tensors without copies; ranks started by mpiexec",
            capabilities=MPI_CAPABILITIES,
            auto_preference=20,
        )
    ]
