"""The ``external_launcher`` executor: torchrun or mpiexec started every rank, and each process
runs its own engine with this executor driving its one Worker.

Every process makes the same calls in the same order (scheduling is deterministic), so a
"broadcast" is each process calling its own Worker. Replies are exchanged so that a call
returns the same list in every process: ``collective_rpc`` through the rendezvous store
(each call has its own deadline and names the silent ranks), ``execute_model`` through a
broadcast from the output rank on the control communicator, so that every rank's scheduler
sees the sampled tokens. With pipeline stages (and one replica) the output rank instead sends
each step's result to every other rank as soon as it has it, and they receive it when their
engine first asks for it: the first stage starts its next step while the last computes this
one, as under ``mp``. Only rank 0 reports results (:attr:`reports_results`).

A process that meets a missed deadline or a lost peer may share its job with a stuck rank:
its exit then ends the job (:func:`~shardline.launch.job_end.abort_job_at_exit`) even where its
script catches the error and returns normally: ``MPI_Abort`` in an MPI job (rather than
hanging in ``MPI_Finalize``), else exit status 1, on which torchrun or mpiexec ends the rest.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from shardline.errors import (
    CommTimeoutError,
    ConfigError,
    PeerLostError,
    RemoteFailure,
    ShardlineError,
)
from shardline.interfaces import Executor, ModelRunnerOutput, SchedulerOutput, Work
from shardline.sdk import (
    EngineConfig,
    HostDirectory,
    LaunchedRank,
    StartupGuard,
    WorkerContext,
    WorkerSetup,
    abort_job_at_exit,
    check_reply_rank,
    connect_store,
    loaded_reply,
    method_name,
    pickled_reply,
    place_rank,
    seal,
    verified_pickle,
)
from shardline_executors.launch_env import Meeting, describe_meeting, meet

#: How long the process serving the store waits at shutdown for the others to finish reading.
_CLOSING_S = 10.0


class ExternalLauncherExecutor(Executor):
    """This process's rank of a world a launcher started (see module docstring).

    ``environ`` (default ``os.environ``) holds the launcher's variables.
    """

    launched = True
    spans_hosts = True

    @classmethod
    def rendezvous_note(cls, config: EngineConfig, environ: Mapping[str, str]) -> str:
        try:
            return describe_meeting(LaunchedRank.from_environ(environ))
        except ConfigError as error:
            return f"unknown outside a launcher ({error})"

    def __init__(self, config: EngineConfig, environ: Mapping[str, str] | None = None) -> None:
        launched = LaunchedRank.from_environ(os.environ if environ is None else environ)
        if launched.world_size != config.parallel.world_size:
            layout = config.parallel.layout
            raise ConfigError(
                f"{launched.launcher} started {launched.world_size} ranks but the parallel "
                f"layout needs {config.parallel.world_size} (tp={layout.tensor_parallel_size} "
                f"x pp={layout.pipeline_parallel_size} x dp={layout.data_parallel_size}); "
                "allowed: launch exactly that many processes, or change the layout",
                field="parallel",
            )
        # Its cores of parallel.cpu_binding (each rank binds itself; none: left as placed).
        local_cores = config.parallel.core_binding.core_sets_for(launched.local_world_size)
        place_rank(
            None if local_cores is None else local_cores[launched.local_rank],
            launched.local_world_size,
        )
        self.rank = launched.rank
        self.world_size = launched.world_size
        self.launcher = launched.launcher
        layout = config.parallel.layout
        self._output_rank = layout.output_rank
        #: Results travel as sends that the other ranks receive when asked (see the module).
        self._results_sent = layout.pipeline_parallel_size > 1 and layout.data_parallel_size == 1
        self._result_send: Work | None = None
        self._call_timeout_s = config.parallel.timeout_s
        self._next_call = 0
        self._failure: ShardlineError | None = None
        # No driver watches this process: a phase that hangs (a plugin's hook, say) ends it.
        guard = StartupGuard(self.rank, config.parallel.startup_timeout_s, "rendezvous")
        self._meeting: Meeting | None = None
        self._context: WorkerContext | None = None
        try:
            self._meeting = meet(launched, config.parallel.startup_timeout_s)
            rendezvous = self._meeting.rendezvous
            self._secret = rendezvous.secret
            guard.phase("distributed init")
            self._context = WorkerSetup(config).build(
                self.rank,
                self.world_size,
                rendezvous,
                on_phase=lambda ended: (
                    guard.phase("model load") if ended == "distributed init" else None
                ),
            )
            self._store = connect_store(
                rendezvous.with_prefix("rpc"), config.parallel.startup_timeout_s
            )
            # Every rank announced its host before joining: read once, to name hosts later.
            self._hosts = HostDirectory.read(
                rendezvous, self.world_size, config.parallel.startup_timeout_s
            )
        except BaseException as error:
            if isinstance(error, CommTimeoutError | PeerLostError):
                abort_job_at_exit()
            self.shutdown()
            raise
        finally:
            guard.done()

    @property
    def output_rank(self) -> int:
        return self._output_rank

    @property
    def reports_results(self) -> bool:
        return self.rank == 0

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        non_block: bool = False,
    ) -> list[Any] | Future[list[Any]]:
        """Run ``method`` on this process's Worker, then exchange replies with the other
        processes; the result (or error) is the same in every process."""
        self.check_health()
        check_reply_rank(unique_reply_rank, self.world_size)
        name = method_name(method)
        worker = self._context.worker
        try:
            if isinstance(method, str):
                value = getattr(worker, method)(*args, **(kwargs or {}))
            else:
                value = method(worker, *args, **(kwargs or {}))
            replies = unique_reply_rank is None or unique_reply_rank == self.rank
            sealed = pickled_reply(("ok", value if replies else None), self._seal)
        except Exception as error:
            sealed = self._seal(("error", RemoteFailure.capture(error)))
        future: Future[list[Any]] = Future()
        try:
            envelopes = self._exchange(name, sealed, timeout)
            for rank, (kind, body) in enumerate(envelopes):
                if kind == "error":
                    raise body.error(rank)
            values = [body for _, body in envelopes]
            future.set_result(values if unique_reply_rank is None else [values[unique_reply_rank]])
        except ShardlineError as error:
            if not non_block:
                raise
            future.set_exception(error)
        return future if non_block else future.result()

    def _seal(self, envelope: tuple) -> bytes:
        return seal(envelope, self._secret)

    def _opened(self, sealed: bytes, rank: int) -> tuple:
        """Rank ``rank``'s envelope; a reply that does not load here is that rank's failure
        (a message without the job's signature: ProtocolError)."""
        data = verified_pickle(sealed, self._secret, f"rank {rank}")
        return loaded_reply(data, failed=lambda failure: ("error", failure))

    def _exchange(self, name: str, sealed: bytes, timeout: float | None) -> list[tuple]:
        """Publish this rank's envelope of call number N (sealed) and read every rank's."""
        call_id = self._next_call
        self._next_call += 1
        keys = [f"{call_id}/{rank}" for rank in range(self.world_size)]
        seconds = self._call_timeout_s if timeout is None else timeout
        store = self._store
        try:
            store.set(keys[self.rank], sealed)
            try:
                store.wait(keys, datetime.timedelta(seconds=seconds))
            except (RuntimeError, dist.DistError) as error:
                if "timeout" not in str(error).lower():
                    raise
                silent = [rank for rank, key in enumerate(keys) if not store.check([key])]
                raise self._fail(
                    CommTimeoutError(
                        f"collective_rpc {name!r}: ranks {silent}{self._hosts.where(silent)} "
                        f"did not answer within "
                        f"{seconds:g} s (timeout, default parallel.timeout_s); this executor "
                        "is now unusable",
                        op=name,
                    )
                ) from error
            envelopes = [self._opened(store.get(key), rank) for rank, key in enumerate(keys)]
            if store.add(f"{call_id}/read", 1) == self.world_size:
                for key in [*keys, f"{call_id}/read"]:
                    store.delete_key(key)
        except (RuntimeError, dist.DistError) as error:
            raise self._fail(
                PeerLostError(
                    f"collective_rpc {name!r}: the rendezvous store is unreachable (rank 0 or "
                    f"the launcher's agent is gone?): {error}",
                    op=name,
                )
            ) from error
        return envelopes

    def _fail(self, failure: ShardlineError) -> ShardlineError:
        """Remember ``failure`` (later calls raise it) and make this process's exit end the
        launched job (a stuck rank may be in it); returns it, to be raised."""
        self._failure = failure
        abort_job_at_exit()
        return failure

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput | None]:
        """Run the step on this rank; every rank gets the output rank's result, in a Future
        resolved before it is returned (the step ran in this thread), or, with pipeline
        stages, on the other ranks one that receives it when first asked for."""
        future: Future[ModelRunnerOutput | None] = Future()
        try:
            self.check_health()
            output = self._context.worker.execute_model(scheduler_output)
            world = self._context.parallel.state.world
            if self._results_sent and self.rank != self._output_rank:
                return _ResultOnRequest(lambda: self._receive_result(world))
            if self._results_sent:
                self._send_result(world, output)
            elif self.world_size > 1:
                output = world.broadcast_object(output, src=self._output_rank)
        except Exception as error:
            if isinstance(error, CommTimeoutError | PeerLostError):
                self._fail(error)
            future.set_exception(error)
        else:
            future.set_result(output)
        return future

    def _send_result(self, world, output: ModelRunnerOutput | None) -> None:
        """Start sending the output rank's ``output`` to every other rank (serialized once);
        the sends of the step before are complete first (they went out while this step
        ran)."""
        self._finish_result_sends()
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        self._result_send = world.control_plane.isend_object_to_each(output, others)

    def _finish_result_sends(self) -> None:
        """Wait until the last step's result sends have gone out."""
        if self._result_send is not None:
            self._result_send.wait()
            self._result_send = None

    def _receive_result(self, world) -> ModelRunnerOutput | None:
        """The output rank's next step result (steps are asked for in the order they ran)."""
        try:
            self.check_health()
            return world.control_plane.recv_object(self._output_rank)
        except (CommTimeoutError, PeerLostError) as error:
            raise self._fail(error) from None

    def check_health(self) -> None:
        if self._context is None:
            raise PeerLostError("the external_launcher executor was shut down", rank=self.rank)
        if self._failure is not None:
            raise self._failure

    def shutdown(self) -> None:
        """Close this rank's Worker, then leave the meeting: the process serving the store
        waits (at most ``_CLOSING_S``) until every rank has reached shutdown, so no rank
        loses the store mid-call; also after a failure, since a rank that was only slow (past
        a call's deadline) still finishes its call through the store. A last pipeline send
        that fails in a healthy world raises, after the meeting is left; a last result send
        that fails does not (a rank's engine need not ask for every result)."""
        if self._meeting is None:
            return
        context, self._context = self._context, None
        try:
            if context is not None:
                healthy = self._failure is None
                if healthy:  # the last results reach their ranks before it closes
                    with contextlib.suppress(ShardlineError):
                        self._finish_result_sends()
                context.close(finish_sends=healthy)
        finally:
            self._leave_meeting()

    def _leave_meeting(self) -> None:
        """Count this rank as closing in the store (the serving process waits for all), then
        close the meeting."""
        store = getattr(self, "_store", None)
        if store is not None:
            with contextlib.suppress(RuntimeError, dist.DistError):
                store.add("closing", 1)
                deadline = time.monotonic() + _CLOSING_S
                while self._meeting.served_store is not None and time.monotonic() < deadline:
                    if store.add("closing", 0) >= self.world_size:
                        break
                    time.sleep(0.01)
        self._store = None
        self._meeting.close()
        self._meeting = None


class _ResultOnRequest(Future):
    """A step's result that another rank sends: received (by ``receive``) the first time
    ``result`` is called, in that thread (a second caller waits for that receive); the engine
    asks for its steps in the order they ran, which is the order they are sent in."""

    def __init__(self, receive: Callable[[], ModelRunnerOutput | None]) -> None:
        super().__init__()
        self._receive = receive
        self._receiving = threading.Lock()

    def result(self, timeout: float | None = None) -> ModelRunnerOutput | None:
        """The result, received now if it was not yet; the receive ends by the
        communicator's deadline (``timeout`` does not cut it short)."""
        with self._receiving:
            if not self.done():
                try:
                    self.set_result(self._receive())
                except Exception as error:
                    self.set_exception(error)
        return super().result(timeout)
