"""Rank-side checks. Each runs on every rank of a world, asserts what that rank can see, and
returns a small picklable value (or None). Failures are AssertionErrors naming what differs.
"""

from __future__ import annotations

import gc
import pickle
import time
from pathlib import Path

import torch

from shardline.conformance.cases import assert_same, make_input, reduce_expected
from shardline.distributed import ParallelLayout, ParallelState
from shardline.errors import CommTimeoutError, PeerLostError, ProtocolError
from shardline.interfaces import ReduceOp


def _unchanged(before: torch.Tensor, after: torch.Tensor, op: str) -> None:
    assert_same(after, before, f"{op} modified its input")


def all_reduce(ctx, shape: str, dtype: str, op: str) -> None:
    comm = ctx.comm
    tensor = make_input(comm.rank, shape, dtype)
    before = tensor.clone()
    result = comm.all_reduce(tensor, ReduceOp(op))
    expected = reduce_expected(range(comm.world_size), shape, dtype, op)
    assert_same(result, expected, f"all_reduce({op})")
    assert result.data_ptr() != tensor.data_ptr() or tensor.numel() == 0, "all_reduce is in place"
    _unchanged(before, tensor, "all_reduce")


def all_gather(ctx, shape: str, dtype: str, dim: int) -> None:
    comm = ctx.comm
    tensor = make_input(comm.rank, shape, dtype)
    result = comm.all_gather(tensor, dim)
    expected = torch.cat([make_input(r, shape, dtype) for r in range(comm.world_size)], dim)
    assert_same(result, expected, f"all_gather(dim={dim})")
    assert result.is_contiguous(), "all_gather result is not contiguous"


def reduce_scatter(ctx, shape: str, dtype: str, op: str) -> None:
    comm = ctx.comm
    n = comm.world_size
    tensor = make_input(comm.rank, shape, dtype, leading=n)
    before = tensor.clone()
    result = comm.reduce_scatter(tensor, 0, ReduceOp(op))
    full = reduce_expected(range(n), shape, dtype, op, leading=n)
    assert_same(result, full.chunk(n, 0)[comm.rank].contiguous(), f"reduce_scatter({op})")
    _unchanged(before, tensor, "reduce_scatter")


def reduce_scatter_indivisible(ctx) -> None:
    comm = ctx.comm
    try:
        comm.reduce_scatter(torch.ones(comm.world_size + 1), 0)
    except ValueError:
        return
    raise AssertionError("reduce_scatter accepted a size not divisible by the group size")


def gather(ctx, shape: str, dtype: str) -> None:
    comm = ctx.comm
    dst = comm.world_size - 1
    result = comm.gather(make_input(comm.rank, shape, dtype), dst, 0)
    if comm.rank == dst:
        expected = torch.cat([make_input(r, shape, dtype) for r in range(comm.world_size)], 0)
        assert_same(result, expected, "gather on the destination")
    elif result is not None:
        raise AssertionError(f"gather returned {type(result).__name__} on a non-destination rank")


def broadcast(ctx, shape: str, dtype: str) -> None:
    comm = ctx.comm
    src = comm.world_size - 1
    tensor = make_input(comm.rank, shape, dtype)
    returned = comm.broadcast(tensor, src)
    expected = make_input(src, shape, dtype)
    assert returned is tensor, "broadcast must return the tensor it filled in place"
    assert_same(tensor, expected, "broadcast (in place)")


def send_recv(ctx, shape: str, dtype: str) -> None:
    """A ring: each rank sends to the next and receives from the previous. Even ranks send
    first, odd ranks receive first, so blocking point-to-point cannot deadlock."""
    comm = ctx.comm
    n, rank = comm.world_size, comm.rank
    outgoing = make_input(rank, shape, dtype)
    incoming = torch.empty_like(make_input(0, shape, dtype))
    if rank % 2 == 0:
        comm.send(outgoing, (rank + 1) % n)
        received = comm.recv(incoming, (rank - 1) % n)
    else:
        received = comm.recv(incoming, (rank - 1) % n)
        comm.send(outgoing, (rank + 1) % n)
    assert received is incoming, "recv must return the tensor it filled"
    assert_same(incoming, make_input((rank - 1) % n, shape, dtype), "recv")


