"""How ranks are started and driven: the Executor contract (broadcast, one reply)."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from shardline.interfaces.step import ModelRunnerOutput, SchedulerOutput


class Host(Protocol):
    """A host an executor may start processes in (see :meth:`Executor.prepare_hosts`): its
    ``name`` (its hostname) and ``address`` (the one the other hosts reach it at);
    ``command(argv)`` is ``argv`` made to run inside it, and ``started()`` the pids of the
    processes started in it. Simulated hosts (``shardline hosts``) are such hosts."""

    name: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]: ...

    def started(self) -> list[int]: ...


class Executor(abc.ABC):
    """Starts one Worker per rank and drives them all with the same calls.

    The pattern (from the reference design): one broadcast of (method, args, kwargs,
    reply rank) to every rank; every rank runs it; only the requested rank replies.

    Class attributes describe how an executor runs, so that its conformance suite applies
    the checks that fit: ``max_world_size`` (None: any), ``owns_processes`` (it starts and
    watches the rank processes: death detection and leftover processes are its job),
    ``launched`` (a launcher such as torchrun started every rank; each process builds its
    own executor, and every call returns the same result in every process) and
    ``enforces_deadlines`` (a call's ``timeout`` can end the wait for a rank still running)
    and ``spans_hosts`` (its ranks can run on several hosts; without it a config with
    ``parallel.nnodes`` > 1 is refused). ``starts_concurrently``: the engine may construct the
    executors of its data-parallel replicas at once, each in a thread of its own (nothing in
    the constructor needs the main thread, or state shared with another instance unguarded;
    where one replica fails, the engine raises at once, and a replica still in its
    constructor is shut down from that thread once the constructor returns); without it they
    start one after another.

    What every executor does (the building blocks are in :mod:`shardline.sdk`):

    - **Rendezvous and secret.** Ranks meet at a store: serve one with ``serve_store()``
      (loopback for ranks of one host; it returns a ``Rendezvous`` with a new random job
      secret) and hand the rendezvous to each rank privately (never over a socket); under a
      launcher use ``LaunchedRank`` and the launcher's store. Each rank then builds its
      Worker with ``WorkerSetup(config).build(rank, world_size, rendezvous, on_phase)``.
    - **Start-up phases.** "spawn" (the rank's process runs), "distributed init", "model
      load", "ready": each within ``parallel.startup_timeout_s``; a rank that misses one or
      fails in it ends start-up with an error naming the phase and the rank
      (``missed_phase``, ``failed_in_phase``). ``WorkerSetup.build``'s ``on_phase`` reports
      the two middle ones as they end; the executor reports the first and the last.
    - **Cores and threads.** Each rank process takes its share of the host's cores for
      torch: ``share_cores(ranks_on_this_host)``; an executor that starts processes it
      places itself also honours ``parallel.cpu_binding`` (``core_binding.core_sets_for``,
      then ``place_rank`` with the rank's set) or says that it leaves it.
    - **Call deadlines.** The default deadline of a call is ``parallel.timeout_s`` plus
      ``WATCHDOG_REPORT_S`` and a small margin, so that a rank's own diagnosis of a stuck
      collective (which names the rank at fault) arrives before the executor gives up on
      the rank it happened to wait on.
    - **Processes.** Rank processes end with the process that started them
      (``Spawner``), and a dead rank fails every pending and later call with
      ``PeerLostError`` naming it and its exit code.
    - **Errors.** An exception in a rank reaches the caller as ``WorkerError`` (rank, type,
      message, traceback, and ``origin``: the exception itself when it is one of
      Shardline's typed errors); so does a call whose argument a rank cannot load, or whose
      result cannot be pickled back or loaded where it arrives; a call whose arguments cannot
      be pickled raises TypeError naming it before anything is sent. The executor stays
      usable.

    An executor that places ranks through a cluster manager of its own (Ray's nodes, say)
    says how to bring one up on given hosts with :meth:`prepare_hosts`, so that harnesses
    (``shardline faults --across-hosts``) can run its driver over hosts they made.
    """

    max_world_size: int | None = None
    owns_processes: bool = False
    launched: bool = False
    enforces_deadlines: bool = True
    spans_hosts: bool = False
    starts_concurrently: bool = False

    @classmethod
    def rendezvous_note(cls, config: Any, environ: Mapping[str, str]) -> str:
        """Where this executor's ranks meet (the rendezvous store: which process serves it,
        on which address, and whether other hosts can reach it), for ``shardline explain``.
        Nothing is started."""
        return "not described by this executor"

    @classmethod
    def prepare_hosts(
        cls, hosts: Sequence[Host], environ: Mapping[str, str]
    ) -> contextlib.AbstractContextManager[dict[str, str]]:
        """A context manager that brings up on ``hosts`` what this executor's driver needs to
        place ranks on every one of them (a cluster manager's daemons: the leader in
        ``hosts[0]``), started with ``environ`` (the ranks inherit it), and yields the
        environment of a driver run inside ``hosts[0]`` with ``parallel.nnodes`` =
        ``len(hosts)``. Leaving it stops all it started there and waits (bounded) until those
        processes have ended. Raises ``HostsError`` naming the host when something cannot
        start. The default brings up nothing and yields ``environ``. For harnesses only: the
        engine never calls it."""
        return contextlib.nullcontext(dict(environ))

    @property
    def reports_results(self) -> bool:
        """True in the one process that should print or return results to the user (under
        a launcher every rank runs the engine, and only rank 0 reports)."""
        return True

    @property
    @abc.abstractmethod
    def output_rank(self) -> int:
        """The rank whose ``execute_model`` result is returned: ``world_size - tp_size``
        (the first tensor-parallel rank of the last pipeline stage)."""

    @abc.abstractmethod
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        non_block: bool = False,
    ) -> list[Any] | Future[list[Any]]:
        """Run ``method`` on the Worker of every rank.

        ``method`` is a Worker method name, or a callable taking the Worker as first argument.
        Returns the replies in rank order; with ``unique_reply_rank`` only that rank replies
        and the list has one element (a rank outside ``0..world_size-1`` raises ValueError
        before anything is sent). ``timeout`` (seconds, None: the configured default) bounds
        the wait for replies and raises ``CommTimeoutError`` naming the silent ranks as a
        list (``ranks [3] did not answer ...``).
        With ``non_block`` a Future is returned at once; futures resolve in call order.
        An exception in a worker raises ``WorkerError`` carrying its rank, type, message and
        traceback; a dead worker raises ``PeerLostError`` naming the rank and exit code.
        """

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput | None]:
        """Broadcast ``execute_model(scheduler_output)``; a Future of the output rank's
        reply, returned at once (the step may still run: with pipeline stages the engine keeps
        one step in flight per stage). The Future fails as :meth:`collective_rpc` raises."""

    @abc.abstractmethod
    def check_health(self) -> None:
        """Raise ``PeerLostError`` if any worker is gone; return None otherwise."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and free every resource. Idempotent; safe after a failure."""
