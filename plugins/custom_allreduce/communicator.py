"""A shared-memory all-reduce for the ranks of one host, layered over a base communicator that
does everything else.

Each group maps one segment: a flag area (one 64-byte line per rank and phase) and, per rank,
an input slot of ``slot_bytes``, plus a result area of the same size. An all-reduce takes the
shared path only when every rank of the group is on this host (host identities exchanged at
creation: host name and kernel boot id), the tensor fits a slot and lives on the CPU; anything
else, and every other operation, goes to the base communicator.

- One shot (small tensors): each rank copies its input to its slot, announces it, waits for
  all, then reduces all slots itself, in rank order, so every rank gets the same bits.
- Two shots (large tensors): after the same copy, rank r reduces only chunk r (in rank order)
  into the result area; after a second announcement every rank copies the whole result.

Every rank then announces that it is done reading, and the next call waits for that before
overwriting its slot. Waits spin, then yield (several ranks per core stay in tens of µs),
and end at the group's deadline with ``CommTimeoutError``. The segment is created 0600 and
unlinked as soon as every rank has mapped it, so nothing is left in /dev/shm even when a rank
is killed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from shardline_custom_allreduce.plugin import CUSTOM_AR_CAPABILITIES, CUSTOM_AR_MPI_CAPABILITIES

from shardline.comm.waiting import wait_until
from shardline.errors import CommTimeoutError, CommunicationError
from shardline.interfaces import Communicator, CommunicatorBackend, ReduceOp, Rendezvous, Work
from shardline.registry import Registry

#: Inputs up to this size take the one-shot path; larger ones are split over the ranks.
ONE_SHOT_MAX_BYTES = 256 << 10
#: Per-rank slot (and result area) size: the largest tensor taken over from the base.
SLOT_BYTES = 32 << 20
_LINE = 64  # bytes per flag: one cache line, so ranks never write the same line
_PHASES = 3  # inputs written, chunks reduced, done reading
_YIELD_S = 0.05  # keep the CPU (yielding) this long in a wait before sleeping
_NUMPY_COMBINE = {ReduceOp.SUM: np.add, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}
#: dtypes numpy has (bfloat16 is not among them and takes the torch path).
_NUMPY_DTYPES = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
}
_COMBINE = {
    ReduceOp.SUM: torch.add,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.MIN: torch.minimum,
}


def host_identity() -> str:
    """This host: its name and the kernel's boot id (two containers can share a name)."""
    boot_id = ""
    with contextlib.suppress(OSError):
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}/{boot_id}"


class CustomAllReduceBackend(CommunicatorBackend):
    """Builds the base communicator's world (``base``, a registered name, provided by the
    plugin whose entry point is ``base_plugin``) and layers the shared-memory all-reduce over
    it. Only that plugin is loaded for it: no other installed plugin's code runs. Subclass and
    set both for another base."""

    name = "custom_ar"
    capabilities = CUSTOM_AR_CAPABILITIES
    base = "gloo"
    base_plugin = "gloo"

    def init_world(
        self, rank: int, world_size: int, rendezvous: Rendezvous, timeout_s: float
    ) -> CustomAllReduceCommunicator:
        registry = Registry.load(allow=(self.base_plugin,))
        base_backend = registry.get("communicator", self.base).load_available()()
        base = base_backend.init_world(rank, world_size, rendezvous.with_prefix("base"), timeout_s)
        base.object_key = rendezvous.secret  # host identities travel as objects
        return CustomAllReduceCommunicator.create(base)