def isend_irecv(ctx, shape: str, dtype: str) -> None:
    """Every rank isends to the next and irecvs from the previous before waiting; the send
    buffer is dropped by the caller (the Work keeps it alive) and waits are repeated."""
    comm = ctx.comm
    n, rank = comm.world_size, comm.rank
    buffer = torch.empty_like(make_input(0, shape, dtype))
    send_work = comm.isend(make_input(rank, shape, dtype), (rank + 1) % n)
    recv_work = comm.irecv(buffer, (rank - 1) % n)
    gc.collect()
    received = recv_work.wait()
    send_work.wait()
    assert recv_work.is_completed() and send_work.is_completed(), "completed work says it is not"
    assert recv_work.wait() is received and send_work.wait() is None, "second wait differs"
    assert received is buffer, "irecv wait() must return the buffer it filled"
    assert_same(buffer, make_input((rank - 1) % n, shape, dtype), "irecv")


def p2p_order(ctx) -> None:
    """Rank 0 sends rank 1 a tensor, an object, a tensor dict (through the control plane over
    the backend) and five more tensors; rank 1 posts every receive first, then waits in
    reverse order: each arrives in sending order."""
    comm, control = ctx.comm, ctx.control
    if comm.rank == 0:
        comm.send(torch.full((3,), 7.0), 1)
        control.send_object({"step": 1}, 1)
        control.send_tensor_dict({"x": torch.arange(4.0), "tag": "first"}, 1)
        works = [comm.isend(torch.full((i + 1,), float(i)), 1) for i in range(5)]
        for work in works:
            work.wait()
    elif comm.rank == 1:
        first = comm.recv(torch.empty(3), 0)
        obj = control.recv_object(0)
        pending_dict = control.irecv_tensor_dict(0)
        buffers = [torch.empty(i + 1) for i in range(5)]
        works = [comm.irecv(b, 0) for b in buffers]
        for work in reversed(works):
            work.wait()
        received = pending_dict.wait()
        assert_same(first, torch.full((3,), 7.0), "first message")
        assert obj == {"step": 1}, f"object out of order: {obj!r}"
        assert received["tag"] == "first", f"tensor dict out of order: {received!r}"
        assert_same(received["x"], torch.arange(4.0), "tensor dict tensor")
        for i, buffer in enumerate(buffers):
            assert_same(buffer, torch.full((i + 1,), float(i)), f"message {i} of 5")


def barrier(ctx) -> float:
    """The last rank arrives 0.3 s late; nobody may leave before it arrives."""
    comm = ctx.comm
    comm.barrier()
    start = time.monotonic()
    if comm.rank == comm.world_size - 1:
        time.sleep(0.3)
    comm.barrier()
    waited = time.monotonic() - start
    if comm.world_size > 1 and waited < 0.25:
        raise AssertionError(f"left the barrier after {waited:.3f} s, before the last rank came")
    return waited


def objects(ctx) -> None:
    """Signed objects through the control plane over the backend: a broadcast of 1 MiB and
    more, and a ring of sends."""
    comm, control = ctx.comm, ctx.control
    n, rank = comm.world_size, comm.rank
    src = n - 1
    payload = {"from": rank, "nested": [1, (2, 3), {"x": None}], "blob": b"\x00" * (1 << 20)}
    got = control.broadcast_object(payload if rank == src else None, src)
    assert got["from"] == src and got["nested"] == payload["nested"], f"broadcast_object: {got!r}"
    assert len(got["blob"]) == 1 << 20, "broadcast_object lost bytes"
    if n == 1:
        return
    message = {"from": rank, "text": "x" * (rank + 1)}
    if rank % 2 == 0:
        control.send_object(message, (rank + 1) % n)
        got = control.recv_object((rank - 1) % n)
    else:
        got = control.recv_object((rank - 1) % n)
        control.send_object(message, (rank + 1) % n)
    prev = (rank - 1) % n
    assert got == {"from": prev, "text": "x" * (prev + 1)}, f"recv_object: {got!r}"


