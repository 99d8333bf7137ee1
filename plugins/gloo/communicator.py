"""The gloo communicator: raw ``ProcessGroupGloo`` objects, one per group, no torch globals.

Each group is its own process group over a prefix of the world's rendezvous store, so groups
are created by their members only and several worlds can live in one process.
"""

from __future__ import annotations

import datetime
import ipaddress

import torch
import torch.distributed as dist

from shardline.comm.store import connect_store
from shardline.comm.work import OnceWork
from shardline.errors import CommTimeoutError, CommunicationError, PeerLostError
from shardline.interfaces import Communicator, CommunicatorBackend, ReduceOp, Rendezvous, Work
from shardline_gloo.plugin import GLOO_CAPABILITIES

_TORCH_REDUCE_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}

# Point-to-point messages all use one tag: gloo matches same-tag messages of a pair in order.
_P2P_TAG = 0


class GlooBackend(CommunicatorBackend):
    """Creates gloo worlds. Every group honours the timeout it was created with."""

    name = "gloo"
    capabilities = GLOO_CAPABILITIES

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not dist.is_available() or not dist.is_gloo_available():
            return "this torch build has no gloo support (torch.distributed.is_gloo_available())"
        return None

    def init_world(
        self, rank: int, world_size: int, rendezvous: Rendezvous, timeout_s: float
    ) -> GlooCommunicator:
        store = connect_store(rendezvous.with_prefix("gloo"), timeout_s)
        # One transport device (one I/O thread) serves the world and all its subgroups.
        device = _gloo_device(rendezvous.host)
        return GlooCommunicator.create(store, device, rank, world_size, timeout_s, "w/")


