"""A shared-memory all-reduce for the ranks of one host, layered over a base communicator that
does everything else.

Each group maps one segment: a flag area (one 64-byte line per rank and phase), two sets of
small slots (:func:`one_shot_max_bytes` per rank each), and, for large tensors, one slot of
``SLOT_BYTES`` per rank plus a result area of that size. An all-reduce takes the shared path
only when every rank of the group is on this host (host identities exchanged at creation:
host name, kernel boot id and which ``/dev/shm`` the rank sees), the tensor fits a slot and
lives on the CPU; anything else, and every other operation but the barrier, goes to the base
communicator. A shared group's barrier is a flag line per rank too: barrier b raises the
rank's line to b, then waits for every line to reach b.

Every shared all-reduce has a number; a rank announces "arrived at call c"
once its input is in place and waits until every rank has announced c.

- One shot (small tensors): call c uses the small slot set c mod 2. Each rank copies its
  input to its slot, announces, waits for all, then reduces all slots itself, in rank order,
  so every rank gets the same bits. Alternating sets makes overwriting safe without a "done
  reading" round: a rank that announced call c-1 has finished reading the slots of call c-2.
- Two shots (large tensors): after the same copy into the large slots, rank r reduces only
  chunk r (in rank order) into the result area, announces a second phase, and after waiting
  for it copies the whole result. A rank that announced the chunk phase has finished reading
  every large slot, and one that arrived at a later call has copied the result.

Per tensor shape the views and the reduction are prepared once (a small cache), so a small
all-reduce costs a copy, a flag write, a poll and a reduction. The one-shot path runs in C
(``_native.OneShot``: copy in, release-store the flag, spin on acquire loads, reduce into a
new tensor) when the extension is built and ``SHARDLINE_NATIVE`` is not ``0``; for dtypes it
lacks, and otherwise, in Python (numpy or torch), with the same bits. With the extension, a
communicator's ``all_reduce`` is a C router (``_native.AllReduce``) that runs a call whose
dtype, size and op already have a C plan without entering Python, and numbers every call.
Waits follow the group's :class:`~shardline.comm.waiting.Polling` (more ranks than cores:
yield the CPU at once, so 4 ranks on 2 cores stay in tens of µs) and end at the group's
deadline with ``CommTimeoutError``.
The segment is created 0600 and unlinked as soon as every rank has mapped it, so nothing is
left in /dev/shm even when a rank is killed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from shardline.errors import CommTimeoutError, CommunicationError
from shardline.interfaces import (
    Communicator,
    CommunicatorBackend,
    NativeAllReduce,
    ReduceOp,
    Rendezvous,
)
from shardline.registry import Registry
from shardline.sdk import (
    ControlPlane,
    DelegatingCommunicator,
    Polling,
    native_extension,
    wait_until,
)

#: Inputs up to this size take the one-shot path; larger ones are split over the ranks.
ONE_SHOT_MAX_BYTES = 256 << 10
#: The same with two ranks: one shot moves as many bytes between the two cores as two shots
#: (each rank reads the peer's whole input, against half of it and then half the result) in
#: one step instead of two; measured faster up to 4 MiB (at 1 MiB 245-253 µs against
#: 331-351 back to back), two shots past it.
TWO_RANKS_ONE_SHOT_MAX_BYTES = 4 << 20
#: Per-rank slot (and result area) size: the largest tensor taken over from the base.
SLOT_BYTES = 32 << 20
_LINE = 64  # bytes per flag: one cache line, so ranks never write the same line
#: The phases a rank announces: input in place, chunk reduced, barrier entered.
_ARRIVED, _REDUCED, _BARRIER = 0, 1, 2
_PHASES = 3
#: The one-shot path in C (built by pip install where a compiler is), else the Python path.
NATIVE = "shardline_custom_allreduce._native"
_PLANS_KEPT = 64  # prepared tensor shapes kept per group
_YIELD_S = 0.05  # keep the CPU (yielding) this long in a wait before sleeping
_NUMPY_COMBINE = {ReduceOp.SUM: np.add, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}
#: dtypes reduced through numpy (bfloat16, which numpy lacks, takes the torch path).
_NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int32, torch.int64, torch.uint8}
_COMBINE = {
    ReduceOp.SUM: torch.add,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.MIN: torch.minimum,
}


def host_identity() -> str:
    """This host as shared memory sees it: its name, the kernel's boot id (two containers can
    share a name) and the device of ``/dev/shm`` (two containers on one kernel can each have
    their own)."""
    boot_id = shm_device = ""
    with contextlib.suppress(OSError):
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    with contextlib.suppress(OSError):
        shm_device = str(os.stat("/dev/shm").st_dev)
    return f"{socket.gethostname()}/{boot_id}/{shm_device}"


class CustomAllReduceBackend(CommunicatorBackend):
    """Builds the base communicator's world (``base``, a registered name, provided by the
    plugin whose entry point is ``base_plugin``) and layers the shared-memory all-reduce over
    it. Only that plugin is loaded for it: no other installed plugin's code runs. Subclass and
    set both for another base. Its capabilities are the base's (the registry copies them)."""

    name = "custom_ar"
    base = "gloo"
    base_plugin = "gloo"

    @classmethod
    def all_reduce_route(cls, hosts: int) -> str:
        if hosts == 1:
            return f"shared memory ({cls.name}; {cls.base} beyond a slot)"
        return f"{cls.base} ({cls.name}'s base: the group crosses hosts)"

    def init_world(
        self, rank: int, world_size: int, rendezvous: Rendezvous, timeout_s: float
    ) -> CustomAllReduceCommunicator:
        registry = Registry.load(allow=(self.base_plugin,))
        base_backend = registry.get("communicator", self.base).load_available()()
        base = base_backend.init_world(rank, world_size, rendezvous.with_prefix("base"), timeout_s)
        # A shared world has all its ranks on this host.
        world = _World(
            Polling.for_ranks_on_host(world_size),
            rendezvous.job,
            rendezvous.secret,
            native_extension(NATIVE, os.environ),
        )
        return CustomAllReduceCommunicator.create(base, world)


