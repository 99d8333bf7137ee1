"""The process runtime every world of rank processes shares (the ``mp`` executor, LocalWorld):
starting the ranks as tethered children, watching them die, stopping them, and the errors
that say so — start-up phases missed or failed, a rank that died, a call that cannot go to the
ranks, a reply that cannot go back or cannot be loaded where it arrives — in the same words for
every executor.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import pickle
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardline.errors import CommTimeoutError, PeerLostError, RemoteFailure, WorkerError
from shardline.launch.fork_servers import ForkServers
from shardline.launch.tether import SpawnedChild, Spawner

#: How often the watch thread looks whether it was stopped, between deaths.
_WATCH_POLL_S = 0.5


class RankProcesses:
    """The processes of one world's ranks, in rank order: started here (:meth:`start` for
    each rank, then :meth:`watch`), or by a launcher this object starts (:meth:`launch`).
    :meth:`stop` ends them (idempotent)."""

    def __init__(self, name: str, role: str = "", fork_servers: ForkServers | None = None) -> None:
        """``name`` names the processes (``name-RANK``); ``role`` starts each rank's name in
        messages (``"worker "``: "worker rank 1 (pid ...) died ..."); ranks are forked from
        ``fork_servers`` (default: this process's, :meth:`ForkServers.process_wide`)."""
        self.name = name
        self.role = role
        self.processes: list[SpawnedChild] = []
        self.launcher: subprocess.Popen | None = None
        # Ranks forked from a server this process's worlds share: one interpreter start and
        # one import of the ranks' module (torch), not one per rank or per world.
        servers = ForkServers.process_wide() if fork_servers is None else fork_servers
        self._spawner = Spawner(f"{name}-spawner", fork_servers=servers)
        self._stopped = threading.Event()

    def start(
        self,
        target: Callable[..., Any],
        args: Sequence[Any],
        pass_fds: Sequence[int] = (),
        env: Mapping[str, str] | None = None,
    ) -> SpawnedChild:
        """Start the next rank's process: ``target(*args)`` (see :meth:`Spawner.start`),
        forked from this process's fork server for ``env`` (its pid known once forked)."""
        rank = len(self.processes)
        process = self._spawner.start(target, args, f"{self.name}-{rank}", pass_fds, env)
        self.processes.append(process)
        return process

    def launch(self, command: Sequence[str], **popen_args: Any) -> subprocess.Popen:
        """Start a launcher (mpiexec) that starts the ranks, in a session of its own, tethered
        with SIGTERM (a launcher ends its ranks when it gets one)."""
        self.launcher = self._spawner.popen(
            command, death_signal=signal.SIGTERM, start_new_session=True, **popen_args
        )
        return self.launcher

    def watch(self, on_death: Callable[[int], None]) -> None:
        """Call ``on_death(rank)`` from a thread of its own as soon as a rank's process ends,
        once per rank; never for a death after :meth:`stop` began (that one is expected)."""
        threading.Thread(
            target=self._watch, args=(on_death,), name=f"{self.name}-liveness", daemon=True
        ).start()

    def _watch(self, on_death: Callable[[int], None]) -> None:
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes)}
        while sentinels and not self._stopped.is_set():
            for sentinel in multiprocessing.connection.wait(list(sentinels), _WATCH_POLL_S):
                rank = sentinels.pop(sentinel)
                if self._stopped.is_set():
                    return
                self.processes[rank].join(0.1)
                on_death(rank)

    def died(self, rank: int, op: str) -> PeerLostError:
        """The error of a rank whose process has ended: its pid and exit code."""
        process = self.processes[rank]
        process.join(1.0)
        return PeerLostError(
            f"{self.role}rank {rank} (pid {process.pid}) died with exit code {process.exitcode}",
            op=op,
            rank=rank,
        )

    def first_dead(self) -> int | None:
        """The lowest rank whose process has ended, or None."""
        return next((r for r, p in enumerate(self.processes) if p.exitcode is not None), None)

    def stop(self, grace_s: float) -> None:
        """Give every rank up to ``grace_s`` to end by itself, kill the rest and release
        everything. Idempotent. Ask the ranks to stop first and give them a couple of
        seconds; give 0 after a failure (a stuck rank cannot read a request to stop)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(2.0)
            process.close()
        if self.launcher is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.launcher.wait(max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.launcher.pid, signal.SIGKILL)
            self.launcher.wait()
        self._spawner.close()


def missed_phase(rank: int, phase: str, timeout_s: float, setting: str) -> CommTimeoutError:
    """A rank did not finish start-up ``phase`` within ``timeout_s`` (the ``setting``)."""
    return CommTimeoutError(
        f"start-up: rank {rank} did not finish phase {phase!r} within {timeout_s:g} s ({setting})",
        op=phase,
        rank=rank,
    )


def failed_in_phase(rank: int, phase: str, failure: RemoteFailure) -> WorkerError:
    """A rank raised ``failure`` in start-up ``phase``."""
    return failure.error(rank, f"failed in start-up phase {phase!r}: ")


def _highest_pickle(message: Any) -> bytes:
    """``message`` pickled with the highest protocol."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def pickled_call(name: str, message: Any, dumps: Callable[[Any], Any] = _highest_pickle) -> Any:
    """``message``, the call ``name`` (or part of it) on its way to the ranks, pickled by
    ``dumps`` (default: pickle, highest protocol). Raises TypeError naming the call and why
    where it cannot be pickled (an argument holding a lock, say): nothing is sent, and the
    executor stays usable."""
    return _pickled(message, dumps, f"call {name!r} cannot be pickled to go to the ranks")


def pickled_reply(message: Any, dumps: Callable[[Any], Any] = _highest_pickle) -> Any:
    """``message``, a rank's reply, pickled by ``dumps`` (default: pickle, highest protocol).
    Raises TypeError saying the reply cannot go back, and why, where it cannot be pickled (a
    result holding a lock, say): the rank sends that failure for the call instead, and goes on
    serving."""
    return _pickled(message, dumps, "the reply cannot be pickled to go back")


def _pickled(message: Any, dumps: Callable[[Any], Any], refusal: str) -> Any:
    """``message`` pickled by ``dumps``, or TypeError saying ``refusal`` and why."""
    try:
        return dumps(message)
    except Exception as error:
        raise TypeError(f"{refusal}: {error}") from error


def loaded_reply(
    data: Any,
    loads: Callable[[Any], Any] = pickle.loads,
    failed: Callable[[RemoteFailure], Any] | None = None,
) -> Any:
    """A rank's reply ``data`` loaded by ``loads`` where it arrived. Where it cannot be (an
    object of a class only the rank has, say), a TypeError says so and why: raised, or, given
    ``failed``, captured and passed to it, and what it returns (the call's failure in the
    executor's own envelope) returned. The receiver fails that call with it, naming the rank,
    and goes on."""
    try:
        return _loaded(data, loads)
    except TypeError as refusal:
        if failed is None:
            raise
        return failed(RemoteFailure.capture(refusal))


def _loaded(data: Any, loads: Callable[[Any], Any]) -> Any:
    """``data`` loaded by ``loads``, or :func:`loaded_reply`'s TypeError."""
    try:
        return loads(data)
    except Exception as error:
        raise TypeError(
            f"the reply cannot be loaded where it arrived: {type(error).__name__}: {error}"
        ) from error
