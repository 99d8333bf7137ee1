"""The engine: a scheduler feeding an executor, with as many steps in flight as there are
pipeline stages, and text out of the sampled tokens (incremental detokenization, stop
strings)."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from shardline.config.loader import LoadedConfig
from shardline.config.selection import check_config
from shardline.engine.detokenizer import Detokenizer
from shardline.engine.scheduler import Request, Scheduler
from shardline.errors import CommTimeoutError, ConfigError, RequestError
from shardline.interfaces import Executor
from shardline.interfaces.step import ModelRunnerOutput, SamplingParams, SchedulerOutput
from shardline.registry import Registry
from shardline.weights import load_tokenizer, open_checkpoint

#: Seconds a step may take beyond ``parallel.timeout_s`` before the engine gives up on it
#: (the executor's own deadline should have fired first).
STEP_GRACE_S = 5.0


@dataclass
class RequestOutput:
    """What a request has produced so far. ``text`` excludes special tokens and stop
    strings; ``finish_reason`` is "stop" (end-of-sequence, stop token or stop string),
    "length" (max_tokens or max_model_len), "pooled" (embedding ready) or None (running)."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    embedding: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLMEngine:
    """Owns the executor (and through it every rank), the scheduler and the tokenizer.

    ``step`` runs at most one step to completion and returns the outputs that changed; the
    caller adds requests and steps until nothing is unfinished. Under a launcher every
    process runs its own engine; they stay identical because scheduling is deterministic
    and every process gets the same step results.
    """

    def __init__(
        self,
        loaded: LoadedConfig,
        registry: Registry | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        environ = os.environ if environ is None else environ
        config = loaded.config
        registry = registry or Registry.for_plugins(config.plugins)
        checked = check_config(loaded, registry, environ, starts_here=True)
        config = checked.config
        #: The memory plan of the ranks on this host, as checked before they started.
        self.capacity = checked.capacity
        checkpoint = open_checkpoint(config.model.path)
        self.tokenizer = load_tokenizer(checkpoint)
        #: Token ids run from 0 to vocab_size - 1.
        self.vocab_size = checkpoint.architecture.vocab_size
        self.config = config
        self.max_model_len = checked.capacity.max_model_len or _max_model_len(
            loaded, checkpoint.architecture.max_positions
        )
        self.scheduler = Scheduler(
            config.scheduler,
            block_size=config.cache.block_size,
            num_blocks=config.cache.num_blocks,
            max_model_len=self.max_model_len,
            eos_token_ids=self.tokenizer.eos_token_ids if self.tokenizer else set(),
        )
        executor_class = registry.get(
            "executor",
            config.parallel.distributed_executor_backend,
            "parallel.distributed_executor_backend",
        ).load_available()
        self.executor: Executor = executor_class(config)
        self.pipeline_depth = config.parallel.pipeline_parallel_size
        self._in_flight: deque[tuple[SchedulerOutput, Any]] = deque()
        self._outputs: dict[str, RequestOutput] = {}
        self._detokenizers: dict[str, Detokenizer] = {}
        self._next_id = 0

    @property
    def reports_results(self) -> bool:
        """False in the processes of a launched world that should stay quiet."""
        return self.executor.reports_results

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        pooling: str | None = None,
    ) -> RequestOutput:
        """Queue a request; its output object fills in as steps complete. Raises
        RequestError for a token id outside the vocabulary (and as the scheduler does)."""
        outside = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if outside:
            raise RequestError(
                f"token id {outside[0]} is outside the vocabulary: ids run from 0 to "
                f"{self.vocab_size - 1}"
            )
        req_id = str(self._next_id)
        self._next_id += 1
        request = Request(req_id, list(prompt_token_ids), sampling, pooling)
        self.scheduler.add_request(request)
        output = RequestOutput(req_id, request.prompt_token_ids)
        self._outputs[req_id] = output
        self._detokenizers[req_id] = Detokenizer(self.tokenizer, sampling.stop)
        return output

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    def step(self) -> list[tuple[RequestOutput, str]]:
        """Fill the pipeline with steps (one per stage at most), wait for the oldest, and
        return each changed request's output with the text it gained."""
        while len(self._in_flight) < self.pipeline_depth and self.scheduler.has_schedulable():
            share = None
            if self.pipeline_depth > 1:
                unfinished = len(self.scheduler.running) + len(self.scheduler.waiting)
                share = max(1, -(-unfinished // self.pipeline_depth))
            step = self.scheduler.schedule(share)
            if step.total_num_scheduled_tokens == 0:
                break
            self._in_flight.append((step, self.executor.execute_model(step)))
        if not self._in_flight:
            return []
        step, pending = self._in_flight.popleft()
        result = self._wait(pending)
        changed = []
        for request in self.scheduler.update(step, result):
            output = self._outputs[request.req_id]
            output.token_ids = list(request.output_token_ids)
            detokenizer = self._detokenizers[request.req_id]
            delta, stopped = detokenizer.update(output.token_ids)
            if stopped and not request.finished:
                self.scheduler.finish(request, "stop")
            if request.finished and not stopped:
                delta += detokenizer.finish(output.token_ids)
            output.text += delta
            if request.finished:
                output.finish_reason = request.finish_reason
                output.embedding = request.embedding
                del self._outputs[request.req_id], self._detokenizers[request.req_id]
            changed.append((output, delta))
        return changed

    def abort(self, req_id: str) -> None:
        """Drop one request now (e.g. its client went away): its cache blocks are free for
        the next step, and a step in flight that holds it is read without it. Unknown or
        finished ids are ignored."""
        self.scheduler.abort(req_id)
        self._outputs.pop(req_id, None)
        self._detokenizers.pop(req_id, None)

    def abort_all(self) -> None:
        """Drop every request (e.g. after a failed step or an interrupt)."""
        for req_id in list(self.scheduler.requests):
            self.scheduler.abort(req_id)
        self._in_flight.clear()
        self._outputs.clear()
        self._detokenizers.clear()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def _wait(self, pending: Future[ModelRunnerOutput | None]) -> ModelRunnerOutput | None:
        limit = self.config.parallel.timeout_s + STEP_GRACE_S
        try:
            return pending.result(timeout=limit)
        except FutureTimeout:
            if pending.done():
                # The step's own CommTimeoutError (a TimeoutError too): keep its diagnosis.
                raise
            raise CommTimeoutError(
                f"execute_model: no result from the output rank within {limit:g} s",
                op="execute_model",
            ) from None


def _max_model_len(loaded: LoadedConfig, model_positions: int) -> int:
    """``scheduler.max_model_len``, or the model's context capped by the cache size."""
    config = loaded.config
    capacity = config.cache.num_blocks * config.cache.block_size
    requested = config.scheduler.max_model_len
    if requested is None:
        return min(model_positions, capacity)
    source = loaded.source_of("scheduler.max_model_len")
    if requested > model_positions:
        raise ConfigError(
            f"{source}: scheduler.max_model_len = {requested}: the model's context is "
            f"{model_positions} tokens; allowed: 1..{model_positions}"
        )
    if requested > capacity:
        raise ConfigError(
            f"{source}: scheduler.max_model_len = {requested}: the KV cache holds {capacity} "
            f"tokens (cache.num_blocks * cache.block_size); raise cache.num_blocks or lower it"
        )
    return requested
