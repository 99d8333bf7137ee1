"""Entry point of the custom all-reduce plugin (``shardline.plugins`` group, name
``custom_allreduce``): ``custom_ar`` over gloo and ``custom_ar_mpi`` over MPI. Each wraps a
registered communicator and has its capabilities (``capabilities_of``): everything but some
all-reduces is the base's work."""

from shardline.registry import Component, hookimpl


@hookimpl
def shardline_communicators() -> list[Component]:
    return [
        Component(
            name="custom_ar",
            target="shardline_custom_allreduce.communicator:CustomAllReduceBackend",
            summary="shared-memory all-reduce on one host, over gloo for everything else",
            capabilities_of="gloo",
            auto_preference=40,
        ),
        Component(
            name="custom_ar_mpi",
            target="shardline_custom_allreduce.communicator:CustomAllReduceOverMpi",
            summary="shared-memory all-reduce on one host, over MPI for everything else",
            capabilities_of="mpi",
            auto_preference=50,
        ),
    ]
