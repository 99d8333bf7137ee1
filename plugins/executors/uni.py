"""The ``uni`` executor: a world of one rank, running in the caller's process."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from shardline.errors import ConfigError, PeerLostError, RemoteFailure
from shardline.interfaces import Executor, ModelRunnerOutput, SchedulerOutput
from shardline.sdk import EngineConfig, WorkerContext, WorkerSetup, first_reply, serve_store


class UniProcExecutor(Executor):
    """Drives a single in-process Worker with the same calls a multi-rank executor makes.

    ``timeout`` is accepted for the common contract but cannot interrupt a call running in
    this very process.
    """

    max_world_size = 1
    enforces_deadlines = False

    @classmethod
    def rendezvous_note(cls, config: EngineConfig, environ: Any) -> str:
        return "served by this process on 127.0.0.1 (loopback only: unreachable from other hosts)"

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.world_size != 1:
            raise ConfigError(
                f"parallel.distributed_executor_backend = 'uni' runs one rank, but the layout has "
                f"{config.parallel.world_size}; allowed: mp, external_launcher, or auto"
            )
        self._store, rendezvous = serve_store()
        self._context: WorkerContext | None = WorkerSetup(config)(0, 1, rendezvous)

    @property
    def output_rank(self) -> int:
        return 0

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        non_block: bool = False,
    ) -> list[Any] | Future[list[Any]]:
        if self._context is None:
            raise PeerLostError("the uni executor was shut down", op=str(method), rank=0)
        if unique_reply_rank not in (None, 0):
            raise ValueError(f"unique_reply_rank = {unique_reply_rank}: the only rank is 0")
        worker = self._context.worker
        function = (
            getattr(worker, method)
            if isinstance(method, str)
            else (lambda *a, **k: method(worker, *a, **k))
        )
        future: Future[list[Any]] = Future()
        try:
            future.set_result([function(*args, **(kwargs or {}))])
        except Exception as error:
            failure = RemoteFailure.capture(error).error(0)
            if not non_block:
                raise failure from error
            future.set_exception(failure)
        return future if non_block else future.result()

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput | None]:
        """Runs the step now, in this thread; the Future is already resolved."""
        replies = self.collective_rpc(
            "execute_model", (scheduler_output,), unique_reply_rank=0, non_block=True
        )
        return first_reply(replies)

    def check_health(self) -> None:
        if self._context is None:
            raise PeerLostError("the uni executor was shut down", op="check_health", rank=0)

    def shutdown(self) -> None:
        if self._context is not None:
            self._context.close()
            self._context = None
