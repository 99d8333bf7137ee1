"""A rank's Ray actor: it starts the rank's process and relays calls to it.

The rank runs in a child of the actor, not in the actor itself, so that its death is seen
with its exit status (only a process's parent learns that; Ray's worker processes are the
raylet's children) and so that it ends with the actor in every phase (a tethered child). The
actor relays the driver's bytes to the rank over a pipe and the rank's answers back,
without reading either. Its methods run one at a time, in the order this driver called them
(Ray's guarantee for a synchronous actor), except :meth:`watch` and :meth:`kill`, which run
in a concurrency group of their own, beside a call that may be stuck.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import pickle

from shardline.interfaces import Rendezvous
from shardline.sdk import EngineConfig, Spawner
from shardline_ray.placement import RankPlace
from shardline_ray.protocol import Died
from shardline_ray.rank import rank_main

#: The concurrency group :meth:`RankActor.watch` and :meth:`RankActor.kill` run in, and its
#: threads.
CONTROL_GROUP = "control"
CONTROL_THREADS = 2


class RankActor:
    """One rank's actor (made a Ray actor class by the executor)."""

    def __init__(
        self, place: RankPlace, world_size: int, config: EngineConfig, rendezvous: Rendezvous
    ) -> None:
        """Start the process of the rank at ``place`` (its rank, local rank and the ranks on
        its node); it reports phase "spawn" once it runs."""
        self._spawner = Spawner(f"shardline-ray-{place.rank}-spawner")
        self._pipe, theirs = multiprocessing.Pipe()
        self._process = self._spawner.start(
            rank_main,
            (place, world_size, config, rendezvous, theirs.fileno()),
            f"shardline-ray-rank-{place.rank}",
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()

    def receive(self) -> bytes:
        """The rank's next message, or ``Died`` once its process has ended (the messages it
        sent before come first)."""
        ready = multiprocessing.connection.wait([self._pipe, self._process.sentinel])
        if self._pipe in ready:
            try:
                return self._pipe.recv_bytes()
            except (EOFError, OSError):
                pass
        return self._died()

    def call(self, message: bytes) -> bytes:
        """Hand ``message`` (a pickled ``Call``) to the rank; its answer, or ``Died``."""
        try:
            self._pipe.send_bytes(message)
        except OSError:
            return self._died()
        return self.receive()

    def watch(self) -> bytes:
        """Return ``Died`` when the rank's process ends (runs beside the other methods)."""
        multiprocessing.connection.wait([self._process.sentinel])
        return self._died()

    def stop(self, grace_s: float) -> None:
        """Ask the rank to leave once the calls before are done (the pipe closes), and give
        it ``grace_s`` to end."""
        self._pipe.close()
        self._process.join(grace_s)

    def kill(self) -> None:
        """Kill the rank's process (also while a call runs) and wait until it has ended."""
        self._process.kill()
        self._process.join()
        self._spawner.close()

    def _died(self) -> bytes:
        self._process.join(1.0)
        return pickle.dumps(Died(self._process.pid, self._process.exitcode))