class _Planted:
    """Unpickling this creates the file ``path``: the proof that bytes reached pickle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def unsigned_objects(ctx, marker: str) -> None:
    """Rank 0 broadcasts, over the backend, a pickle that would create ``marker`` when
    unpickled, without the job secret's signature (what a process outside the job could
    send): every other rank's control plane refuses it with ProtocolError, unread."""
    comm, control = ctx.comm, ctx.control
    if comm.rank == 0:
        raw = bytes(32) + pickle.dumps(_Planted(marker))  # a tag that is not the HMAC
        payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(control.device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=control.device)
        comm.broadcast(size, 0)
        comm.broadcast(payload, 0)
        return
    try:
        control.broadcast_object(None, 0)
    except ProtocolError as error:
        assert "fails the job-secret check" in str(error), str(error)
    else:
        raise AssertionError("unsigned bytes were accepted as an object")
    assert not Path(marker).exists(), "unsigned bytes reached pickle"


def _sample_tensor_dict(rank: int) -> dict:
    result = {
        f"t_{dtype}": make_input(rank, "odd", dtype)
        for dtype in ("float32", "float16", "bfloat16", "int32", "int64")
    }
    result.update(
        {
            "noncontig": make_input(rank, "noncontig", "float32"),
            "empty": torch.empty(0, 4),
            "label": f"from {rank}",
            "count": rank,
            "nothing": None,
        }
    )
    return result


def _check_tensor_dict(received: dict, sender: int) -> None:
    expected = _sample_tensor_dict(sender)
    assert list(received) == list(expected), f"keys {list(received)} != {list(expected)}"
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert_same(received[key], value.contiguous(), f"tensor dict entry {key!r}")
        else:
            assert received[key] == value, (
                f"tensor dict entry {key!r}: {received[key]!r} != {value!r}"
            )


def tensor_dicts(ctx, asynchronous: bool) -> None:
    """Tensor dicts through the control plane over the backend, in a ring."""
    comm, control = ctx.comm, ctx.control
    n, rank = comm.world_size, comm.rank
    if asynchronous:
        send_work = control.isend_tensor_dict(_sample_tensor_dict(rank), (rank + 1) % n)
        recv_work = control.irecv_tensor_dict((rank - 1) % n)
        received = recv_work.wait()
        send_work.wait()
        assert recv_work.wait() is received, "second wait of irecv_tensor_dict differs"
    elif rank % 2 == 0:
        control.send_tensor_dict(_sample_tensor_dict(rank), (rank + 1) % n)
        received = control.recv_tensor_dict((rank - 1) % n)
    else:
        received = control.recv_tensor_dict((rank - 1) % n)
        control.send_tensor_dict(_sample_tensor_dict(rank), (rank + 1) % n)
    _check_tensor_dict(received, (rank - 1) % n)