class CustomAllReduceCommunicator(Communicator):
    """The shared-memory all-reduce over ``base`` (see the module docstring)."""

    def __init__(self, base: Communicator, segment: _Segment | None) -> None:
        super().__init__()
        self.base = base
        self._segment = segment
        self._calls = 0

    @classmethod
    def create(cls, base: Communicator) -> CustomAllReduceCommunicator:
        """Collective over ``base``: exchange host identities; on one host, map a segment."""
        hosts = [base.broadcast_object(host_identity(), src) for src in range(base.world_size)]
        if base.world_size == 1 or len(set(hosts)) > 1:
            return cls(base, None)
        segment, announced = None, None
        if base.rank == 0:  # create (full size) before anyone may map it
            try:
                segment = _Segment.open(
                    f"shardline-ar-{secrets.token_hex(8)}", 0, base.world_size, create=True
                )
                announced = segment.name
            except OSError as error:
                announced = error
        announced = base.broadcast_object(announced, 0)
        if isinstance(announced, BaseException):
            raise CommunicationError(
                f"custom_ar: rank 0 could not create the shared segment: {announced}",
                op="new_group",
                rank=base.rank,
            )
        if segment is None:
            segment = _Segment.open(announced, base.rank, base.world_size, create=False)
        try:
            base.barrier()  # everyone has mapped it: the name can go
        finally:
            segment.unlink()
        return cls(base, segment)

    # ---- identity ----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.base.rank

    @property
    def world_size(self) -> int:
        return self.base.world_size

    @property
    def capabilities(self):
        return CUSTOM_AR_CAPABILITIES

    @property
    def timeout_s(self) -> float:
        return self.base.timeout_s

    @property
    def object_key(self) -> bytes:
        return self.base.object_key

    @object_key.setter
    def object_key(self, key: bytes) -> None:
        self.base.object_key = key

    @property
    def shared(self) -> bool:
        """Whether all-reduces can take the shared-memory path (one host, world > 1)."""
        return self._segment is not None

    # ---- the shared-memory all-reduce -----------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        if (
            self._segment is None
            or tensor.device.type != "cpu"
            or nbytes == 0
            or nbytes > SLOT_BYTES
        ):
            return self.base.all_reduce(tensor, op)
        segment, n, rank = self._segment, self.world_size, self.rank
        self._calls += 1
        call = self._calls
        # The previous call's readers must be done before this rank's slot is overwritten.
        self._wait_all(2, call - 1, "all_reduce")
        count = tensor.numel()
        one_shot = nbytes <= ONE_SHOT_MAX_BYTES
        numpy_dtype = _NUMPY_DTYPES.get(tensor.dtype) if one_shot else None
        if numpy_dtype is not None:
            # Small tensors: numpy views of the slots cost a fraction of torch's per-op time.
            source = tensor.reshape(-1).numpy()
            slots = [segment.array(peer, numpy_dtype, count) for peer in range(n)]
            np.copyto(slots[rank], source)
            segment.announce(0, rank, call)
            self._wait_all(0, call, "all_reduce")
            combine_array = _NUMPY_COMBINE[ReduceOp(op)]
            total = slots[0].copy()
            for peer in range(1, n):
                combine_array(total, slots[peer], out=total)
            result = torch.from_numpy(total)
        else:
            combine = _COMBINE[ReduceOp(op)]
            segment.slot(rank, tensor.dtype, count).copy_(tensor.reshape(-1))
            segment.announce(0, rank, call)
            self._wait_all(0, call, "all_reduce")
            if one_shot:
                result = segment.slot(0, tensor.dtype, count).clone()
                for peer in range(1, n):
                    combine(result, segment.slot(peer, tensor.dtype, count), out=result)
            else:
                start, stop = _chunk(count, n, rank)
                if stop > start:
                    part = segment.result(tensor.dtype, count)[start:stop]
                    part.copy_(segment.slot(0, tensor.dtype, count)[start:stop])
                    for peer in range(1, n):
                        combine(part, segment.slot(peer, tensor.dtype, count)[start:stop], out=part)
                segment.announce(1, rank, call)
                self._wait_all(1, call, "all_reduce")
                result = segment.result(tensor.dtype, count).clone()
        segment.announce(2, rank, call)
        return result.reshape(tensor.shape)

    def _wait_all(self, phase: int, call: int, op: str) -> None:
        """Wait until every rank announced ``phase`` of ``call`` (spin, yield, then sleep)."""
        segment = self._segment
        try:
            wait_until(
                lambda: segment.all_at(phase, call),
                time.monotonic() + self.timeout_s,
                f"custom_ar {op}",
                yield_for_s=_YIELD_S,
            )
        except CommTimeoutError as error:
            raise CommTimeoutError(
                f"custom_ar {op} on rank {self.rank} of {self.world_size}: ranks "
                f"{segment.ranks_before(phase, call)} did not arrive within {self.timeout_s:g} s",
                op=op,
                rank=self.rank,
            ) from error

    # ---- everything else: the base communicator ---------------------------------------------

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self.base.all_gather(tensor, dim)

    def reduce_scatter(
        self, tensor: torch.Tensor, dim: int = 0, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor:
        return self.base.reduce_scatter(tensor, dim, op)

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = 0) -> torch.Tensor | None:
        return self.base.gather(tensor, dst, dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self.base.broadcast(tensor, src)

    def barrier(self) -> None:
        self.base.barrier()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.base.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.base.recv(tensor, src)

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        return self.base.isend(tensor, dst)

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        return self.base.irecv(tensor, src)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.base.broadcast_object(obj, src)

    def send_object(self, obj: Any, dst: int) -> None:
        self.base.send_object(obj, dst)

    def recv_object(self, src: int) -> Any:
        return self.base.recv_object(src)

    def send_tensor_dict(self, tensor_dict: dict[str, Any], dst: int) -> None:
        self.base.send_tensor_dict(tensor_dict, dst)

    def recv_tensor_dict(self, src: int, device: str | None = None) -> dict[str, Any]:
        return self.base.recv_tensor_dict(src, device)

    def isend_tensor_dict(self, tensor_dict: dict[str, Any], dst: int) -> Work:
        return self.base.isend_tensor_dict(tensor_dict, dst)

    def irecv_tensor_dict(self, src: int, device: str | None = None) -> Work:
        return self.base.irecv_tensor_dict(src, device)

    def new_group(
        self, ranks: list[int], timeout_s: float | None = None
    ) -> CustomAllReduceCommunicator | None:
        group = self.base.new_group(ranks, timeout_s)
        return None if group is None else CustomAllReduceCommunicator.create(group)

    def close(self) -> None:
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.close()
        self.base.close()


def _chunk(count: int, parts: int, index: int) -> tuple[int, int]:
    """Element range of part ``index`` when ``count`` elements are split in ``parts``."""
    size = -(-count // parts)
    return min(count, index * size), min(count, (index + 1) * size)


class _Segment:
    """The mapped shared memory of one group: flags, ``world_size`` slots, a result area."""

    def __init__(self, path: Path, fd: int, memory: mmap.mmap, world_size: int) -> None:
        self._path = path
        self._fd = fd
        self._memory = memory
        self._world_size = world_size
        self._flags = memoryview(memory)[: _PHASES * world_size * _LINE].cast("q")
        self._data = _PHASES * world_size * _LINE
        self._stride = _LINE // 8
        self._views: dict[torch.dtype, list[torch.Tensor]] = {}
        self._arrays: dict[Any, list[np.ndarray]] = {}

    @classmethod
    def open(cls, name: str, rank: int, world_size: int, create: bool) -> _Segment:
        path = Path("/dev/shm") / name
        size = _PHASES * world_size * _LINE + (world_size + 1) * SLOT_BYTES
        if create:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)  # sparse: pages appear only when written
            except OSError:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
        else:
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as error:
                raise CommunicationError(
                    f"custom_ar: rank {rank} cannot open the group's segment {path}: {error}",
                    op="new_group",
                    rank=rank,
                ) from error
        return cls(path, fd, mmap.mmap(fd, size), world_size)

    @property
    def name(self) -> str:
        return self._path.name

    def unlink(self) -> None:
        self._path.unlink(missing_ok=True)

    def slot(self, rank: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        """The first ``count`` elements of ``rank``'s slot (views made once per dtype)."""
        views = self._views.get(dtype)
        if views is None:
            size = torch.empty(0, dtype=dtype).element_size()
            views = self._views[dtype] = [
                torch.frombuffer(
                    self._memory,
                    dtype=dtype,
                    count=SLOT_BYTES // size,
                    offset=self._data + index * SLOT_BYTES,
                )
                for index in range(self._world_size + 1)
            ]
        return views[rank][:count]

    def array(self, rank: int, dtype: Any, count: int) -> np.ndarray:
        """The first ``count`` elements of ``rank``'s slot as numpy (views made once)."""
        views = self._arrays.get(dtype)
        if views is None:
            size = np.dtype(dtype).itemsize
            views = self._arrays[dtype] = [
                np.frombuffer(
                    self._memory,
                    dtype=dtype,
                    count=SLOT_BYTES // size,
                    offset=self._data + index * SLOT_BYTES,
                )
                for index in range(self._world_size)
            ]
        return views[rank][:count]

    def result(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        return self.slot(self._world_size, dtype, count)

    def announce(self, phase: int, rank: int, call: int) -> None:
        self._flags[(phase * self._world_size + rank) * self._stride] = call

    def all_at(self, phase: int, call: int) -> bool:
        flags, base, stride = self._flags, phase * self._world_size * self._stride, self._stride
        return all(flags[base + r * stride] >= call for r in range(self._world_size))

    def ranks_before(self, phase: int, call: int) -> list[int]:
        base = phase * self._world_size * self._stride
        return [r for r in range(self._world_size) if self._flags[base + r * self._stride] < call]

    def close(self) -> None:
        self._views.clear()
        self._arrays.clear()
        self._flags.release()
        with contextlib.suppress(BufferError):
            self._memory.close()
        os.close(self._fd)


class CustomAllReduceOverMpi(CustomAllReduceBackend):
    """The shared-memory all-reduce over the MPI communicator (ranks started by mpiexec)."""

    name = "custom_ar_mpi"
    capabilities = CUSTOM_AR_MPI_CAPABILITIES
    base = "mpi"
    base_plugin = "mpi"
