"""Rank functions for the custom all-reduce tests (module level: they travel to rank
processes by name)."""

import os
import random
import time

import torch

from shardline.errors import CommTimeoutError
from shardline.interfaces import ReduceOp
from support.segments import job_segments


def paths_and_results(ctx, count: int, dtype: str):
    """Whether the shared path is on, whether it runs in C, and all-reduce results (sum, max)
    of rank-dependent inputs of ``count`` elements."""
    comm = ctx.comm
    torch_dtype = getattr(torch, dtype)
    values = (torch.arange(count) % 7 + comm.rank).to(torch_dtype)
    return comm.shared, comm.native, comm.all_reduce(values), comm.all_reduce(values, "max")


DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8")


def rank_values(rank: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Rank-dependent values with fractions, ties, a NaN (floats) and wrap-around (uint8)."""
    generator = torch.Generator().manual_seed(rank)
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * 100
    if dtype.startswith(("float", "bfloat")):
        values.view(-1)[rank] = float("nan")
        values.view(-1)[-1] = 0.5
    return values.to(getattr(torch, dtype)) if dtype != "uint8" else (values % 256).to(torch.uint8)


def every_dtype_and_op(ctx):
    """All-reduce results for every dtype x op of a small input, of its transpose (not
    contiguous) and of a 0-d one (keys: dtype, op, case)."""
    comm = ctx.comm
    results = {}
    for dtype in DTYPES:
        for op in ("sum", "max", "min"):
            matrix = rank_values(comm.rank, dtype, (6, 5))
            results[dtype, op, "small"] = comm.all_reduce(matrix, op)
            results[dtype, op, "strided"] = comm.all_reduce(matrix.t(), op)
            results[dtype, op, "scalar"] = comm.all_reduce(matrix[1, 1], op)
    return results


def expected_reduction(world_size: int, dtype: str, op: str, case: str) -> torch.Tensor:
    """What every rank must get: the ranks' inputs combined in rank order, one op at a time."""
    combine = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    inputs = [rank_values(rank, dtype, (6, 5)) for rank in range(world_size)]
    inputs = {
        "small": inputs,
        "strided": [value.t() for value in inputs],
        "scalar": [value[1, 1] for value in inputs],
    }[case]
    total = inputs[0]
    for value in inputs[1:]:
        total = combine(total, value)
    return total


def segments_while_mapped(ctx, job: str):
    """Whether the shared path is on, and the job's segments in /dev/shm (after a call)."""
    comm = ctx.comm
    comm.all_reduce(torch.ones(8))
    return comm.shared, job_segments(job)


def die_in_all_reduce(ctx, victim: int):
    """``victim`` exits abruptly; the others must get CommTimeoutError within the deadline."""
    comm = ctx.comm
    group = comm.new_group(list(range(comm.world_size)), timeout_s=1.5)
    group.all_reduce(torch.ones(4))
    if comm.rank == victim:
        os._exit(9)
    start = time.monotonic()
    try:
        group.all_reduce(torch.ones(4))
    except CommTimeoutError:
        return time.monotonic() - start
    raise AssertionError("all_reduce returned although a rank was gone")


def back_to_back(ctx, calls: int, seed: int):
    """``calls`` all-reduces in a row of call-dependent values and shapes (small ones: the
    alternating slot sets), one large one now and then, each rank pausing at random points
    so ranks run ahead of each other; returns the calls whose result was wrong."""
    comm = ctx.comm
    pauses = random.Random(seed * 100 + comm.rank)
    wrong = []
    for call in range(calls):
        count = (1 << 17) + call if call % 50 == 49 else 1 + call % 5
        values = torch.full((count,), float(call * 10 + comm.rank))
        if pauses.random() < 0.1:
            time.sleep(pauses.random() * 0.002)
        total = comm.all_reduce(values)
        expected = float(sum(call * 10 + rank for rank in range(comm.world_size)))
        if not torch.equal(total, torch.full((count,), expected)):
            wrong.append(call)
    return wrong


def native_runs(ctx, rows: int, calls: int):
    """Sums of ``calls`` rank-dependent float32 ``[rows, 576]`` tensors through the
    communicator's native entry point (in place, from C), then through ``all_reduce`` on the
    same inputs, then one more ``all_reduce`` (the call numbers go on after a native run)."""
    from shardline.layers import _kernels

    comm = ctx.comm
    inputs = [
        torch.randn(rows, 576, generator=torch.Generator().manual_seed(comm.rank + 10 * call))
        for call in range(calls)
    ]
    native = comm.native_all_reduce(inputs[0], calls)
    natively = [value.clone() for value in inputs]
    failures = [_kernels.native_all_reduce_call(native.capsule, t.data_ptr()) for t in natively]
    reduced = [comm.all_reduce(value) for value in inputs]
    after = comm.all_reduce(torch.full((3,), float(comm.rank)))
    return native.calls, failures, natively, reduced, after


def native_run_with_a_silent_rank(ctx, silent: int):
    """Every rank but ``silent`` makes one call of a native run; the others' failures (as the
    C code reports them), how long each took to come, and the error they become."""
    from shardline.layers import _kernels

    comm = ctx.comm
    value = torch.ones(2, 576)
    native = comm.native_all_reduce(value, 1)
    if comm.rank == silent:
        return None
    start = time.monotonic()
    failure = _kernels.native_all_reduce_call(native.capsule, value.data_ptr())
    seconds = time.monotonic() - start
    error = None if failure is None else native.failed(*failure)
    return failure, seconds, type(error).__name__, str(error)


def barrier_with_a_silent_rank(ctx, silent: int, rounds: int):
    """``rounds`` barriers with all-reduces between them on every rank, then one more that
    ``silent`` skips: the others' error messages and how long each took to come."""
    comm = ctx.comm
    for round_ in range(rounds):
        comm.barrier()
        total = comm.all_reduce(torch.full((3,), float(round_)))
        assert total.tolist() == [float(round_ * comm.world_size)] * 3
    if comm.rank == silent:
        return None
    start = time.monotonic()
    try:
        comm.barrier()
    except CommTimeoutError as error:
        return str(error), time.monotonic() - start
    raise AssertionError("the barrier returned although one rank never entered it")


def native_run_called_too_often(ctx):
    """A native run made for one call, called twice: the second call's failure, as the
    communicator's error type and message, and an all-reduce after it."""
    from shardline.layers import _kernels

    comm = ctx.comm
    value = torch.ones(2, 576)
    native = comm.native_all_reduce(value, 1)
    first = _kernels.native_all_reduce_call(native.capsule, value.data_ptr())
    second = _kernels.native_all_reduce_call(native.capsule, value.data_ptr())
    error = native.failed(*second) if second is not None else None
    after = comm.all_reduce(torch.full((3,), float(comm.rank)))
    return first, type(error).__name__, str(error), after.tolist()


def routed_variants(ctx, rounds: int):
    """All-reduces that the C router (where built) runs or hands to the general path, mixed
    call by call: one size as float32 in two shapes and as int32 (one size, three results),
    ops positional, by keyword and as strings, a tensor needing grad, a Parameter (a
    subclass), a transposed (not contiguous) one, and twelve sizes in turn (more than the
    router keeps). Returns (whether all_reduce is the router, [(case, result), ...])."""
    comm = ctx.comm
    rank = comm.rank
    cases = []
    for round_ in range(rounds):
        base = torch.arange(12, dtype=torch.float32) + 100 * rank + round_
        cases += [
            ("flat", comm.all_reduce(base)),
            ("matrix", comm.all_reduce(base.view(3, 4))),
            ("int32", comm.all_reduce(base.to(torch.int32))),
            ("max keyword", comm.all_reduce(base, op="max")),
            ("min enum", comm.all_reduce(base, ReduceOp.MIN)),
            ("grad", comm.all_reduce(base.clone().requires_grad_())),
            ("parameter", comm.all_reduce(torch.nn.Parameter(base.clone()))),
            ("transposed", comm.all_reduce(base.view(3, 4).t())),
            ("size", comm.all_reduce(torch.full((1 + round_ % 12,), float(rank + round_)))),
        ]
    return type(comm.all_reduce).__name__, cases


def expected_routed_variants(world_size: int, rounds: int) -> list[tuple[str, torch.Tensor]]:
    """What :func:`routed_variants` must return on every rank."""
    expected = []
    for round_ in range(rounds):
        inputs = [
            torch.arange(12, dtype=torch.float32) + 100 * r + round_ for r in range(world_size)
        ]
        total = sum(inputs[1:], inputs[0])
        sizes = float(sum(r + round_ for r in range(world_size)))
        expected += [
            ("flat", total),
            ("matrix", total.view(3, 4)),
            ("int32", total.to(torch.int32)),
            ("max keyword", inputs[-1]),
            ("min enum", inputs[0]),
            ("grad", total),
            ("parameter", total),
            ("transposed", total.view(3, 4).t()),
            ("size", torch.full((1 + round_ % 12,), sizes)),
        ]
    return expected