class GlooCommunicator(Communicator):
    """One gloo process group. See :class:`~shardline.interfaces.Communicator` for the contract."""

    def __init__(
        self,
        process_group: dist.ProcessGroupGloo,
        store: dist.Store,
        device: dist.ProcessGroupGloo.Device,
        rank: int,
        world_size: int,
        timeout_s: float,
        prefix: str,
    ) -> None:
        super().__init__()
        self._pg: dist.ProcessGroupGloo | None = process_group
        self._store = store
        self._device = device
        self._rank = rank
        self._world_size = world_size
        self._timeout_s = timeout_s
        self._prefix = prefix
        self._groups_created = 0

    @classmethod
    def create(
        cls,
        store: dist.Store,
        device: dist.ProcessGroupGloo.Device,
        rank: int,
        world_size: int,
        timeout_s: float,
        prefix: str,
    ) -> GlooCommunicator:
        """Join the group stored under ``prefix``; every member calls this."""
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        options._devices = [device]
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, options)
        except (RuntimeError, dist.DistError) as error:
            raise CommTimeoutError(
                f"gloo group {prefix!r}: rank {rank} of {world_size} could not connect to all "
                f"peers within {timeout_s:g} s ({error})",
                op="new_group",
                rank=rank,
            ) from error
        return cls(pg, store, device, rank, world_size, timeout_s, prefix)

    # ---- identity ----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def capabilities(self):
        return GLOO_CAPABILITIES

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    # ---- collectives -------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        result = tensor.clone(memory_format=torch.contiguous_format)
        if result.numel() == 0 or self._world_size == 1:
            return result
        options = dist.AllreduceOptions()
        options.reduceOp = _TORCH_REDUCE_OPS[ReduceOp(op)]
        self._run("all_reduce", lambda pg: pg.allreduce([result], options))
        return result

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        source = tensor.contiguous()
        if source.numel() == 0 or self._world_size == 1:
            return torch.cat([source] * self._world_size, dim=dim)
        outputs = [torch.empty_like(source) for _ in range(self._world_size)]
        self._run("all_gather", lambda pg: pg.allgather([outputs], [source]))
        return torch.cat(outputs, dim=dim)

    def reduce_scatter(
        self, tensor: torch.Tensor, dim: int = 0, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor:
        _check_divisible(tensor, dim, self._world_size)
        chunks = [c.contiguous() for c in tensor.chunk(self._world_size, dim=dim)]
        if tensor.numel() == 0 or self._world_size == 1:
            return chunks[self._rank].clone()
        output = torch.empty_like(chunks[0])
        options = dist.ReduceScatterOptions()
        options.reduceOp = _TORCH_REDUCE_OPS[ReduceOp(op)]
        self._run("reduce_scatter", lambda pg: pg.reduce_scatter([output], [chunks], options))
        return output

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = 0) -> torch.Tensor | None:
        self._check_peer(dst, "gather")
        source = tensor.contiguous()
        is_root = self._rank == dst
        if source.numel() == 0 or self._world_size == 1:
            return torch.cat([source] * self._world_size, dim=dim) if is_root else None
        outputs = [torch.empty_like(source) for _ in range(self._world_size)] if is_root else []
        options = dist.GatherOptions()
        options.rootRank = dst
        self._run("gather", lambda pg: pg.gather([outputs] if is_root else [], [source], options))
        return torch.cat(outputs, dim=dim) if is_root else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._check_peer(src, "broadcast")
        if tensor.numel() == 0 or self._world_size == 1:
            return tensor
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
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
        # gloo's barrier is a collective like any other; an all-reduce of one byte gives the
        # same guarantee and honours the group's timeout.
        self._run("barrier", lambda pg: pg.allreduce([torch.zeros(1, dtype=torch.uint8)]))

    # ---- point to point ------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.isend(tensor, dst).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.irecv(tensor, src).wait()

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        self._check_peer(dst, "send")
        payload = tensor.contiguous()
        if payload.numel() == 0:
            return OnceWork(lambda timeout: None, lambda: True)
        native = self._start("send", lambda pg: pg.send([payload], dst, _P2P_TAG))
        return self._wrap("send", native, result=None, keep_alive=[payload])

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        self._check_peer(src, "recv")
        self._complete_deferred_receives(src)
        if tensor.numel() == 0:
            return OnceWork(lambda timeout: None, lambda: True, result=tensor)
        buffer = (
            tensor
            if tensor.is_contiguous()
            else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        )
        native = self._start("recv", lambda pg: pg.recv([buffer], src, _P2P_TAG))
        copy_back = (lambda: tensor.copy_(buffer)) if buffer is not tensor else None
        return self._wrap("recv", native, result=tensor, keep_alive=[buffer], after=copy_back)

    # ---- groups and lifetime ---------------------------------------------------------------------

    def new_group(
        self, ranks: list[int], timeout_s: float | None = None
    ) -> GlooCommunicator | None:
        ranks = list(ranks)
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < self._world_size for r in ranks):
            raise ValueError(
                f"new_group ranks must be distinct ranks of this group (0..{self._world_size - 1}),"
                f" got {ranks}"
            )
        self._groups_created += 1
        if self._rank not in ranks:
            return None
        return GlooCommunicator.create(
            self._store,
            self._device,
            ranks.index(self._rank),
            len(ranks),
            self._timeout_s if timeout_s is None else timeout_s,
            f"{self._prefix}g{self._groups_created}/",
        )

    def close(self) -> None:
        self._pg = None

    # ---- helpers ---------------------------------------------------------------------------------

    def _start(self, op: str, call):
        if self._pg is None:
            raise CommunicationError(f"{op}: the gloo group was closed", op=op, rank=self._rank)
        try:
            return call(self._pg)
        except RuntimeError as error:
            raise self._translate(op, error) from error

    def _run(self, op: str, call) -> None:
        native = self._start(op, call)
        try:
            native.wait()
        except RuntimeError as error:
            raise self._translate(op, error) from error

    def _wrap(self, op: str, native, result, keep_alive, after=None) -> Work:
        def native_wait(timeout: float | None) -> None:
            seconds = self._timeout_s if timeout is None else timeout
            try:
                native.wait(datetime.timedelta(seconds=seconds))
            except RuntimeError as error:
                raise self._translate(op, error) from error
            if after is not None:
                after()

        return OnceWork(native_wait, native.is_completed, result=result, keep_alive=keep_alive)

    def _translate(self, op: str, error: RuntimeError) -> CommunicationError:
        text = str(error)
        where = f"gloo {op} on rank {self._rank} of {self._world_size} (group {self._prefix!r})"
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
        if not 0 <= peer < self._world_size:
            raise ValueError(f"{op}: rank {peer} is not in this group of {self._world_size}")


def _check_divisible(tensor: torch.Tensor, dim: int, world_size: int) -> None:
    if tensor.dim() == 0 or tensor.shape[dim] % world_size != 0:
        raise ValueError(
            f"reduce_scatter: size {tuple(tensor.shape)} along dim {dim} is not divisible by "
            f"the group size {world_size}"
        )


def _gloo_device(host: str):
    """Loopback rendezvous means a single-host world: bind gloo to loopback too. Otherwise
    let gloo choose (``GLOO_SOCKET_IFNAME`` selects an interface)."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return dist.ProcessGroupGloo.create_device(hostname=host)
    return dist.ProcessGroupGloo.create_default_device()
