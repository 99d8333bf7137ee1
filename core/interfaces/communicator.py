"""How ranks exchange tensors: the Communicator contract.

A Communicator is one group of ranks on one backend (gloo, MPI, NCCL, a vendor's). Every rank
named below is a rank *in this group* (0 .. world_size-1), never a global rank.

General rules every backend keeps (the conformance suite checks each):

- Collectives are called by every rank of the group, in the same order, with tensors of the
  same shape and dtype (except where an operation says otherwise).
- Inputs are never modified unless the operation says "in place"; non-contiguous inputs are
  accepted. Results are new, contiguous tensors on the input's device.
- Tensors with zero elements are accepted everywhere and give zero-element results.
- Messages between one pair of ranks arrive in the order they were sent; the receiver posts
  receives in that order, with buffers of the sent shapes and dtypes.
- Every blocking call, and every ``Work.wait``, ends by the communicator's deadline
  (``timeout_s``, fixed when the group is created): a peer that never joins makes the call
  raise :class:`~shardline.errors.CommTimeoutError`; a dead peer may instead raise
  :class:`~shardline.errors.PeerLostError`. After either, the group may be unusable: a rank
  whose deadline passed may close its connections, so that a rank still waiting in the
  same operation sees :class:`~shardline.errors.PeerLostError` (no later than its own
  deadline) where it would have timed out.
- Combinations outside :attr:`capabilities` raise :class:`~shardline.errors.BackendUnavailableError`
  or are refused earlier, at config validation.

A communicator moves tensors and nothing else. Objects (signed with the job secret) and
tensor dicts are built once on these operations, for every backend, by
:class:`shardline.distributed.control_plane.ControlPlane`; no backend ever sees a pickle.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardline.interfaces.capabilities import Capabilities
from shardline.interfaces.work import Work

if TYPE_CHECKING:
    import torch

    from shardline.errors import ShardlineError


class ReduceOp(enum.StrEnum):
    """Element-wise reductions every backend names the same way."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"


@dataclass(frozen=True)
class NativeAllReduce:
    """A communicator's all-reduce (sum) as a C entry point, for C code that runs many
    operations in one call: ``capsule`` is a PyCapsule named ``shardline.native_all_reduce``
    holding the struct of ``shardline/comm/native_all_reduce.h``; ``calls`` is how many
    all-reduces it makes before it is used up. When the C code reports a failure, raise
    ``failed(message, timed_out)``: ``timed_out`` when its status was
    ``SHARDLINE_NATIVE_TIMED_OUT`` (a deadline passed before the peers answered)."""

    capsule: Any
    calls: int
    failed: Callable[[str, bool], ShardlineError]


class Communicator(abc.ABC):
    """One group of ranks on one backend. See the module docstring for the shared rules."""

    # ---- identity -------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank in the group."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the group."""

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend supports; equal on every rank."""

    @property
    @abc.abstractmethod
    def timeout_s(self) -> float:
        """Deadline in seconds for every blocking call of this group."""

    # ---- collectives ----------------------------------------------------------------------

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """Element-wise reduction over all ranks. Out of place: returns a new tensor equal on
        every rank; ``tensor`` is unchanged."""

    @abc.abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order (size along ``dim``
        multiplied by ``world_size``). Negative ``dim`` counts from the end."""

    @abc.abstractmethod
    def reduce_scatter(
        self, tensor: torch.Tensor, dim: int = 0, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor:
        """Reduce over ranks, then split along ``dim`` into ``world_size`` equal chunks: rank r
        returns chunk r. ``tensor.shape[dim]`` must be divisible by ``world_size``
        (ValueError otherwise)."""

    @abc.abstractmethod
    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = 0) -> torch.Tensor | None:
        """Like :meth:`all_gather`, but only rank ``dst`` gets the result; others get None."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place: afterwards ``tensor`` holds rank ``src``'s values on every rank, and is
        returned."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return only after every rank of the group has entered the barrier."""

    def native_all_reduce(self, like: torch.Tensor, calls: int) -> NativeAllReduce | None:
        """Optional: the next ``calls`` all-reduces (sum) of this group, for tensors of
        ``like``'s shape and dtype (contiguous, on the CPU), made from C without the GIL
        (:class:`NativeAllReduce`); every rank asks for the same calls at the same point of
        its operations, and makes them all before any other operation of this group. None
        (this default) where the backend has no such path: the caller then calls
        :meth:`all_reduce`. Results equal :meth:`all_reduce`'s, bit for bit."""
        return None

    # ---- point to point -------------------------------------------------------------------

    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst``. May return before ``dst`` receives it; the tensor
        may be modified after return."""

    @abc.abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """In place: fill ``tensor`` (shape and dtype as sent) with the next message from
        ``src``; returns it."""

    @abc.abstractmethod
    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        """Start sending; the Work keeps ``tensor`` alive. Do not modify ``tensor`` before the
        Work completes."""

    @abc.abstractmethod
    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        """Start receiving into ``tensor``; ``wait()`` returns the filled tensor."""

    # ---- groups and lifetime ---------------------------------------------------------------

    @abc.abstractmethod
    def new_group(self, ranks: list[int], timeout_s: float | None = None) -> Communicator | None:
        """A communicator over ``ranks`` (ranks of this group; the new group's rank i is
        ``ranks[i]``). Called by *every* rank of this group, in the same order, with the same
        arguments; returns None on ranks not in ``ranks``. ``timeout_s``, the new group's
        deadline, defaults to this group's; joining it waits as long as joining this group's
        world did (``Rendezvous.join_timeout``): members may reach it at different times."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the group's resources. Idempotent. Pending operations may fail."""