@dataclass(frozen=True)
class _World:
    """What every group of one custom_ar world shares: how waits use the CPU, the job's name
    (segments are ``shardline-<job>-ar-...``), its secret (host identities travel as
    signed objects) and the C one-shot path (None: Python only)."""

    polling: Polling
    job: str
    secret: bytes
    native: ModuleType | None


class CustomAllReduceCommunicator(DelegatingCommunicator):
    """The shared-memory all-reduce over the base communicator ``inner``, which does
    everything else (see the module docstring)."""

    def __init__(self, base: Communicator, segment: _Segment | None, world: _World) -> None:
        super().__init__(base)
        self._segment = segment
        self._world = world
        self._polling = world.polling
        self._rank = base.rank
        self._barriers = 0
        self._plans: dict[tuple, Any] = {}
        native = world.native if segment is not None else None
        #: The C router of all_reduce (None: no extension, or nothing shared to route to).
        self._routed = None
        if native is not None:
            self._routed = native.AllReduce(
                general=self.all_reduce,
                finish=self._finish_one_shot,
                tensor_type=torch.Tensor,
                default_op=ReduceOp.SUM,
            )
            # An instance attribute over the method: a routed call reaches C with no Python
            # frame on the way; the method (general) runs what the router does not.
            self.all_reduce = self._routed
        #: Numbers every shared all-reduce: the C router's and the Python paths' calls alike.
        self._calls: Any = self._routed or _CallNumbers()

    @classmethod
    def create(cls, base: Communicator, world: _World) -> CustomAllReduceCommunicator:
        """Collective over ``base``: exchange host identities; on one host, map a segment."""
        control = ControlPlane(base, world.secret)
        hosts = [control.broadcast_object(host_identity(), src) for src in range(base.world_size)]
        if base.world_size == 1 or len(set(hosts)) > 1:
            return cls(base, None, world)
        segment, announced = None, None
        if base.rank == 0:  # create (full size) before anyone may map it
            try:
                name = f"shardline-{world.job}-ar-{secrets.token_hex(8)}"
                segment = _Segment.open(name, 0, base.world_size, create=True)
                announced = segment.name
            except OSError as error:
                announced = error
        announced = control.broadcast_object(announced, 0)
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
        return cls(base, segment, world)

    @property
    def shared(self) -> bool:
        """Whether all-reduces can take the shared-memory path (one host, world > 1)."""
        return self._segment is not None

    @property
    def native(self) -> bool:
        """Whether the one-shot path runs in C (for the dtypes it has)."""
        return self._segment is not None and self._world.native is not None

    # ---- the shared-memory all-reduce -----------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """Where the C extension runs, the instance's ``all_reduce`` is its router
        (``_native.AllReduce``), which runs a prepared C one-shot itself and calls this method
        for everything else (a first call of a size, another path, an input to make
        contiguous); this method routes the C one-shots it prepares there for the next call."""
        segment = self._segment
        if segment is None or not tensor.is_cpu:
            return self.inner.all_reduce(tensor, op)
        plan = self._plan_for(tensor, op)
        if plan is _BASE:
            return self.inner.all_reduce(tensor, op)
        call = self._calls.take()
        if plan is _TWO_SHOT:
            return self._two_shot(tensor, ReduceOp(op), call)
        if type(plan) is not _OneShot:  # the C one-shot path: input contiguous, then one call
            if type(tensor) is torch.Tensor:
                self._routed.route(tensor.dtype, op, tensor.nbytes, plan)
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
            result = plan.run(tensor, call)
            return self._finish_one_shot(plan, tensor, call) if result is None else result
        parity = call & 1
        plan.inputs[parity][self._rank].copy_(tensor.detach() if tensor.requires_grad else tensor)
        segment.announce(_ARRIVED, self._rank, call)
        if not segment.all_at(_ARRIVED, call):
            self._wait_all(_ARRIVED, call, "all_reduce")
        return plan.reduce(parity)

    def barrier(self) -> None:
        """On one host, in the segment: rank r raises its barrier flag to the barrier's number
        and waits (spin, yield, then sleep) until every flag has reached it; the base's
        barrier otherwise. Ranks leave within microseconds of the last one's arrival, and
        without blocking in the kernel, so what follows runs on a warm CPU."""
        segment = self._segment
        if segment is None:
            self.inner.barrier()
            return
        self._barriers = number = self._barriers + 1
        segment.announce(_BARRIER, self._rank, number)
        if not segment.all_at(_BARRIER, number):
            self._wait_all(_BARRIER, number, "barrier")

    def native_all_reduce(self, like: torch.Tensor, calls: int) -> NativeAllReduce | None:
        """The next ``calls`` one-shot sums of tensors like ``like`` as a C entry point
        (``OneShot.native_run``: the same copy, flags, reduction and waits, in place), where
        they take the C one-shot path; otherwise (another host in the group, too large, a
        dtype the C path lacks, no extension) the base's, if it has one."""
        native = self._world.native
        if self._segment is None or native is None or not like.is_cpu:
            return self.inner.native_all_reduce(like, calls)
        plan = self._plan_for(like, ReduceOp.SUM)
        if not isinstance(plan, native.OneShot):
            return self.inner.native_all_reduce(like, calls)
        first = self._calls.take(calls)
        polling = self._polling
        capsule = plan.native_run(
            first,
            calls,
            self.timeout_s,
            _YIELD_S,
            polling.share_cpu,
            polling.first_sleep_s,
            polling.max_sleep_s,
        )
        return NativeAllReduce(capsule, calls, self._native_failure)

    def _finish_one_shot(self, plan: Any, tensor: torch.Tensor, call: int) -> torch.Tensor:
        """A C one-shot ``call`` whose peers did not arrive within the spin: wait for them
        (``wait_until``'s phases and deadline), then reduce into a new tensor."""
        self._wait_all(_ARRIVED, call, "all_reduce", lambda: plan.arrived(call))
        return plan.finish(tensor, call)

    def _native_failure(self, message: str, timed_out: bool) -> CommunicationError:
        """The error of a failed native run (the C code's ``message``): a deadline passed
        (ranks named), or the run was called more often than it was made for."""
        kind = CommTimeoutError if timed_out else CommunicationError
        return kind(message, op="all_reduce", rank=self.rank)

    def _plan_for(self, tensor: torch.Tensor, op: ReduceOp) -> Any:
        """The prepared :meth:`_plan` for tensors like ``tensor`` (kept per shape, dtype and
        op)."""
        key = (tensor.shape, tensor.dtype, op)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(tensor, ReduceOp(op))
            if len(self._plans) >= _PLANS_KEPT:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _plan(self, tensor: torch.Tensor, op: ReduceOp) -> Any:
        """How an all-reduce of tensors like ``tensor`` runs: on the base, in two shots, or
        in one shot, in C (a ``_native.OneShot``) or with views prepared for its shape."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or nbytes > SLOT_BYTES:
            return _BASE
        segment = self._segment
        if nbytes > segment.small_bytes:
            return _TWO_SHOT
        count, shape = tensor.numel(), tuple(tensor.shape)
        native, dtype_name = self._world.native, str(tensor.dtype).removeprefix("torch.")
        if native is not None and dtype_name in native.DTYPES:
            return native.OneShot(
                memory=segment.memory,
                flags_offset=segment.flag_offset(_ARRIVED, 0),
                flag_stride=_LINE,
                slots_offset=segment.small_offset(0, 0),
                slot_bytes=segment.small_bytes,
                world_size=self.world_size,
                rank=self._rank,
                dtype=dtype_name,
                op=op.value,
                nbytes=nbytes,
                spin_checks=self._polling.spin_checks,
                empty_like=torch.empty_like,
            )
        peers = range(self.world_size)
        inputs = tuple(
            tuple(
                segment.small_tensor(parity, peer, tensor.dtype, count).view(shape)
                for peer in peers
            )
            for parity in (0, 1)
        )
        if tensor.dtype not in _NUMPY_DTYPES:
            return _OneShot(inputs, inputs, _COMBINE[op], numpy=False, shape=shape)
        # Reduced through numpy views of the same slots: a fraction of torch's per-operation
        # cost for small tensors. A 0-d tensor is reduced as one element (numpy would return
        # a scalar).
        arrays = tuple(
            tuple(view.numpy().reshape(shape or (1,)) for view in views) for views in inputs
        )
        return _OneShot(inputs, arrays, _NUMPY_COMBINE[op], numpy=True, shape=shape)

    def _two_shot(self, tensor: torch.Tensor, op: ReduceOp, call: int) -> torch.Tensor:
        """Rank r reduces chunk r of everyone's input into the result area; all copy it. A
        rank puts in its large slot only the chunks the others reduce, and reads its own
        chunk from ``tensor``: the same values, in the same rank order, one copy fewer."""
        segment, n, rank = self._segment, self.world_size, self._rank
        combine, dtype, count = _COMBINE[op], tensor.dtype, tensor.numel()
        flat = tensor.detach().reshape(-1)
        start, stop = _chunk(count, n, rank)
        slot = segment.large(rank, dtype, count)
        slot[:start].copy_(flat[:start])
        slot[stop:].copy_(flat[stop:])
        segment.announce(_ARRIVED, rank, call)
        self._wait_all(_ARRIVED, call, "all_reduce")
        if stop > start:
            part = segment.result(dtype, count)[start:stop]
            pieces = [
                flat[start:stop] if peer == rank else segment.large(peer, dtype, count)[start:stop]
                for peer in range(n)
            ]
            combine(pieces[0], pieces[1], out=part)
            for piece in pieces[2:]:
                combine(part, piece, out=part)
        segment.announce(_REDUCED, rank, call)
        self._wait_all(_REDUCED, call, "all_reduce")
        return segment.result(dtype, count).clone().reshape(tensor.shape)

    def _wait_all(
        self, phase: int, call: int, op: str, ready: Callable[[], bool] | None = None
    ) -> None:
        """Wait until every rank announced ``phase`` of ``call`` (spin, yield, then sleep);
        ``ready`` checks it (default: the segment's flags read from Python)."""
        segment = self._segment
        try:
            wait_until(
                ready or (lambda: segment.all_at(phase, call)),
                time.monotonic() + self.timeout_s,
                f"custom_ar {op}",
                yield_for_s=_YIELD_S,
                polling=self._polling,
            )
        except CommTimeoutError as error:
            raise CommTimeoutError(
                f"custom_ar {op} on rank {self.rank} of {self.world_size}: ranks "
                f"{segment.ranks_before(phase, call)} did not arrive within {self.timeout_s:g} s",
                op=op,
                rank=self.rank,
            ) from error

    # ---- groups and lifetime ---------------------------------------------------------------

    def wrap_group(self, group: Communicator, ranks: list[int]) -> CustomAllReduceCommunicator:
        return CustomAllReduceCommunicator.create(group, self._world)

    def close(self) -> None:
        segment, self._segment = self._segment, None
        self._plans.clear()  # C plans hold the mapping until they go
        if self._routed is not None:
            self._routed.clear()
        if segment is not None:
            segment.close()
        self.inner.close()


class _CallNumbers:
    """Numbers a group's shared all-reduces where the C router is not built."""

    def __init__(self) -> None:
        self._last = 0

    def take(self, count: int = 1) -> int:
        """The first of the next ``count`` call numbers (numbers start at 1)."""
        first = self._last + 1
        self._last += count
        return first


def one_shot_max_bytes(world_size: int) -> int:
    """The largest all-reduce that goes in one shot in a group of ``world_size`` ranks (the
    size of each small slot)."""
    return TWO_RANKS_ONE_SHOT_MAX_BYTES if world_size == 2 else ONE_SHOT_MAX_BYTES


def _chunk(count: int, parts: int, index: int) -> tuple[int, int]:
    """Element range of part ``index`` when ``count`` elements are split in ``parts``."""
    size = -(-count // parts)
    return min(count, index * size), min(count, (index + 1) * size)


_BASE, _TWO_SHOT = "base", "two shots"


@dataclass(frozen=True)
class _OneShot:
    """A prepared one-shot all-reduce for one shape: per slot set (call parity) each rank's
    slot as a tensor of that shape (``inputs``, written by its rank) and as what the
    combining function (numpy ufunc or torch) reads (``reduced``)."""

    inputs: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]
    reduced: tuple[tuple[Any, ...], tuple[Any, ...]]
    combine: Callable
    numpy: bool
    shape: tuple[int, ...]

    def reduce(self, parity: int) -> torch.Tensor:
        """The slots of set ``parity`` combined in rank order into a new tensor (the same
        bits on every rank)."""
        slots, combine = self.reduced[parity], self.combine
        total = combine(slots[0], slots[1])
        for slot in slots[2:]:
            combine(total, slot, out=total)
        if not self.numpy:
            return total
        result = torch.from_numpy(total)
        return result if self.shape else result.reshape(())


class _Segment:
    """The mapped shared memory of one group: flags, two sets of small slots, the large
    slots and a result area."""

    def __init__(self, path: Path, fd: int, memory: mmap.mmap, world_size: int) -> None:
        self._path = path
        self._fd = fd
        self._memory = memory
        self._world_size = world_size
        self._flags = memoryview(memory)[: _flag_bytes(world_size)].cast("q")
        self._stride = _LINE // 8
        self._indices = [
            [(phase * world_size + rank) * self._stride for rank in range(world_size)]
            for phase in range(_PHASES)
        ]
        self._small = _flag_bytes(world_size)
        self._small_bytes = one_shot_max_bytes(world_size)
        self._large = self._small + 2 * world_size * self._small_bytes
        self._large_views: dict[torch.dtype, list[torch.Tensor]] = {}

    @classmethod
    def open(cls, name: str, rank: int, world_size: int, create: bool) -> _Segment:
        path = Path("/dev/shm") / name
        size = _segment_bytes(world_size)
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

    @property
    def small_bytes(self) -> int:
        """Bytes of each small slot: the largest all-reduce that goes in one shot."""
        return self._small_bytes

    @property
    def memory(self) -> mmap.mmap:
        return self._memory

    def flag_offset(self, phase: int, rank: int) -> int:
        """Byte offset of ``rank``'s flag for ``phase``."""
        return self._indices[phase][rank] * 8

    def small_offset(self, parity: int, rank: int) -> int:
        """Byte offset of ``rank``'s small slot of set ``parity``."""
        return self._small + (parity * self._world_size + rank) * self._small_bytes

    def unlink(self) -> None:
        self._path.unlink(missing_ok=True)

    def small_tensor(self, parity: int, rank: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        """``rank``'s small slot of set ``parity``: its first ``count`` elements."""
        offset = self.small_offset(parity, rank)
        return torch.frombuffer(self._memory, dtype=dtype, count=count, offset=offset)

    def large(self, index: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        """The first ``count`` elements of large slot ``index`` (``world_size``: the result
        area); the full views are made once per dtype."""
        views = self._large_views.get(dtype)
        if views is None:
            size = torch.empty(0, dtype=dtype).element_size()
            views = self._large_views[dtype] = [
                torch.frombuffer(
                    self._memory,
                    dtype=dtype,
                    count=SLOT_BYTES // size,
                    offset=self._large + index * SLOT_BYTES,
                )
                for index in range(self._world_size + 1)
            ]
        return views[index][:count]

    def result(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        return self.large(self._world_size, dtype, count)

    def announce(self, phase: int, rank: int, call: int) -> None:
        self._flags[self._indices[phase][rank]] = call

    def all_at(self, phase: int, call: int) -> bool:
        flags = self._flags
        for index in self._indices[phase]:  # noqa: SIM110 (a loop: no generator per poll)
            if flags[index] < call:
                return False
        return True

    def ranks_before(self, phase: int, call: int) -> list[int]:
        flags = self._flags
        return [rank for rank, index in enumerate(self._indices[phase]) if flags[index] < call]

    def close(self) -> None:
        self._large_views.clear()
        self._flags.release()
        with contextlib.suppress(BufferError):
            self._memory.close()
        os.close(self._fd)


def _flag_bytes(world_size: int) -> int:
    return _PHASES * world_size * _LINE


def _segment_bytes(world_size: int) -> int:
    """Flags, two small slot sets, the large slots and the result area (sparse on disk)."""
    return (
        _flag_bytes(world_size)
        + 2 * world_size * one_shot_max_bytes(world_size)
        + (world_size + 1) * SLOT_BYTES
    )


class CustomAllReduceOverMpi(CustomAllReduceBackend):
    """The shared-memory all-reduce over the MPI communicator (ranks started by mpiexec)."""

    name = "custom_ar_mpi"
    base = "mpi"
    base_plugin = "mpi"
