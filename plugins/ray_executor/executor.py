"""The ``ray`` executor: one Ray actor per rank, in a placement group on a Ray cluster.

Start-up: the driver connects to Ray (the cluster ``RAY_ADDRESS`` names, or a Ray instance it
starts on this host and stops at shutdown: :mod:`.session`); reserves one placement-group
bundle per node (``parallel.nnodes`` nodes, strictly spread) and numbers the ranks node by
node, the driver's node first, so that tensor-parallel groups stay inside a node
(:mod:`.placement`); serves the rendezvous store (on loopback when every rank is on its node,
else on its node's address); and creates the actors, each of which starts its rank's process
(:mod:`.actor`, :mod:`.rank`). The rendezvous and the job's secret reach each rank as its
actor's creation argument (Ray's channel, never a socket of Shardline's). Start-up phases
("spawn", "distributed init", "model load", "ready") each have
``parallel.startup_timeout_s``; a failure names the phase and the rank.

Calls: each call is one task per rank, carrying the same pickled message; a rank's tasks run
in call order. A collector thread settles the calls oldest first (futures resolve in call
order): with every rank's answer, with the first rank's failure (``WorkerError``), or, at the
call's deadline, with ``CommTimeoutError`` naming the ranks that did not answer.

Liveness: each actor's watch task returns when the rank's process ends (with its exit code),
and fails when the actor itself dies; a thread waits on them, so a death fails every pending
and later call with ``PeerLostError`` naming the rank at once. After a death, a rank's
failed collective or a missed deadline the executor is unusable, and shutdown kills at once.
Shutdown is idempotent: it stops the ranks, kills the actors, removes the placement group,
and ends the Ray connection if it was the executor's to end.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
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
from shardline.interfaces import Executor, Host, ModelRunnerOutput, SchedulerOutput
from shardline.sdk import (
    WATCHDOG_REPORT_S,
    EngineConfig,
    check_reply_rank,
    failed_in_phase,
    first_reply,
    method_name,
    missed_phase,
    pickled_call,
    serve_store,
)
from shardline_ray import cluster
from shardline_ray.placement import RankPlace
from shardline_ray.protocol import PHASES, Call, Done, Failure, Phase, Reply

#: How long the ranks get to leave by themselves at a clean shutdown.
_JOIN_S = 2.0
#: How often waiting threads look whether the executor was shut down.
_POLL_S = 0.5
#: How long a rank's communication failure waits for news of a rank's death, which is then
#: the cause (a peer's error about a death can arrive first).
_DEATH_NEWS_S = 0.1


@dataclass
class _PendingCall:
    name: str
    reply_ranks: list[int]
    deadline: float
    refs: list[Any]
    future: Future = field(default_factory=Future)


class RayExecutor(Executor):
    """Drives one Ray actor per rank (see the module docstring)."""

    owns_processes = True
    spans_hosts = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("ray") is None:
            return "the ray package is not installed (pip install 'shardline[ray]')"
        return None

    @classmethod
    def rendezvous_note(cls, config: EngineConfig, environ: Any) -> str:
        return (
            "served by this process: on 127.0.0.1 when Ray places every rank on this node, "
            "else on the address Ray knows this node by (the other nodes must reach it)"
        )

    @classmethod
    def prepare_hosts(
        cls, hosts: Sequence[Host], environ: Mapping[str, str]
    ) -> contextlib.AbstractContextManager[dict[str, str]]:
        """A Ray cluster on ``hosts``: the head in the first, a worker node in each other
        (:func:`shardline_ray.cluster.cluster_on`); yields the driver's environment
        (``RAY_ADDRESS`` and the cluster's token)."""
        return cluster.cluster_on(hosts, environ)

    def __init__(self, config: EngineConfig) -> None:
        # ray is an optional dependency: imported when an executor starts.
        from shardline_ray.world import RayRanks

        self.config = config
        self.world_size = config.parallel.world_size
        self._output_rank = config.parallel.layout.output_rank
        # As mp: a rank's own diagnosis of a stuck collective arrives before the call's end.
        self._call_timeout_s = config.parallel.timeout_s + WATCHDOG_REPORT_S + 0.25
        self._failure: ShardlineError | None = None
        self._closed = False
        self._pending: deque[_PendingCall] = deque()
        self._changed = threading.Condition()
        self._ranks: RayRanks | None = None
        startup_s = config.parallel.startup_timeout_s
        try:
            self._ranks = RayRanks(os.environ, self.world_size)
            # After connecting: exit handlers run last first, so this one runs before Ray's.
            atexit.register(self.shutdown)
            self._ranks.place(config.parallel.nnodes, startup_s)
            host = self._ranks.rendezvous_host()
            self._store, rendezvous = serve_store(host=host, timeout_s=startup_s)
            #: Where the ranks meet, and the job's name.
            self.rendezvous_address = (rendezvous.host, rendezvous.port)
            self.job = rendezvous.job
            self._ranks.start(config, rendezvous)
            self._start_up(startup_s)
            for target, name in ((self._collect, "replies"), (self._watch, "liveness")):
                threading.Thread(target=target, name=f"shardline-ray-{name}", daemon=True).start()
        except BaseException as error:
            self._failure = (
                error
                if isinstance(error, ShardlineError)
                else PeerLostError(f"start-up interrupted: {type(error).__name__}: {error}")
            )
            self.shutdown()
            raise

    @property
    def places(self) -> list[RankPlace]:
        """Where each rank runs (:class:`~shardline_ray.placement.RankPlace`, by rank)."""
        return list(self._ranks.places) if self._ranks is not None else []

    @property
    def ray_connection(self) -> str:
        """What this process is connected to (a cluster, or a Ray instance on this host)."""
        return self._ranks.connection.description if self._ranks is not None else ""

    # ---- start-up ------------------------------------------------------------------------------

    def _start_up(self, timeout_s: float) -> None:
        """Every rank reports each phase in order, each phase within ``timeout_s``; the first
        failure or death ends start-up at once."""
        for phase in PHASES:
            deadline = time.monotonic() + timeout_s
            waiting = {ref: rank for rank, ref in enumerate(self._ranks.receive())}
            while waiting:
                ready = self._ranks.wait(list(waiting), deadline - time.monotonic())
                if not ready:
                    rank = min(waiting.values())
                    raise missed_phase(rank, phase, timeout_s, "parallel.startup_timeout_s")
                for ref in ready:
                    rank = waiting.pop(ref)
                    message = self._ranks.message(ref)
                    if isinstance(message, Failure):
                        raise failed_in_phase(rank, message.phase, message.failure)
                    if not isinstance(message, Phase):
                        raise self._ranks.lost_error(rank, message, phase)
                    if message.name != phase:
                        raise PeerLostError(
                            f"rank {rank} sent {message!r} during phase {phase!r}", rank=rank
                        )

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
        self.check_health()
        check_reply_rank(unique_reply_rank, self.world_size)
        name = method_name(method)
        payload = (
            method if isinstance(method, str) else pickled_call(name, method, cloudpickle.dumps)
        )
        message = pickled_call(
            name, Call(payload, tuple(args), dict(kwargs or {}), unique_reply_rank)
        )
        seconds = self._call_timeout_s if timeout is None else timeout
        with self._changed:
            if self._closed:
                raise PeerLostError("the ray executor was shut down", op=name)
            call = _PendingCall(
                name,
                list(range(self.world_size)) if unique_reply_rank is None else [unique_reply_rank],
                time.monotonic() + seconds,
                self._ranks.broadcast(message),
            )
            self._pending.append(call)
            self._changed.notify_all()
        return call.future if non_block else call.future.result()

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput | None]:
        """A Future of the output rank's reply, returned once the step is sent."""
        replies = self.collective_rpc(
            "execute_model",
            (scheduler_output,),
            unique_reply_rank=self._output_rank,
            non_block=True,
        )
        return first_reply(replies)

    def check_health(self) -> None:
        if self._closed:
            raise PeerLostError("the ray executor was shut down", op="check_health")
        if self._failure is not None:
            raise self._failure

    # ---- reply collection ------------------------------------------------------------------------

    def _collect(self) -> None:
        """Settle pending calls, oldest first, until shutdown."""
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
                call = self._pending[0]
            try:
                _settle(call.future, value=self._answers(call))
            except WorkerError as error:
                if isinstance(error.origin, CommunicationError):
                    # A rank's collective failed (a peer stuck or gone): the world is broken.
                    self._fail(error)
                else:
                    _settle(call.future, error=error)
            except ShardlineError as error:
                self._fail(error)
            with self._changed:
                if self._pending and self._pending[0] is call:
                    self._pending.popleft()

    def _answers(self, call: _PendingCall) -> list[Any]:
        """The reply ranks' values once every rank has answered ``call``. Raises the first
        failure (a death, when one is news within :data:`_DEATH_NEWS_S`, is the cause), the
        executor's failure, or CommTimeoutError at the deadline."""
        waiting = {ref: rank for rank, ref in enumerate(call.refs)}
        replies: dict[int, Any] = {}
        while waiting:
            self.check_health()
            left = call.deadline - time.monotonic()
            if left <= 0:
                silent = sorted(waiting.values())
                raise CommTimeoutError(
                    f"call {call.name!r}: ranks {silent}{self._ranks.where(silent)} did not "
                    "answer by the deadline; the executor is unusable (a worker is stuck)",
                    op=call.name,
                    rank=silent[0],
                )
            for ref in self._ranks.wait(list(waiting), min(left, _POLL_S)):
                rank = waiting.pop(ref)
                message = self._ranks.message(ref)
                if isinstance(message, Reply):
                    replies[rank] = message.value
                elif isinstance(message, Failure):
                    error = message.failure.error(rank, f"(in call {call.name!r}) ")
                    if isinstance(error.origin, CommunicationError):
                        raise self._death_since(_DEATH_NEWS_S) or error
                    raise error
                elif not isinstance(message, Done):
                    raise self._ranks.lost_error(rank, message, call.name)
        return [replies[rank] for rank in call.reply_ranks]

    def _death_since(self, seconds: float) -> ShardlineError | None:
        """The death of a rank, if one is known within ``seconds``."""
        ready = self._ranks.wait(self._ranks.watches, seconds)
        if not ready:
            return None
        rank = self._ranks.watches.index(ready[0])
        return self._ranks.lost_error(rank, self._ranks.message(ready[0]), "liveness")

    def _watch(self) -> None:
        """Fail the executor when a rank's process ends or its actor dies (not after shutdown
        began: then that is expected)."""
        watching = dict(zip(self._ranks.watches, range(self.world_size), strict=True))
        while watching and not self._closed:
            for ref in self._ranks.wait(list(watching), _POLL_S):
                rank = watching.pop(ref)
                if self._closed:
                    return
                self._fail(self._ranks.lost_error(rank, self._ranks.message(ref), "liveness"))

    def _fail(self, error: ShardlineError) -> None:
        """Make ``error`` the executor's state: every pending and later call raises it."""
        with self._changed:
            if self._failure is None:
                self._failure = error
            pending = list(self._pending)
        for call in pending:
            _settle(call.future, error=self._failure)

    # ---- shutdown ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the ranks (asked, then killed after a grace period; at once after a failure),
        kill the actors, remove the placement group, end the Ray connection if it is this
        executor's to end. Idempotent; safe after any failure."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
            pending = list(self._pending)
            self._pending.clear()
        atexit.unregister(self.shutdown)
        try:
            if self._ranks is not None:
                self._ranks.stop(_JOIN_S if self._failure is None else 0.0)
        finally:
            self._store = None
            for call in pending:
                _settle(call.future, error=PeerLostError("the ray executor was shut down"))


def _settle(future: Future, value: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless another thread already did (first outcome wins)."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
