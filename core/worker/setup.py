"""Building a rank's Worker from the config: join the worlds, build the ParallelState, pick
the model runner, load the model. Used by every executor and by test drivers."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from shardline.comm.host_directory import HostDirectory, announce_host, wait_for_announcements
from shardline.config.schema import EngineConfig, ParallelConfig
from shardline.errors import CommTimeoutError, CommunicationError
from shardline.interfaces.communicator_backend import Rendezvous
from shardline.launch.comm_world import ParallelRankContext, join_parallel_worlds
from shardline.registry import Registry
from shardline.worker.worker import Worker

#: What a rank's joins leave of its "distributed init" phase: time for a join's error, which
#: names the ranks that never arrived, to reach whoever watches the phase before the phase's
#: own deadline passes (whose error could not say who was missing).
REPORT_S = 2.0


def join_timeout(parallel: ParallelConfig, phase_began: float) -> float:
    """How long a rank's joins wait for the other ranks: what is left of its start-up phase
    (``parallel.startup_timeout_s`` from ``phase_began``, a ``time.monotonic()``) less
    :data:`REPORT_S`, and never less than ``parallel.timeout_s``. Ranks reach a join at
    different times while they start, on a loaded host seconds apart."""
    return round(max(_phase_left(parallel, phase_began), parallel.timeout_s), 1)


def announcement_timeout(parallel: ParallelConfig, phase_began: float) -> float:
    """How long a rank waits for every rank to announce its host (to have started): what is
    left of its start-up phase less :data:`REPORT_S`, and never less than half the phase, so
    that the error naming the ranks that never started comes before the phase's deadline."""
    return round(max(_phase_left(parallel, phase_began), parallel.startup_timeout_s / 2), 1)


def _phase_left(parallel: ParallelConfig, phase_began: float) -> float:
    """Seconds left of a start-up phase begun at ``phase_began`` less :data:`REPORT_S`."""
    return parallel.startup_timeout_s - (time.monotonic() - phase_began) - REPORT_S


@dataclass
class WorkerContext:
    """A rank's Worker (call its methods by name, as ``collective_rpc`` does:
    ``execute_model``, ``load_model``, ...) and the worlds under it."""

    worker: Worker
    parallel: ParallelRankContext

    def close(self, finish_sends: bool = True) -> None:
        """Finish the Worker's pending sends (drop them with ``finish_sends`` False: after a
        failure) and leave the worlds, also when a send fails (every rank, at shutdown)."""
        try:
            self.worker.close(finish_sends)
        finally:
            self.parallel.close()


@dataclass(frozen=True)
class WorkerSetup:
    """Callable that makes a rank's :class:`WorkerContext` (picklable, for rank processes)."""

    config: EngineConfig
    load_model: bool = True

    def __call__(self, rank: int, world_size: int, rendezvous: Rendezvous) -> WorkerContext:
        return self.build(rank, world_size, rendezvous)

    def build(
        self,
        rank: int,
        world_size: int,
        rendezvous: Rendezvous,
        on_phase: Callable[[str], None] = lambda phase: None,
    ) -> WorkerContext:
        """Announce this rank's host, load the plugins and run their
        ``shardline_rank_starting`` hooks, wait for every rank to announce its own
        (:func:`announcement_timeout`; ``CommTimeoutError`` names those that do not), join the
        worlds (phase "distributed init"; a failure to join names the hosts of the ranks when
        they are several), then build the runner and load the model (phase "model load");
        ``on_phase`` is called as each phase completes. Joining waits for the other ranks as
        long as the phase allows (:func:`join_timeout`)."""
        began = time.monotonic()
        registry = Registry.for_plugins(self.config.plugins)
        startup_timeout_s = self.config.parallel.startup_timeout_s
        announce_host(rendezvous, rank, startup_timeout_s)
        registry.rank_starting(rank, world_size)
        # Every rank has announced its host before any joins a world (the joins read them).
        waited_s = announcement_timeout(self.config.parallel, began)
        missing = wait_for_announcements(rendezvous, world_size, waited_s)
        if missing:
            raise CommTimeoutError(
                f"start-up on rank {rank} of {world_size}: ranks {missing} did not start "
                f"within {waited_s:g} s (announced no host; parallel.startup_timeout_s = "
                f"{startup_timeout_s:g} s)",
                op="init_world",
                rank=rank,
            )
        try:
            parallel = join_parallel_worlds(
                self.config,
                registry,
                rank,
                world_size,
                rendezvous,
                join_timeout(self.config.parallel, began),
            )
        except CommunicationError as error:
            hosts = HostDirectory.read(rendezvous, world_size, timeout_s=1.0)
            if not hosts.spans_hosts:
                raise
            raise type(error)(f"{error}{hosts.summary()}", op=error.op, rank=error.rank) from error
        on_phase("distributed init")
        try:
            runner_class = registry.get(
                "model_runner", self.config.model.runner, "model.runner"
            ).load_available()
            worker = Worker(parallel.state, runner_class(self.config, parallel.state))
            if self.load_model:
                worker.load_model()
        except BaseException:
            parallel.close()
            raise
        on_phase("model load")
        return WorkerContext(worker, parallel)
