"""A Communicator over one raw ``torch.distributed`` process group (gloo, NCCL, ...), with no
torch globals: each group is its own process group over a prefix of the world's rendezvous
store, so groups are created by their members only and several worlds live in one process.

Subclasses say how to build a process group (:meth:`ProcessGroupCommunicator.new_process_group`)
and may stage tensors through a device (:meth:`stage`; identity by default).
"""

from __future__ import annotations

import abc
import datetime
from typing import Any

import torch
import torch.distributed as dist

from shardline.comm.arguments import check_peer, group_ranks
from shardline.comm.store import announce_arrival, never_arrived
from shardline.comm.work import OnceWork
from shardline.errors import CommTimeoutError, CommunicationError, PeerLostError
from shardline.interfaces import Capabilities, Communicator, ReduceOp, Work

_TORCH_REDUCE_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}

# Point-to-point messages all use one tag: a pair's same-tag messages match in order.
_P2P_TAG = 0


class ProcessGroupCommunicator(Communicator):
    """One process group. See :class:`~shardline.interfaces.Communicator` for the contract.

    ``transport`` is what the subclass shares between a world and its subgroups (gloo: the
    transport device; NCCL: the CUDA device).
    """

    #: The backend's name in messages, and its declared capabilities.
    backend_name: str = ""
    backend_capabilities: Capabilities = Capabilities()

    def __init__(
        self,
        process_group: Any,
        store: dist.Store,
        transport: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        prefix: str,
        join_timeout_s: float,
    ) -> None:
        super().__init__()
        self._pg: Any = process_group
        self._store = store
        self._transport = transport
        self._rank = rank
        self._world_size = world_size
        self._timeout_s = timeout_s
        self._prefix = prefix
        self._join_timeout_s = join_timeout_s
        self._groups_created = 0

    @classmethod
    def create(
        cls,
        store: dist.Store,
        transport: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        prefix: str,
        join_timeout_s: float,
    ) -> ProcessGroupCommunicator:
        """Join the group stored under ``prefix``; every member calls this. Joining waits
        ``join_timeout_s`` for the members (a timeout names those that never arrived); the
        group's operations then end by ``timeout_s``."""
        group_store = dist.PrefixStore(prefix, store)
        announce_arrival(group_store, rank)
        try:
            pg = cls.new_process_group(group_store, transport, rank, world_size, join_timeout_s)
        except (RuntimeError, dist.DistError) as error:
            missing = never_arrived(group_store, world_size)
            who = f"ranks {missing} never arrived" if missing else "every rank arrived"
            raise CommTimeoutError(
                f"{cls.backend_name} group {prefix!r}: rank {rank} of {world_size} could not "
                f"connect to all peers within {join_timeout_s:g} s: {who} ({error})",
                op="new_group",
                rank=rank,
            ) from error
        pg.set_timeout(datetime.timedelta(seconds=timeout_s))
        return cls(pg, store, transport, rank, world_size, timeout_s, prefix, join_timeout_s)

    @classmethod
    @abc.abstractmethod
    def new_process_group(
        cls, store: dist.Store, transport: Any, rank: int, world_size: int, timeout_s: float
    ) -> Any:
        """A new process group of this backend over ``store``, made within ``timeout_s`` (the
        join deadline: :meth:`create` sets the operations' own after)."""

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` where the backend can use it (a copy on its device, or itself)."""
        return tensor

    def unstage(self, result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``result`` back on the device of the caller's tensor ``like``."""
        return result if result.device == like.device else result.to(like.device)

    # ---- identity ----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def capabilities(self):
        return self.backend_capabilities

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    # ---- collectives -------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        if tensor.numel() == 0 or self._world_size == 1:
            return tensor.clone(memory_format=torch.contiguous_format)
        staged = self.stage(tensor)
        result = staged.clone(memory_format=torch.contiguous_format)
        options = dist.AllreduceOptions()
        options.reduceOp = _TORCH_REDUCE_OPS[ReduceOp(op)]
        self._run("all_reduce", lambda pg: pg.allreduce([result], options))
        return self.unstage(result, tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if tensor.numel() == 0 or self._world_size == 1:
            return torch.cat([tensor.contiguous()] * self._world_size, dim=dim)
        source = self.stage(tensor).contiguous()
        outputs = [torch.empty_like(source) for _ in range(self._world_size)]
        self._run("all_gather", lambda pg: pg.allgather([outputs], [source]))
        return self.unstage(torch.cat(outputs, dim=dim), tensor)

    def reduce_scatter(
        self, tensor: torch.Tensor, dim: int = 0, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor:
        _check_divisible(tensor, dim, self._world_size)
        if tensor.numel() == 0 or self._world_size == 1:
            return tensor.chunk(self._world_size, dim=dim)[self._rank].contiguous().clone()
        staged = self.stage(tensor)
        chunks = [c.contiguous() for c in staged.chunk(self._world_size, dim=dim)]
        output = torch.empty_like(chunks[0])
        options = dist.ReduceScatterOptions()
        options.reduceOp = _TORCH_REDUCE_OPS[ReduceOp(op)]
        self._run("reduce_scatter", lambda pg: pg.reduce_scatter([output], [chunks], options))
        return self.unstage(output, tensor)

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = 0) -> torch.Tensor | None:
        self._check_peer(dst, "gather")
        is_root = self._rank == dst
        if tensor.numel() == 0 or self._world_size == 1:
            return torch.cat([tensor.contiguous()] * self._world_size, dim=dim) if is_root else None
        source = self.stage(tensor).contiguous()
        outputs = [torch.empty_like(source) for _ in range(self._world_size)] if is_root else []
        options = dist.GatherOptions()
        options.rootRank = dst
        self._run("gather", lambda pg: pg.gather([outputs] if is_root else [], [source], options))
        return self.unstage(torch.cat(outputs, dim=dim), tensor) if is_root else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._check_peer(src, "broadcast")
        if tensor.numel() == 0 or self._world_size == 1:
            return tensor
        buffer = self.stage(tensor)
        buffer = buffer if buffer.is_contiguous() else buffer.contiguous()
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        self._run("broadcast", lambda pg: pg.broadcast([buffer], options))
        if buffer is not tensor:
            tensor.copy_(buffer)
        return tensor

    def barrier(self) -> None:
        if self._world_size == 1:
            return
        # An all-reduce of one byte is a barrier that honours the group's timeout (a
        # process group's own barrier may not).
        token = self.stage(torch.zeros(1, dtype=torch.uint8))
        self._run("barrier", lambda pg: pg.allreduce([token]))

    # ---- point to point ------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.isend(tensor, dst).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.irecv(tensor, src).wait()

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        self._check_peer(dst, "send")
        if tensor.numel() == 0:
            return OnceWork(lambda timeout: None, lambda: True)
        payload = self.stage(tensor).contiguous()
        native = self._start("send", lambda pg: pg.send([payload], dst, _P2P_TAG), dst)
        return self._wrap("send", native, result=None, keep_alive=[payload], peer=dst)

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        self._check_peer(src, "recv")
        if tensor.numel() == 0:
            return OnceWork(lambda timeout: None, lambda: True, result=tensor)
        buffer = self.stage(tensor)
        if not buffer.is_contiguous():
            buffer = torch.empty_like(buffer, memory_format=torch.contiguous_format)
        native = self._start("recv", lambda pg: pg.recv([buffer], src, _P2P_TAG), src)
        copy_back = (lambda: tensor.copy_(buffer)) if buffer is not tensor else None
        return self._wrap(
            "recv", native, result=tensor, keep_alive=[buffer], after=copy_back, peer=src
        )

    # ---- groups and lifetime ---------------------------------------------------------------------

    def new_group(
        self, ranks: list[int], timeout_s: float | None = None
    ) -> ProcessGroupCommunicator | None:
        ranks = group_ranks(ranks, self._world_size)
        self._groups_created += 1
        if self._rank not in ranks:
            return None
        return type(self).create(
            self._store,
            self._transport,
            ranks.index(self._rank),
            len(ranks),
            self._timeout_s if timeout_s is None else timeout_s,
            f"{self._prefix}g{self._groups_created}/",
            self._join_timeout_s,
        )

    def close(self) -> None:
        self._pg = None

    # ---- helpers ---------------------------------------------------------------------------------

    def _start(self, op: str, call, peer: int | None = None):
        if self._pg is None:
            raise CommunicationError(
                f"{op}: the {self.backend_name} group was closed", op=op, rank=self._rank
            )
        try:
            return call(self._pg)
        except RuntimeError as error:
            raise self._translate(op, error, peer) from error

    def _run(self, op: str, call) -> None:
        native = self._start(op, call)
        try:
            native.wait()
        except RuntimeError as error:
            raise self._translate(op, error) from error

    def _wrap(self, op: str, native, result, keep_alive, after=None, peer=None) -> Work:
        def native_wait(timeout: float | None) -> None:
            seconds = self._timeout_s if timeout is None else timeout
            try:
                native.wait(datetime.timedelta(seconds=seconds))
            except RuntimeError as error:
                raise self._translate(op, error, peer) from error
            if after is not None:
                after()

        return OnceWork(native_wait, native.is_completed, result=result, keep_alive=keep_alive)

    def _translate(
        self, op: str, error: RuntimeError, peer: int | None = None
    ) -> CommunicationError:
        """``error`` of native operation ``op`` as a Shardline error naming this rank, its
        group and, for a point-to-point operation, the ``peer`` (a rank of the group)."""
        text = str(error)
        between = "" if peer is None else f" {'from' if op == 'recv' else 'to'} rank {peer}"
        where = (
            f"{self.backend_name} {op}{between} on rank {self._rank} of {self._world_size} "
            f"(group {self._prefix!r})"
        )
        if "Timed out" in text or "timeout" in text.lower():
            return CommTimeoutError(
                f"{where}: no answer from peers within the deadline ({text})",
                op=op,
                rank=self._rank,
            )
        if "Connection closed" in text or "Connection reset" in text or "Broken pipe" in text:
            return PeerLostError(f"{where}: a peer went away ({text})", op=op, rank=self._rank)
        return CommunicationError(f"{where}: {text}", op=op, rank=self._rank)

    def _check_peer(self, peer: int, op: str) -> None:
        check_peer(peer, self._world_size, op)


def _check_divisible(tensor: torch.Tensor, dim: int, world_size: int) -> None:
    if tensor.dim() == 0 or tensor.shape[dim] % world_size != 0:
        raise ValueError(
            f"reduce_scatter: size {tuple(tensor.shape)} along dim {dim} is not divisible by "
            f"the group size {world_size}"
        )
