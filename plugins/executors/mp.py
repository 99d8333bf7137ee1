"""The ``mp`` executor: one worker process per rank on this host, driven through shared memory.

Every call is broadcast once on a shared-memory ring that all workers read; each worker
answers on its own ring, and only the requested rank replies. Workers are tethered children
(:mod:`shardline.launch.tether`): they end with the driver in every phase, even when it is
killed. The rings and the heartbeats, named ``shardline-<job>-...``, lose their names once
every worker has mapped them (the spawn phase); a driver killed before that leaves them to
Python's resource tracker, and to its workers, which remove them as they go. Liveness: a
monitor thread waits on the workers' process handles, so a death is seen at once and turns
every pending and later call into a :class:`PeerLostError` naming the rank and its exit code.
Deadlines: every start-up phase and every call has one. Shutdown is idempotent and leaves no
process and no shared-memory segment, also after a failure.

Replies: a collector thread resolves the Futures of non-blocking calls; a thread that asks a
call's Future for its result collects the replies itself when no other thread is collecting
and the call's deadline comes before its own timeout (no hand-off between threads: on this
2-core machine that hand-off was a third of an empty step's round trip).

Cores: with ``parallel.cpu_binding`` each worker binds itself to its set before anything
else, and the driver, once every worker is ready, to the set of the last rank that does not
reply (the one whose core it can share without delaying replies); shutdown gives the driver
back the cores it had. Replicas driven side by side leave their driver unbound.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import pickle
import pickletools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from shardline.errors import (
    CommTimeoutError,
    CommunicationError,
    PeerLostError,
    ShardlineError,
    WorkerError,
)
from shardline.interfaces import Executor, ModelRunnerOutput, SchedulerOutput
from shardline.sdk import (
    WATCHDOG_REPORT_S,
    EngineConfig,
    RankProcesses,
    bind_process,
    check_reply_rank,
    failed_in_phase,
    loaded_reply,
    method_name,
    missed_phase,
    pickled_call,
    serve_store,
    wait_until,
)
from shardline_executors.heartbeat import Heartbeats
from shardline_executors.mp_protocol import (
    FIRST_CALL_ID,
    PHASES,
    STEP,
    Failure,
    Phase,
    call_message,
    encode_step,
)
from shardline_executors.mp_worker import worker_main
from shardline_executors.shm_ring import ShmRing

_JOIN_S = 2.0
#: How long the driver polls for replies before it sleeps on the reply doorbell.
_BLOCK_AFTER_S = 0.001
#: A worker whose heartbeat is older than this has stopped running (see heartbeat.py).
FROZEN_S = 1.0
#: The call ring: many small slots (a larger message spans several). A rank that only reads
#: a call may fall behind where it shares a core with the driver; with 16 slots of 1 MiB the
#: driver waited for it every few dozen calls (an empty call's p95 123-152 us, 2 ranks and the
#: driver on 2 cores, cpu_binding=auto), with 128 of 128 KiB (the same 16 MiB) p95 25-28.
_CALL_SLOTS = 128
_CALL_SLOT_BYTES = 1 << 17
#: The constructor's error where a shutdown from another thread ended its start.
_SHUT_DOWN_STARTING = "the mp executor was shut down while its workers started"


class _CollectingFuture(Future):
    """A call's Future whose :meth:`result` and :meth:`exception` first run
    ``collect(future, deadline, timeout)`` in the asking thread (see the module docstring);
    ``deadline`` is the call's."""

    def __init__(
        self, collect: Callable[[Future, float, float | None], None], deadline: float
    ) -> None:
        super().__init__()
        self._collect = collect
        self._deadline = deadline

    def result(self, timeout: float | None = None) -> Any:
        self._collect(self, self._deadline, timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._collect(self, self._deadline, timeout)
        return super().exception(timeout)


@dataclass
class _PendingCall:
    """A call in flight; its Future resolves to the replies of ``ranks`` in order, or, with
    ``single``, to the one reply."""

    call_id: int
    name: str
    ranks: list[int]
    deadline: float
    future: Future
    single: bool = False
    replies: dict[int, Any] = field(default_factory=dict)


class MultiprocExecutor(Executor):
    """Starts ``world_size`` worker processes and drives them (see module docstring)."""

    owns_processes = True
    # Each instance has its own store, rings and spawner; the fork servers are shared under
    # a lock: data-parallel replicas' ranks load the model together.
    starts_concurrently = True

    @classmethod
    def rendezvous_note(cls, config: EngineConfig, environ: Any) -> str:
        return (
            "served by this process on 127.0.0.1 at a port the OS picks (loopback only: "
            "unreachable from other hosts)"
        )

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = config.parallel.world_size
        self._output_rank = config.parallel.layout.output_rank
        # Every rank's cores, checked before anything starts; the driver's, once they run.
        ranks_on_host = self.world_size * config.parallel.worlds_side_by_side
        first_local_rank = (config.parallel.data_parallel_rank or 0) * self.world_size
        all_cores = config.parallel.core_binding.core_sets_for(ranks_on_host)
        rank_cores = [
            None if all_cores is None else all_cores[first_local_rank + rank]
            for rank in range(self.world_size)
        ]
        self._driver_cores = (
            None
            if all_cores is None or config.parallel.worlds_side_by_side > 1
            else rank_cores[self._driver_beside()]
        )
        self._cores_before: frozenset[int] | None = None
        # A call's default deadline lets a worker's own deadline (timeout_s) and its watchdog
        # report pass first, so the error names the rank at fault rather than the rank the
        # driver happened to wait on.
        self._call_timeout_s = config.parallel.timeout_s + WATCHDOG_REPORT_S + 0.25
        self._failure: ShardlineError | None = None
        self._closed = False
        #: Every worker reported "ready" (until then none reads a request to stop).
        self._serving = False
        self._next_call = FIRST_CALL_ID
        self._pending: deque[_PendingCall] = deque()
        self._collect_lock = threading.Lock()
        self._wake_collector = threading.Condition()
        self._ranks = RankProcesses("shardline-worker", role="worker ")
        self._store, rendezvous = serve_store(timeout_s=config.parallel.startup_timeout_s)
        #: Where the ranks meet (a store on loopback), and the job's name, which names the
        #: shared-memory segments this executor creates.
        self.rendezvous_address = (rendezvous.host, rendezvous.port)
        self.job = rendezvous.job
        self._heartbeats = Heartbeats(f"shardline-{self.job}-heartbeats", self.world_size)
        self._calls = ShmRing.create(
            f"shardline-{self.job}-calls",
            readers=self.world_size,
            slots=_CALL_SLOTS,
            slot_bytes=_CALL_SLOT_BYTES,
        )
        doorbells = [multiprocessing.Pipe(duplex=False) for _ in range(self.world_size)]
        self._calls.set_doorbells([send for _, send in doorbells])
        self._replies = [
            ShmRing.create(f"shardline-{self.job}-replies-{rank}", readers=1)
            for rank in range(self.world_size)
        ]
        # One doorbell for all replies: a worker rings it after a put while the driver
        # sleeps on its reply rings; a failure rings it too (the driver stops waiting).
        self._reply_bell, self._ring_reply_bell = multiprocessing.Pipe(duplex=False)
        self._inboxes: list[deque[Any]] = [deque() for _ in range(self.world_size)]
        self._failed_calls: set[int] = set()
        atexit.register(self.shutdown)
        try:
            for rank in range(self.world_size):
                doorbell = doorbells[rank][0]
                self._ranks.start(
                    worker_main,
                    (
                        rank,
                        self.world_size,
                        rank_cores[rank],
                        config,
                        rendezvous,
                        self._calls.handle,
                        self._replies[rank].handle,
                        self._heartbeats.name,
                        doorbell.fileno(),
                        self._ring_reply_bell.fileno(),
                    ),
                    pass_fds=(doorbell.fileno(), self._ring_reply_bell.fileno()),
                )
                doorbell.close()
            self._ranks.watch(lambda rank: self._fail(self._ranks.died(rank, "liveness")))
            self._start_up(config.parallel.startup_timeout_s)
            if self._closed:  # shut down from another thread meanwhile (a start abandoned)
                raise PeerLostError(_SHUT_DOWN_STARTING, op="start-up")
            self._serving = True
            if self._driver_cores is not None:
                self._cores_before = bind_process(self._driver_cores)
            threading.Thread(
                target=self._collect_in_background, name="shardline-replies", daemon=True
            ).start()
        except BaseException as error:
            if self._closed and not isinstance(error, (ShardlineError, KeyboardInterrupt)):
                # Shut down from another thread, which closed the rings under the start.
                raise PeerLostError(_SHUT_DOWN_STARTING, op="start-up") from error
            # A rank that failed or missed its start-up deadline may be stuck: no waiting for
            # workers to exit by themselves.
            self._failure = (
                error
                if isinstance(error, ShardlineError)
                else PeerLostError(f"start-up interrupted: {type(error).__name__}")
            )
            self.shutdown()
            raise

    def _driver_beside(self) -> int:
        """The rank whose cores a bound driver shares: the last that does not reply to
        ``execute_model`` (rank 0 alone)."""
        others = [rank for rank in range(self.world_size) if rank != self._output_rank]
        return others[-1] if others else self._output_rank

    # ---- start-up ------------------------------------------------------------------------------

    def _start_up(self, timeout_s: float) -> None:
        """Every rank reports each phase in order, each phase within ``timeout_s``. A rank
        that dies meanwhile is named with the phase it died in."""
        reported: list[str | None] = [None] * self.world_size
        for phase in PHASES:
            deadline = time.monotonic() + timeout_s
            for rank in range(self.world_size):
                try:
                    message = self._receive(rank, deadline, f"phase {phase!r}")
                except CommTimeoutError:
                    raise missed_phase(
                        rank, phase, timeout_s, "parallel.startup_timeout_s"
                    ) from None
                except PeerLostError as error:
                    dead = self._ranks.first_dead()
                    if dead is None:
                        raise
                    in_phase = self._phase_after(dead, reported[dead])
                    raise PeerLostError(
                        f"{error} in start-up phase {in_phase!r}", op=in_phase, rank=dead
                    ) from error
                if isinstance(message, Failure):
                    raise failed_in_phase(rank, message.phase, message.failure)
                if not (isinstance(message, Phase) and message.name == phase):
                    raise PeerLostError(
                        f"rank {rank} sent {message!r} during phase {phase!r}", rank=rank
                    )
                reported[rank] = phase
            if phase == PHASES[0]:
                self._unlink_segments()

    def _phase_after(self, rank: int, reported: str | None) -> str:
        """The start-up phase a dead ``rank`` was in: the one after the last it reported
        (``reported``: the last this driver has read; later ones may wait in its ring)."""
        ring = self._replies[rank]
        while ring.ready(0):
            try:
                message = pickle.loads(ring.get(0, time.monotonic() + _JOIN_S))
            except Exception:  # a message the death cut short
                break
            if isinstance(message, Phase):
                reported = message.name
        index = 0 if reported is None else PHASES.index(reported) + 1
        return PHASES[min(index, len(PHASES) - 1)]

    def _unlink_segments(self) -> None:
        """Every worker has mapped the rings and the heartbeats (before its first phase): their
        names can go. What is mapped lives on; nothing is left in /dev/shm however the job
        ends, also when all its processes are killed at once (a process group's SIGKILL takes
        Python's resource tracker with it)."""
        for ring in [self._calls, *self._replies]:
            ring.unlink()
        self._heartbeats.unlink()

    # ---- calls ---------------------------------------------------------------------------------

    @property
    def output_rank(self) -> int:
        return self._output_rank

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        non_block: bool = False,
    ) -> list[Any] | Future[list[Any]]:
        check_reply_rank(unique_reply_rank, self.world_size)
        name = method_name(method)
        payload = (
            method if isinstance(method, str) else pickled_call(name, method, cloudpickle.dumps)
        )
        call = self._call(
            name,
            payload,
            tuple(args),
            dict(kwargs or {}),
            timeout,
            unique_reply_rank,
            single=False,
        )
        if non_block:
            self._wake_collector_thread()
            return call.future
        self._collect_through(call)
        return call.future.result()

    def _call(
        self,
        name: str,
        method: str | bytes | int,
        args: Any,
        kwargs: dict[str, Any] | None,
        timeout: float | None,
        reply_rank: int | None,
        single: bool,
    ) -> _PendingCall:
        """Broadcast the call (``call_message``'s fields) and queue it for collection. The
        call goes out first: the workers start on it while the driver makes its Future."""
        self.check_health()
        deadline = time.monotonic() + (self._call_timeout_s if timeout is None else timeout)
        call_id = self._next_call
        message = call_message(call_id, method, args, kwargs, reply_rank)
        data = pickled_call(name, message)  # may raise: then no call is made
        self._next_call += 1
        self._calls.put(data, deadline, self.check_health)
        pending = _PendingCall(
            call_id=call_id,
            name=name,
            ranks=list(range(self.world_size)) if reply_rank is None else [reply_rank],
            deadline=deadline,
            future=_CollectingFuture(self._collect_here, deadline),
            single=single,
        )
        self._pending.append(pending)
        return pending

    def _wake_collector_thread(self) -> None:
        with self._wake_collector:
            self._wake_collector.notify()

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput | None]:
        """A Future of the output rank's reply, returned once the step is broadcast. A
        ``SchedulerOutput`` travels encoded (``mp_protocol``); a subclass of it, pickled whole."""
        if type(scheduler_output) is SchedulerOutput:
            method, args, kwargs = STEP, encode_step(scheduler_output), None
        else:
            method, args, kwargs = "execute_model", (scheduler_output,), {}
        call = self._call(
            "execute_model", method, args, kwargs, None, self._output_rank, single=True
        )
        self._wake_collector_thread()
        return call.future

    def check_health(self) -> None:
        if self._closed:
            raise PeerLostError("the mp executor was shut down", op="check_health")
        if self._failure is not None:
            raise self._failure

    # ---- reply collection ------------------------------------------------------------------------

    def _collect_through(self, target: _PendingCall) -> None:
        """Collect replies of pending calls, oldest first, until ``target`` is resolved."""
        self._collect_until(target.future, blocking=True)

    def _collect_here(self, future: Future, deadline: float, wait_s: float | None) -> None:
        """Collect replies in this thread until ``future`` (a call's, with that ``deadline``)
        resolves, while no other thread collects and the call's deadline comes before this
        thread's (``wait_s`` from now)."""
        if wait_s is not None and deadline > time.monotonic() + wait_s:
            return
        self._collect_until(future, blocking=False)

    def _collect_until(self, future: Future, blocking: bool) -> None:
        """Collect replies of pending calls, oldest first, until ``future`` resolves; not
        ``blocking``: only while no other thread holds the collect lock."""
        while not future.done() and self._collect_lock.acquire(blocking=blocking):
            try:
                if self._pending and not future.done():
                    call = self._pending[0]
                    self._collect_one(call)
                    if call.future is future:  # resolved (a check of done() costs ~0.35 us)
                        return
            finally:
                self._collect_lock.release()

    def _collect_in_background(self) -> None:
        while not self._closed:
            with self._wake_collector:
                self._wake_collector.wait_for(lambda: self._pending or self._closed, timeout=0.5)
            while self._pending and not self._closed:
                with self._collect_lock:
                    if self._pending:
                        self._collect_one(self._pending[0])

    def _collect_one(self, call: _PendingCall) -> None:
        """Resolve the oldest pending call (caller holds the collect lock): on return its
        Future is done, with its replies or a failure (the executor's own, after ``_fail``).

        Each worker answers calls in order, so a message for a later call waits in that
        rank's inbox. A failure from any rank, for this call or an earlier one whose reply
        came from another rank, fails this call.
        """
        try:
            self._gather_replies(call)
            replies = call.replies
            _settle(
                call.future,
                value=replies[call.ranks[0]] if call.single else [replies[r] for r in call.ranks],
            )
        except WorkerError as error:
            self._failed_calls.add(call.call_id)
            if isinstance(error.origin, CommunicationError):
                # A rank's collective failed (a peer stuck or gone): the world is broken.
                self._fail(error)
            else:
                _settle(call.future, error=error)
        except CommTimeoutError:
            self._fail(self._deadline_error(call))
        except ShardlineError as error:
            self._fail(error)
        finally:
            if self._pending and self._pending[0] is call and call.future.done():
                self._pending.popleft()

    def _gather_replies(self, call: _PendingCall) -> None:
        """Take the ranks' messages until every rank asked has replied to ``call``. Raises
        WorkerError for a rank's failure (PeerLostError when a rank died), CommTimeoutError at
        the call's deadline."""
        waiting = [r for r in call.ranks if r not in call.replies]
        while waiting:
            progressed = False
            for rank in range(self.world_size):
                progressed |= self._take_message(rank, call, waiting)
            waiting = [r for r in call.ranks if r not in call.replies]
            if waiting and not progressed:
                self._wait_for_messages(call)

    def _take_message(self, rank: int, call: _PendingCall, waiting: list[int]) -> bool:
        """Consume the oldest message of ``rank`` if it concerns ``call`` or an earlier call:
        a leftover is dropped, a failure raised, a reply of a rank in ``waiting`` stored.
        True when a reply was stored."""
        message = self._peek(rank)
        if message is None:
            return False
        failure = message if isinstance(message, Failure) else None
        call_id = message[0] if failure is None else failure.call_id  # a reply: (id, value)
        if call_id is not None and call_id < call.call_id:
            # Left over from an earlier call that already ended: a reply (also one that did
            # not load), or a failure already reported, is dropped; a failure of a rank that
            # was not asked to reply (its call succeeded elsewhere) fails this call.
            self._inboxes[rank].popleft()
            if (
                failure is not None
                and failure.phase == "call"
                and call_id not in self._failed_calls
            ):
                self._raise_failure(rank, failure, call)
            return False
        if failure is not None:
            self._inboxes[rank].popleft()
            self._raise_failure(rank, failure, call)
        if rank in waiting:
            self._inboxes[rank].popleft()
            call.replies[rank] = message[1]
            return True
        return False

    def _wait_for_messages(self, call: _PendingCall) -> None:
        """Wait until a rank whose inbox is empty sends something; after a short poll, asleep
        on the reply doorbell (a model step's reply wakes the driver at once, not at its next
        poll). Raises CommTimeoutError at the call's deadline, and the executor's failure
        (:meth:`check_health`) once it has one."""
        watched = [self._replies[r] for r in range(self.world_size) if not self._inboxes[r]]

        def ready() -> bool:
            if self._failure is not None:
                return True
            for ring in watched:  # noqa: SIM110 (any() over a generator: ~0.3 us a check more)
                if ring.ready(0):
                    return True
            return False

        def block(seconds: float) -> None:
            for ring in watched:
                ring.set_sleeping(0, True)
            try:
                if not ready() and self._reply_bell.poll(seconds):
                    while self._reply_bell.poll(0):
                        self._reply_bell.recv_bytes()
            finally:
                for ring in watched:
                    ring.set_sleeping(0, False)

        wait_until(
            ready,
            call.deadline,
            f"replies to {call.name!r}",
            self.check_health,
            block,
            block_after_s=_BLOCK_AFTER_S,
        )
        self.check_health()

    def _deadline_error(self, call: _PendingCall) -> CommTimeoutError:
        """The error of a call past its deadline. A rank whose heartbeat stopped is the
        cause (the ranks that did not answer may be waiting on it in a collective)."""
        silent = [r for r in call.ranks if r not in call.replies]
        stopped = {
            rank: quiet
            for rank in range(self.world_size)
            if (quiet := self._heartbeats.silent_for(rank)) is not None and quiet > FROZEN_S
        }
        if stopped:
            names = ", ".join(
                f"rank {rank} (pid {self._ranks.processes[rank].pid}, no heartbeat for "
                f"{quiet:.1f} s)"
                for rank, quiet in stopped.items()
            )
            return CommTimeoutError(
                f"call {call.name!r} passed its deadline: {names} stopped running (stopped with "
                f"SIGSTOP, or frozen); ranks {silent} did not answer. The executor is unusable",
                op=call.name,
                rank=next(iter(stopped)),
            )
        return CommTimeoutError(
            f"call {call.name!r}: ranks {silent} did not answer by the deadline; the "
            "executor is unusable (a worker is stuck)",
            op=call.name,
        )

    def _raise_failure(self, rank: int, message: Failure, call: _PendingCall) -> None:
        """Raise the worker's error, unless a worker died: then the death is the cause (a
        peer's communication error about it can arrive before the liveness thread sees it)."""
        dead = self._ranks.first_dead()
        if dead is not None:
            raise self._ranks.died(dead, call.name)
        raise message.failure.error(rank, f"(in call {call.name!r}) ")

    def _peek(self, rank: int) -> Any:
        """The oldest unconsumed message of ``rank``, or None when there is none yet. A reply
        this process cannot load becomes the failure of its call."""
        inbox = self._inboxes[rank]
        if not inbox and self._replies[rank].ready(0):
            data = self._replies[rank].get(0)
            inbox.append(
                loaded_reply(
                    data, failed=lambda failure: Failure(_call_id_of(data), "reply", failure)
                )
            )
        return inbox[0] if inbox else None

    def _receive(self, rank: int, deadline: float | None, what: str) -> Any:
        data = self._replies[rank].get(0, deadline, self.check_health)
        return pickle.loads(data)

    def _fail(self, error: ShardlineError) -> None:
        """Make ``error`` the executor's state: every pending and later call raises it."""
        if self._failure is None:
            self._failure = error
        for call in list(self._pending):
            _settle(call.future, error=self._failure)
        self._pending.clear()
        with contextlib.suppress(OSError):  # wake a driver asleep on its replies
            self._ring_reply_bell.send_bytes(b"")

    # ---- liveness and shutdown -------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop workers (asked, then killed after a grace period; killed at once after a
        death or a missed deadline, when a stuck worker could not read the request, and while
        they still start, when none reads it before its start ends), remove every segment.
        Idempotent; safe after any failure, and from another thread while the constructor
        still waits for the workers' start (it then fails)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        grace = 0.0
        if self._serving and self._failure is None:
            try:
                stop = call_message(-1, None, (), {}, None)
                self._calls.put(pickle.dumps(stop), time.monotonic() + 1.0)
                grace = _JOIN_S
            except ShardlineError:
                pass
        self._ranks.stop(grace)
        for call in list(self._pending):
            _settle(call.future, error=PeerLostError("the mp executor was shut down"))
        self._pending.clear()
        with self._wake_collector:
            self._wake_collector.notify_all()
        for ring in [self._calls, *self._replies]:
            ring.close()
        self._reply_bell.close()
        self._ring_reply_bell.close()
        self._heartbeats.close()
        if self._cores_before is not None:
            bind_process(self._cores_before)


_INTEGER_OPCODES = ("BININT1", "BININT2", "BININT", "LONG1", "LONG4", "INT", "LONG")


def _call_id_of(reply: bytes) -> int | None:
    """The call id a reply ``(call_id, value)`` begins with, read from its pickle without
    loading the value (None where the pickle does not begin with an integer)."""
    for opcode, argument, _ in pickletools.genops(reply):
        if opcode.name not in ("PROTO", "FRAME"):
            return argument if opcode.name in _INTEGER_OPCODES else None
    return None


def _settle(future: Future, value: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless another thread already did (first outcome wins)."""
    try:  # not contextlib.suppress: this runs once a step, and the context costs ~0.3 us
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except InvalidStateError:
        pass
