"""The control plane, built once on any communicator's tensor operations: picklable objects
(signed with the job secret, which is held here and nowhere else) and tensor dicts (metadata
as an object, tensors as tensors, optionally over another communicator, with the TP-assisted
pipeline transfer of the reference design).

An object travels as two messages: its size (one int64), then its sealed bytes
(:func:`shardline.comm.objects.seal`) as uint8, on :attr:`ControlPlane.device`. Bytes that
fail the job-secret check, or announce an absurd size, raise
:class:`~shardline.errors.ProtocolError` and never reach ``pickle``. A tensor dict is its
metadata object followed by its non-empty tensors, in key order
(:mod:`shardline.comm.tensor_dict`); receiving one takes the metadata at once and the tensors
asynchronously, so a receive posted before later ones keeps its place in the pair's order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shardline.comm import objects
from shardline.comm import tensor_dict as td
from shardline.comm.work import CompositeWork
from shardline.errors import ProtocolError
from shardline.interfaces import Communicator, Work

#: Largest object message accepted (a larger announced size is refused as ill-formed).
MAX_OBJECT_BYTES = 1 << 30


class Gatherer(Protocol):
    """What the TP-assisted transfer needs of a tensor-parallel group."""

    @property
    def world_size(self) -> int: ...

    @property
    def rank_in_group(self) -> int: ...

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


@dataclass(frozen=True)
class AllGatherSplit:
    """The TP-assisted pipeline transfer: each rank of ``group`` (its TP group, size t) sends
    and receives only its 1/t of every tensor whose element count divides by t (and that
    ``only`` does not mark False); the receiving stage all-gathers the parts. Sender and
    receiver must use matching splits."""

    group: Gatherer
    only: Mapping[str, bool] | None = None

    def part(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``tensor`` (flattened), or ``tensor`` when it is not split."""
        size = self.group.world_size
        if size == 1 or (self.only is not None and not self.only.get(key, True)):
            return tensor
        if tensor.numel() % size:
            return tensor
        return tensor.reshape(size, -1)[self.group.rank_in_group]


