"""The MPI communicator against raw mpi4py on the same buffers, in the same run.

Run under mpiexec (2 ranks by default; as root add the two OMPI_ALLOW_RUN_AS_ROOT variables):

    mpiexec --oversubscribe -n 2 python benchmarks/mpi_overhead.py [--json out.json]

For each size, float32 all-reduce: raw ``Allreduce`` (blocking, no deadline), raw
``Iallreduce`` + ``Wait``, and Shardline's ``all_reduce`` (nonblocking, polled against a
deadline, out of place). Median over iterations on rank 0, with a barrier before each.
Target (issue 5): the communicator within 1.3x of raw mpi4py at every size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from mpi4py import MPI
from shardline_mpi.communicator import MpiBackend

from shardline.interfaces import Rendezvous

SIZES = [4, 64, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def _median_us(comm, operation, iterations: int) -> float:
    samples = []
    for _ in range(iterations + 5):
        comm.Barrier()
        start = time.perf_counter()
        operation()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[5:]) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    raw = world.Dup()
    shardline = MpiBackend().init_world(world.Get_rank(), world.Get_size(), Rendezvous("", 0), 60)
    rows = []
    for nbytes in SIZES:
        tensor = torch.ones(nbytes // 4)
        out = torch.empty_like(tensor)
        send, receive = tensor.numpy(), out.numpy()
        iterations = max(5, min(args.iterations, (64 << 20) // max(nbytes, 1)))
        blocking = _median_us(raw, lambda s=send, r=receive: raw.Allreduce(s, r), iterations)
        nonblocking = _median_us(
            raw, lambda s=send, r=receive: raw.Iallreduce(s, r).Wait(), iterations
        )
        ours = _median_us(raw, lambda t=tensor: shardline.all_reduce(t), iterations)
        rows.append(
            {
                "bytes": nbytes,
                "raw_allreduce_us": blocking,
                "raw_iallreduce_us": nonblocking,
                "shardline_us": ours,
                "shardline_over_raw": ours / blocking,
            }
        )
    shardline.close()
    if world.Get_rank() == 0:
        print(f"{world.Get_size()} ranks, float32 all-reduce, median µs")
        print(f"{'bytes':>10} {'Allreduce':>10} {'Iallreduce':>11} {'shardline':>10} {'ratio':>6}")
        for row in rows:
            print(
                f"{row['bytes']:>10} {row['raw_allreduce_us']:>10.1f} "
                f"{row['raw_iallreduce_us']:>11.1f} {row['shardline_us']:>10.1f} "
                f"{row['shardline_over_raw']:>6.2f}"
            )
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