def subgroups(ctx, rounds: int) -> None:
    """TP=2 x PP=2 in a world of 4: both TP groups reduce different shapes at the same time,
    for several rounds, then the PP groups gather and exchange tensor dicts."""
    comm = ctx.comm
    control = comm.new_group(list(range(comm.world_size)))
    state = ParallelState.create(
        ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=2),
        comm,
        control,
        ctx.secret,
    )
    try:
        tp, pp = state.tp, state.pp
        expected_tp = {0: [0, 1], 1: [2, 3]}[comm.rank // 2]
        assert tp.ranks == expected_tp, f"TP group {tp.ranks}, expected {expected_tp}"
        assert pp.ranks == [comm.rank % 2, comm.rank % 2 + 2], f"PP group {pp.ranks}"
        width = 3 + 2 * (comm.rank // 2)  # group [0,1] uses 3 elements, [2,3] uses 5
        for round_ in range(rounds):
            value = torch.full((width,), float(comm.rank + round_))
            result = tp.all_reduce(value)
            expected = sum(float(r + round_) for r in tp.ranks)
            assert_same(result, torch.full((width,), expected), f"TP all_reduce round {round_}")
        gathered = pp.data.all_gather(torch.tensor([comm.rank]), 0)
        assert gathered.tolist() == pp.ranks, f"PP all_gather {gathered.tolist()}"
        if pp.is_first_rank:
            pp.send_tensor_dict({"hidden": torch.full((2, 3), float(comm.rank))})
        else:
            got = pp.recv_tensor_dict()
            assert_same(got["hidden"], torch.full((2, 3), float(pp.ranks[0])), "PP tensor dict")
        state.world.barrier()
    finally:
        state.close()
        control.close()


def never_joins(ctx, deadline_s: float) -> tuple[float, str] | None:
    """In a fresh group with a short deadline, the last rank skips an all_reduce, staying
    alive and connected (it returns at once, holding the group open until
    :func:`close_held`): every other rank must raise CommTimeoutError by the deadline + 1 s,
    or PeerLostError when a rank that timed out first closed the group (the contract allows
    it). Returns (seconds, the error's type name) on the waiting ranks."""
    comm = ctx.comm
    group = comm.new_group(list(range(comm.world_size)), timeout_s=deadline_s)
    if comm.rank == comm.world_size - 1:
        ctx.held.append(group)
        group.barrier()
        return None
    try:
        group.barrier()
        start = time.monotonic()
        try:
            group.all_reduce(torch.ones(4))
        except (CommTimeoutError, PeerLostError) as error:
            elapsed, kind = time.monotonic() - start, type(error).__name__
        else:
            raise AssertionError("all_reduce returned although one rank never joined")
        if elapsed > deadline_s + 1.0:
            raise AssertionError(f"raised after {elapsed:.2f} s; the deadline was {deadline_s} s")
        return elapsed, kind
    finally:
        group.close()


def late_member(ctx, deadline_s: float) -> None:
    """The last rank reaches ``new_group`` (deadline ``deadline_s``) ``deadline_s`` + 0.5 s
    after the others: joining waits as long as joining the world did, not the new group's
    deadline, so every rank joins; a barrier of the world (so that a backend whose join does
    not wait still starts together), then an all_reduce over the group, sums."""
    comm = ctx.comm
    if comm.rank == comm.world_size - 1:
        time.sleep(deadline_s + 0.5)
    group = comm.new_group(list(range(comm.world_size)), timeout_s=deadline_s)
    try:
        comm.barrier()
        total = group.all_reduce(torch.ones(4))
        assert_same(total, torch.full((4,), float(comm.world_size)), "all_reduce after a late join")
    finally:
        group.close()


def recv_deadline(ctx, deadline_s: float) -> float | None:
    """Rank 0 waits for a message rank 1 (alive, connected: holding the group open until
    :func:`close_held`) never sends, with an explicit wait timeout shorter than the group's
    deadline."""
    comm = ctx.comm
    group = comm.new_group(list(range(comm.world_size)), timeout_s=60.0)
    if group.rank != 0:
        ctx.held.append(group)
        group.barrier()
        return None
    try:
        group.barrier()
        work = group.irecv(torch.empty(2), 1)
        start = time.monotonic()
        try:
            work.wait(timeout=deadline_s)
        except CommTimeoutError:
            elapsed = time.monotonic() - start
        else:
            raise AssertionError("wait returned although nothing was sent")
        if elapsed > deadline_s + 1.0:
            raise AssertionError(f"wait raised after {elapsed:.2f} s, deadline {deadline_s} s")
        try:
            work.wait(timeout=0.01)
        except CommTimeoutError:
            return elapsed
        raise AssertionError("a second wait after a timeout must raise the same error")
    finally:
        group.close()


def close_held(ctx) -> None:
    """Close the groups earlier calls left open on this rank."""
    ctx.close_held()
