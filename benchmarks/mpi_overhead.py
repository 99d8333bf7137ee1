"""The MPI communicator against raw mpi4py on the same buffers, in the same run.

Run under mpiexec (2 ranks by default; as root add the two OMPI_ALLOW_RUN_AS_ROOT variables):

    mpiexec --oversubscribe -n 2 python benchmarks/mpi_overhead.py [--json out.json]

For each size, float32 all-reduce, four ways, interleaved iteration by iteration (so the
machine's drift touches all four alike), a barrier before each:

- ``Allreduce``: raw blocking call into a preallocated output (no deadline possible);
- ``Iallreduce+Wait``: the nonblocking call, waited on in C (still no deadline);
- ``polled``: what a deadline needs, done by hand: a new output tensor, ``Iallreduce`` and a
  Python loop of ``Test`` (the floor for an out-of-place call that can give up);
- ``shardline``: the communicator's ``all_reduce``.

Median over iterations of rank 0's time. Target (issue 5): shardline within 1.3x of raw
mpi4py; both ratios are printed, to ``Allreduce`` and to the deadline-capable ``polled``.
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
WARMUP = 5


def _polled(comm, tensor: torch.Tensor) -> torch.Tensor:
    result = torch.empty_like(tensor)
    request = comm.Iallreduce(tensor.numpy(), result.numpy())
    while not request.Test():
        pass
    return result


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
        ways = {
            "allreduce": lambda s=send, r=receive: raw.Allreduce(s, r),
            "iallreduce_wait": lambda s=send, r=receive: raw.Iallreduce(s, r).Wait(),
            "polled": lambda t=tensor: _polled(raw, t),
            "shardline": lambda t=tensor: shardline.all_reduce(t),
        }
        samples: dict[str, list[float]] = {name: [] for name in ways}
        iterations = max(5, min(args.iterations, (64 << 20) // max(nbytes, 1)))
        for index in range(WARMUP + iterations):
            for name, way in ways.items():
                raw.Barrier()
                start = time.perf_counter()
                way()
                if index >= WARMUP:
                    samples[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(times) * 1e6 for name, times in samples.items()}
        rows.append(
            {
                "bytes": nbytes,
                **{f"{name}_us": value for name, value in medians.items()},
                "shardline_over_allreduce": medians["shardline"] / medians["allreduce"],
                "shardline_over_polled": medians["shardline"] / medians["polled"],
            }
        )
    shardline.close()
    if world.Get_rank() == 0:
        print(f"{world.Get_size()} ranks, float32 all-reduce, median µs (interleaved)")
        print(
            f"{'bytes':>10} {'Allreduce':>10} {'Iall+Wait':>10} {'polled':>8} {'shardline':>10} "
            f"{'/Allreduce':>10} {'/polled':>8}"
        )
        for row in rows:
            print(
                f"{row['bytes']:>10} {row['allreduce_us']:>10.1f} "
                f"{row['iallreduce_wait_us']:>10.1f} {row['polled_us']:>8.1f} "
                f"{row['shardline_us']:>10.1f} {row['shardline_over_allreduce']:>10.2f} "
                f"{row['shardline_over_polled']:>8.2f}"
            )
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
