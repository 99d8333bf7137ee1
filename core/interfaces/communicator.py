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
  receives in that order, of the same kinds (tensor, object, tensor dict).
- Every blocking call, and every ``Work.wait``, ends by the communicator's deadline
  (``timeout_s``, fixed when the group is created): a peer that never joins makes the call
  raise :class:`~shardline.errors.CommTimeoutError`; a dead peer may instead raise
  :class:`~shardline.errors.PeerLostError`. After either, the group may be unusable.
- Combinations outside :attr:`capabilities` raise :class:`~shardline.errors.BackendUnavailableError`
  or are refused earlier, at config validation.

Objects and tensor dicts have default implementations here, built on tensor send/recv and
broadcast (pickle bytes signed with ``object_key`` as a uint8 tensor on ``control_device``);
a backend may override them, but must never unpickle bytes that fail the job-secret check.
Ill-formed objects and tensor-dict metadata raise :class:`~shardline.errors.ProtocolError`.
"""

from __future__ import annotations

import abc
import enum
from collections import deque
from typing import TYPE_CHECKING, Any

from shardline.interfaces.capabilities import Capabilities
from shardline.interfaces.work import Work

if TYPE_CHECKING:
    import torch


class ReduceOp(enum.StrEnum):
    """Element-wise reductions every backend names the same way."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"


class Communicator(abc.ABC):
    """One group of ranks on one backend. See the module docstring for the shared rules."""

    #: Device of the uint8 tensors that carry pickled objects in the default implementations.
    control_device: str = "cpu"
    #: The job's secret, which signs and checks objects (set by whoever creates the world
    #: from its :class:`~shardline.interfaces.communicator_backend.Rendezvous`; a backend's
    #: ``new_group`` passes it on). Empty: object messages are refused.
    object_key: bytes = b""
    #: Largest object message accepted (a size above it is refused as ill-formed).
    max_object_bytes: int = 1 << 30

    def __init__(self) -> None:
        # Deferred irecv_tensor_dict calls, per source rank, completed in posting order.
        self._deferred_receives: dict[int, deque[_DeferredTensorDictReceive]] = {}
        self._completing_deferred = False

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
        arguments; returns None on ranks not in ``ranks``. ``timeout_s`` defaults to this
        group's deadline."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the group's resources. Idempotent. Pending operations may fail."""

    # ---- objects (control plane) ------------------------------------------------------------

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s picklable ``obj``, returned on every rank (``obj`` is ignored
        elsewhere)."""
        import torch

        from shardline.comm import objects

        size = torch.zeros(1, dtype=torch.int64, device=self.control_device)
        payload = None
        if self.rank == src:
            payload = objects.to_tensor(obj, self.object_key, self.control_device)
            size[0] = payload.numel()
        self.broadcast(size, src)
        if payload is None:
            payload = self._object_buffer(size, src)
        self.broadcast(payload, src)
        if self.rank == src:
            return obj
        return objects.from_tensor(payload, self.object_key, f"rank {src}")

    def send_object(self, obj: Any, dst: int) -> None:
        """Send a picklable object to rank ``dst`` (ordered with tensor messages)."""
        for work in self._isend_object(obj, dst):
            work.wait()

    def recv_object(self, src: int) -> Any:
        """The next object sent by rank ``src``."""
        import torch

        from shardline.comm import objects

        self._complete_deferred_receives(src)
        size = self.recv(torch.empty(1, dtype=torch.int64, device=self.control_device), src)
        payload = self.recv(self._object_buffer(size, src), src)
        return objects.from_tensor(payload, self.object_key, f"rank {src}")

    def _object_buffer(self, size: torch.Tensor, src: int) -> torch.Tensor:
        """A buffer for an object message of the announced ``size`` (refused when absurd)."""
        import torch

        from shardline.comm import objects
        from shardline.errors import ProtocolError

        count = int(size[0])
        if not objects.TAG_BYTES <= count <= self.max_object_bytes:
            raise ProtocolError(
                f"control-plane object from rank {src} announces {count} bytes; allowed: "
                f"{objects.TAG_BYTES}..{self.max_object_bytes}",
                rank=self.rank,
            )
        return torch.empty(count, dtype=torch.uint8, device=self.control_device)

    def _isend_object(self, obj: Any, dst: int) -> list[Work]:
        import torch

        from shardline.comm import objects

        payload = objects.to_tensor(obj, self.object_key, self.control_device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.control_device)
        return [self.isend(size, dst), self.isend(payload, dst)]

    # ---- tensor dicts -------------------------------------------------------------------------

    def send_tensor_dict(self, tensor_dict: dict[str, Any], dst: int) -> None:
        """Send a dict of tensors and plain picklable values to ``dst``: metadata first
        (keys, dtypes, shapes, devices, plain values) as an object, then each non-empty tensor.
        Zero-element tensors and non-tensor values travel in the metadata only."""
        self.isend_tensor_dict(tensor_dict, dst).wait()

    def recv_tensor_dict(self, src: int, device: str | None = None) -> dict[str, Any]:
        """The next tensor dict sent by ``src``, with tensors on ``device`` (default: the
        device named in the metadata)."""
        self._complete_deferred_receives(src)
        return _receive_tensor_dict(self, src, device)

    def isend_tensor_dict(self, tensor_dict: dict[str, Any], dst: int) -> Work:
        """Start :meth:`send_tensor_dict`; the Work keeps every tensor alive."""
        from shardline.comm import tensor_dict as td
        from shardline.comm.work import CompositeWork

        metadata, tensors = td.split(tensor_dict)
        works = self._isend_object(metadata, dst)
        works += [self.isend(t, dst) for t in tensors]
        return CompositeWork(works)

    def irecv_tensor_dict(self, src: int, device: str | None = None) -> Work:
        """Start :meth:`recv_tensor_dict`; ``wait()`` returns the dict.

        The default implementation defers the transfer to the first ``wait()`` (or to the next
        receive from ``src``, which completes earlier receives first, keeping message order).
        """
        receive = _DeferredTensorDictReceive(self, src, device)
        self._deferred_receives.setdefault(src, deque()).append(receive)
        return receive

    def _complete_deferred_receives(self, src: int) -> None:
        """Finish every deferred tensor-dict receive from ``src``, oldest first. Backends that
        override ``recv``/``irecv`` call this first so messages keep their order."""
        if self._completing_deferred:
            return
        queue = self._deferred_receives.get(src)
        while queue:
            queue[0].wait()


def _receive_tensor_dict(comm: Communicator, src: int, device: str | None) -> dict[str, Any]:
    from shardline.comm import tensor_dict as td

    metadata = comm.recv_object(src)
    result, buffers = td.allocate(metadata, device, f"rank {src}")
    for buffer in buffers:
        comm.recv(buffer, src)
    return result


class _DeferredTensorDictReceive(Work):
    """A tensor-dict receive that runs at the first wait, after earlier ones from ``src``."""

    def __init__(self, comm: Communicator, src: int, device: str | None) -> None:
        self._comm = comm
        self._src = src
        self._device = device
        self._done = False
        self._result: dict[str, Any] | None = None
        self._error: BaseException | None = None

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            queue = self._comm._deferred_receives[self._src]
            while queue[0] is not self:
                queue[0].wait()
            queue.popleft()
            self._done = True
            self._comm._completing_deferred = True
            try:
                self._result = _receive_tensor_dict(self._comm, self._src, self._device)
            except BaseException as error:
                self._error = error
            finally:
                self._comm._completing_deferred = False
        if self._error is not None:
            raise self._error
        return self._result

    def is_completed(self) -> bool:
        return self._done