class ControlPlane:
    """Objects and tensor dicts over ``comm`` (see the module docstring).

    ``secret`` is the job's (every rank's must be equal); ``device`` is where object bytes
    travel (``cpu``, or the device a backend that moves only device tensors needs).
    """

    def __init__(self, comm: Communicator, secret: bytes, device: str = "cpu") -> None:
        self.comm = comm
        self._secret = secret
        self.device = device

    # ---- objects ----------------------------------------------------------------------------

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s picklable ``obj``, returned on every rank (ignored elsewhere)."""
        comm = self.comm
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        payload = None
        if comm.rank == src:
            payload = objects.to_tensor(obj, self._secret, self.device)
            size[0] = payload.numel()
        comm.broadcast(size, src)
        if payload is None:
            payload = self._buffer(size, src)
        comm.broadcast(payload, src)
        if comm.rank == src:
            return obj
        return objects.from_tensor(payload, self._secret, f"rank {src}")

    def isend_object(self, obj: Any, dst: int) -> Work:
        """Start sending a picklable object to rank ``dst`` (ordered with tensor messages)."""
        return self.isend_object_to_each(obj, [dst])

    def isend_object_to_each(self, obj: Any, destinations: Sequence[int]) -> Work:
        """Start sending one picklable object to every rank of ``destinations``, serialized
        once (each receives it with :meth:`recv_object`)."""
        payload = objects.to_tensor(obj, self._secret, self.device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        return CompositeWork(
            [work for dst in destinations
             for work in (self.comm.isend(size, dst), self.comm.isend(payload, dst))]
        )  # fmt: skip

    def send_object(self, obj: Any, dst: int) -> None:
        self.isend_object(obj, dst).wait()

    def recv_object(self, src: int) -> Any:
        """The next object rank ``src`` sent."""
        size = self.comm.recv(torch.empty(1, dtype=torch.int64, device=self.device), src)
        payload = self.comm.recv(self._buffer(size, src), src)
        return objects.from_tensor(payload, self._secret, f"rank {src}")

    def _buffer(self, size: torch.Tensor, src: int) -> torch.Tensor:
        """A buffer for an object of the announced ``size`` (refused when absurd)."""
        count = int(size[0])
        if not objects.TAG_BYTES <= count <= MAX_OBJECT_BYTES:
            raise ProtocolError(
                f"control-plane object from rank {src} announces {count} bytes; allowed: "
                f"{objects.TAG_BYTES}..{MAX_OBJECT_BYTES}",
                rank=self.comm.rank,
            )
        return torch.empty(count, dtype=torch.uint8, device=self.device)

    # ---- tensor dicts -------------------------------------------------------------------------

    def isend_tensor_dict(
        self,
        tensor_dict: dict[str, Any],
        dst: int,
        data: Communicator | None = None,
        split: AllGatherSplit | None = None,
    ) -> Work:
        """Start sending ``tensor_dict`` to ``dst``: its metadata as an object here, its
        non-empty tensors over ``data`` (default: this plane's communicator), each cut by
        ``split`` when given. The Work keeps every tensor alive until it completes. Zero-element
        tensors and plain values travel in the metadata only."""
        data = data or self.comm
        metadata, tensors = td.split(tensor_dict)
        works = [self.isend_object(metadata, dst)]
        for key, tensor in zip(_tensor_keys(metadata), tensors, strict=True):
            part = split.part(key, tensor) if split is not None else tensor
            works.append(data.isend(part, dst))
        return CompositeWork(works)

    def irecv_tensor_dict(
        self,
        src: int,
        data: Communicator | None = None,
        split: AllGatherSplit | None = None,
        device: str | None = None,
    ) -> Work:
        """Receive a tensor dict's metadata from ``src`` now and start receiving its tensors
        (onto ``device``, default: the one each tensor was sent from); ``wait()`` returns the
        dict, after ``split``'s all-gather. Raises ProtocolError for ill-formed metadata."""
        data = data or self.comm
        metadata = self.recv_object(src)
        result, buffers = td.allocate(metadata, device, f"rank {src}")
        works, parts = [], []
        for key, buffer in zip(_tensor_keys(metadata), buffers, strict=True):
            part = split.part(key, buffer) if split is not None else buffer
            if part is not buffer:
                part = torch.empty_like(part)
            works.append(data.irecv(part, src))
            parts.append((buffer, part))
        return _TensorDictReceive(works, result, parts, split)

    def send_tensor_dict(self, tensor_dict: dict[str, Any], dst: int, **options: Any) -> None:
        """Blocking :meth:`isend_tensor_dict`."""
        self.isend_tensor_dict(tensor_dict, dst, **options).wait()

    def recv_tensor_dict(self, src: int, **options: Any) -> dict[str, Any]:
        """Blocking :meth:`irecv_tensor_dict`."""
        return self.irecv_tensor_dict(src, **options).wait()


def _tensor_keys(metadata: td.Metadata) -> list[str]:
    """Keys of the tensors that travel as messages (the non-empty ones), in wire order."""
    return [key for key, value in metadata if isinstance(value, td.TensorMeta) and value.numel]


class _TensorDictReceive(Work):
    """Waits the tensor receives, then all-gathers split tensors into their full buffers."""

    def __init__(self, works, result, parts, split: AllGatherSplit | None) -> None:
        self._inner = CompositeWork(works)
        self._result = result
        self._parts = parts
        self._split = split
        self._assembled = False

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        self._inner.wait(timeout)
        if not self._assembled:
            self._assembled = True
            for buffer, part in self._parts:
                if part is not buffer:
                    gathered = self._split.group.all_gather(part, dim=0)
                    buffer.copy_(gathered.reshape(buffer.shape))
        return self._result

    def is_completed(self) -> bool:
        return self._assembled
