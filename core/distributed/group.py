"""GroupCoordinator: one group of ranks over two channels.

The *data plane* (a Communicator on the tensors' device: gloo, MPI, NCCL, ...) carries tensor
collectives and point-to-point tensors. The *control plane* (a
:class:`~shardline.distributed.control_plane.ControlPlane` over a CPU Communicator) carries
objects, tensor-dict metadata and barriers, so control traffic never queues behind or mixes
with device tensors. Both communicators span the same ranks in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardline.distributed.control_plane import AllGatherSplit, ControlPlane
from shardline.interfaces import Communicator, NativeAllReduce, ReduceOp, Work


class GroupCoordinator:
    """A group of ranks: ``ranks`` are global ranks, in group order.

    Rank arguments of every method (``dst``, ``src``) are ranks *in the group*;
    :attr:`next_rank` and :attr:`prev_rank` are in-group ranks too.
    """

    def __init__(
        self,
        name: str,
        ranks: Sequence[int],
        data: Communicator,
        control: Communicator,
        secret: bytes,
    ) -> None:
        if data.world_size != len(ranks) or control.world_size != len(ranks):
            raise ValueError(
                f"group {name!r}: {len(ranks)} ranks but communicators of sizes "
                f"{data.world_size} (data) and {control.world_size} (control)"
            )
        if data.rank != control.rank:
            raise ValueError(f"group {name!r}: data and control ranks differ")
        self.name = name
        self.ranks = list(ranks)
        self.data = data
        self.control = control
        self.control_plane = ControlPlane(control, secret)

    # ---- position -------------------------------------------------------------------------

    @property
    def rank_in_group(self) -> int:
        return self.data.rank

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """In-group rank after this one (wrapping)."""
        return (self.rank_in_group + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        """In-group rank before this one (wrapping)."""
        return (self.rank_in_group - 1) % self.world_size

    # ---- data plane -------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """Sum (or max/min) over the group. With one rank, returns ``tensor`` itself."""
        if self.world_size == 1:
            return tensor
        return self.data.all_reduce(tensor, op)

    def native_all_reduce(self, like: torch.Tensor, calls: int) -> NativeAllReduce | None:
        """The data communicator's next ``calls`` sums as a C entry point
        (:meth:`~shardline.interfaces.Communicator.native_all_reduce`); None with one rank
        (nothing to reduce) or where the communicator has none."""
        if self.world_size == 1:
            return None
        return self.data.native_all_reduce(like, calls)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's tensor along ``dim``. With one rank, returns ``tensor``."""
        if self.world_size == 1:
            return tensor
        return self.data.all_gather(tensor, dim)

    def reduce_scatter(
        self, tensor: torch.Tensor, dim: int = -1, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        return self.data.reduce_scatter(tensor, dim, op)

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        if self.world_size == 1:
            return tensor
        return self.data.gather(tensor, dst, dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        return self.data.broadcast(tensor, src)

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send to ``dst`` (default: :attr:`next_rank`)."""
        self.data.send(tensor, self.next_rank if dst is None else dst)

    def recv(self, tensor: torch.Tensor, src: int | None = None) -> torch.Tensor:
        """Receive into ``tensor`` from ``src`` (default: :attr:`prev_rank`)."""
        return self.data.recv(tensor, self.prev_rank if src is None else src)

    # ---- control plane ----------------------------------------------------------------------

    def barrier(self) -> None:
        self.control.barrier()

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        return self.control_plane.broadcast_object(obj, src)

    def send_object(self, obj: Any, dst: int | None = None) -> None:
        self.control_plane.send_object(obj, self.next_rank if dst is None else dst)

    def recv_object(self, src: int | None = None) -> Any:
        return self.control_plane.recv_object(self.prev_rank if src is None else src)

    # ---- tensor dicts across pipeline stages ---------------------------------------------------

    def isend_tensor_dict(
        self,
        tensor_dict: dict[str, Any],
        dst: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: Mapping[str, bool] | None = None,
    ) -> Work:
        """Start sending ``tensor_dict`` to ``dst`` (default: next rank): metadata on the
        control plane, tensors on the data plane. Wait the returned handle before the tensors
        may be reused.

        TP-assisted transfer: with ``all_gather_group`` (this rank's TP group), tensors are
        sent as this rank's slice and all-gathered by the receiving stage (see
        :class:`~shardline.distributed.control_plane.AllGatherSplit`); both stages must pass
        matching arguments.
        """
        return self.control_plane.isend_tensor_dict(
            tensor_dict,
            self.next_rank if dst is None else dst,
            self.data,
            _split(all_gather_group, all_gather_tensors),
        )

    def irecv_tensor_dict(
        self,
        src: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: Mapping[str, bool] | None = None,
        device: str | None = None,
    ) -> Work:
        """Start receiving a tensor dict from ``src`` (default: previous rank). The metadata
        is received now; tensors arrive asynchronously. ``wait()`` returns the dict, after the
        TP all-gather of sliced tensors (see :meth:`isend_tensor_dict`)."""
        return self.control_plane.irecv_tensor_dict(
            self.prev_rank if src is None else src,
            self.data,
            _split(all_gather_group, all_gather_tensors),
            device,
        )

    def send_tensor_dict(
        self, tensor_dict: dict[str, Any], dst: int | None = None, **kwargs
    ) -> None:
        """Blocking :meth:`isend_tensor_dict`."""
        self.isend_tensor_dict(tensor_dict, dst, **kwargs).wait()

    def recv_tensor_dict(self, src: int | None = None, **kwargs) -> dict[str, Any]:
        """Blocking :meth:`irecv_tensor_dict`."""
        return self.irecv_tensor_dict(src, **kwargs).wait()

    def close(self) -> None:
        self.data.close()
        if self.control is not self.data:
            self.control.close()


def _split(
    group: GroupCoordinator | None, only: Mapping[str, bool] | None
) -> AllGatherSplit | None:
    return None if group is None or group.world_size == 1 else AllGatherSplit(group, only)
