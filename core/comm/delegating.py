"""The one way to wrap a communicator: hand every operation to the wrapped one, and let a
subclass override only what it does itself (the collective watchdog fingerprints each
operation; the shared-memory all-reduce takes some all-reduces)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from shardline.interfaces import Capabilities, Communicator, NativeAllReduce, ReduceOp, Work

if TYPE_CHECKING:  # annotations only: wrapping a communicator imports no torch
    import torch


class DelegatingCommunicator(Communicator):
    """``inner``'s identity, capabilities, deadline and operations, unchanged.

    A subgroup is the inner communicator's subgroup wrapped by :meth:`wrap_group`, so that a
    wrapper stays on every group made from it; :meth:`close` closes ``inner``.
    """

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner

    @abc.abstractmethod
    def wrap_group(self, group: Communicator, ranks: list[int]) -> Communicator:
        """The wrapper of ``inner``'s new subgroup over ``ranks`` (ranks of this group)."""

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @property
    def timeout_s(self) -> float:
        return self.inner.timeout_s

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        return self.inner.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self.inner.all_gather(tensor, dim)

    def reduce_scatter(
        self, tensor: torch.Tensor, dim: int = 0, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor:
        return self.inner.reduce_scatter(tensor, dim, op)

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = 0) -> torch.Tensor | None:
        return self.inner.gather(tensor, dst, dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self.inner.broadcast(tensor, src)

    def barrier(self) -> None:
        self.inner.barrier()

    def native_all_reduce(self, like: torch.Tensor, calls: int) -> NativeAllReduce | None:
        return self.inner.native_all_reduce(like, calls)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.inner.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.inner.recv(tensor, src)

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        return self.inner.isend(tensor, dst)

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        return self.inner.irecv(tensor, src)

    def new_group(self, ranks: list[int], timeout_s: float | None = None) -> Communicator | None:
        group = self.inner.new_group(ranks, timeout_s)
        return None if group is None else self.wrap_group(group, ranks)

    def close(self) -> None:
        self.inner.close()
