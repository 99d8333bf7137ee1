"""A rank under mpiexec: the MPI communicator's native all-reduce entry point, run from C.

    python -m support.mpi_native_runs CALLS SILENT_RANK

Every rank sums ``CALLS`` rank-dependent float32 ``[2, 576]`` tensors through the native
entry point (in place, from C), then the same inputs through ``all_reduce``, then one more
``all_reduce``; then one native call that MPI itself fails (made for MPI_OP_NULL); then, in a
group with a 2 s deadline, every rank but ``SILENT_RANK`` (-1: none) makes one native call.
Rank 0 prints one JSON line: whether the entry point exists, the native sums equal the
all-reduce's bit for bit on this rank, the call after it, the MPI failure's error type and
message, and each waiting rank's error type, message and seconds.
"""

import json
import os
import sys
import time

import torch
from shardline_mpi.communicator import MpiBackend

from shardline.interfaces import Rendezvous
from shardline.layers import _kernels


def main(calls: int, silent: int) -> None:
    rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    comm = MpiBackend().init_world(rank, size, Rendezvous("127.0.0.1", 0), 30.0)
    inputs = [
        torch.randn(2, 576, generator=torch.Generator().manual_seed(rank + 10 * call))
        for call in range(calls)
    ]
    native = comm.native_all_reduce(inputs[0], calls)
    report = {"native": native is not None}
    if native is not None:
        natively = [value.clone() for value in inputs]
        failures = [_kernels.native_all_reduce_call(native.capsule, t.data_ptr()) for t in natively]
        reduced = [comm.all_reduce(value) for value in inputs]
        after = comm.all_reduce(torch.full((3,), float(rank)))
        report["failures"] = failures
        report["same_bits"] = all(torch.equal(a, b) for a, b in zip(natively, reduced, strict=True))
        report["after"] = after.tolist()
        report["mpi_error"] = _mpi_error(comm)
        report["silent"] = _silent_rank(comm, silent)
    widths = comm.all_gather(torch.tensor([len(json.dumps(report).encode())]), 0)
    reports = _gather_reports(comm, report, int(widths.max()))
    if rank == 0:
        print(json.dumps(reports), flush=True)
    comm.close()


def _mpi_error(comm):
    """A native call that MPI fails with an error code: the run is made for an invalid
    reduction (MPI_OP_NULL in place of MPI_SUM while it is made)."""
    from mpi4py import MPI

    value, real_sum = torch.ones(4), MPI.SUM
    MPI.SUM = MPI.OP_NULL
    try:
        native = comm.native_all_reduce(value, 1)
    finally:
        MPI.SUM = real_sum
    failure = _kernels.native_all_reduce_call(native.capsule, value.data_ptr())
    if failure is None:
        return None
    error = native.failed(*failure)
    return {"type": type(error).__name__, "message": str(error)}


def _silent_rank(comm, silent: int):
    group = comm.new_group(list(range(comm.world_size)), timeout_s=2.0)
    value = torch.ones(2, 576)
    native = group.native_all_reduce(value, 1)
    if comm.rank == silent:
        time.sleep(4.0)  # past the others' deadline, alive and connected
        return None
    start = time.monotonic()
    failure = _kernels.native_all_reduce_call(native.capsule, value.data_ptr())
    seconds = time.monotonic() - start
    if failure is None:
        return {"failure": None, "seconds": seconds}
    error = native.failed(*failure)
    return {"type": type(error).__name__, "message": str(error), "seconds": seconds}


def _gather_reports(comm, report: dict, width: int) -> list[dict]:
    encoded = json.dumps(report).encode().ljust(width)
    gathered = comm.all_gather(torch.frombuffer(bytearray(encoded), dtype=torch.uint8), 0)
    return [json.loads(bytes(chunk.tolist())) for chunk in gathered.split(width)]


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
