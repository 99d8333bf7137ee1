"""The engine: a scheduler feeding an executor, with as many steps in flight as there are
pipeline stages, and text out of the sampled tokens (incremental detokenization, stop
strings). With ``parallel.data_parallel_size`` N, N replicas of the TP x PP layout, each with
its own ranks (executor), scheduler and KV cache, step side by side; a new request goes to the
replica with the least outstanding work."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from shardline.config.loader import LoadedConfig
from shardline.config.schema import EngineConfig
from shardline.config.selection import check_config, executor_name
from shardline.engine.detokenizer import Detokenizer
from shardline.engine.scheduler import Request, Scheduler
from shardline.engine.speculative import NgramProposer
from shardline.engine.starting import start_all
from shardline.errors import CommTimeoutError, ConfigError, RequestError
from shardline.interfaces import Executor
from shardline.interfaces.step import (
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
    TokenLogprobs,
)
from shardline.profiling import NO_TIMER, StepTimer
from shardline.registry import Registry
from shardline.weights import load_tokenizer, open_checkpoint

#: Seconds a step may take beyond ``parallel.timeout_s`` before the engine gives up on it
#: (the executor's own deadline should have fired first).
STEP_GRACE_S = 5.0


@dataclass
class RequestOutput:
    """What a request has produced so far. ``text`` excludes special tokens and stop
    strings; ``finish_reason`` is "stop" (end-of-sequence, stop token or stop string),
    "length" (max_tokens or max_model_len), "pooled" (embedding ready) or None (running).
    ``logprobs``: one entry per token of ``token_ids`` where the request's
    ``SamplingParams.logprobs`` asks for them, else None; ``prompt_logprobs`` likewise, one
    per prompt token (None for the first), once the prompt has been run."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    embedding: Any = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Replica:
    """One data-parallel replica of the TP x PP layout: its ranks (``executor``), its
    ``scheduler`` (and so its KV cache), and its steps in flight (one per pipeline stage at
    most)."""

    def __init__(self, index: int, executor: Executor, scheduler: Scheduler, depth: int) -> None:
        self.index = index
        self.executor = executor
        self.scheduler = scheduler
        self.pipeline_depth = depth
        self.in_flight: deque[tuple[SchedulerOutput, Future]] = deque()

    def fill(self, timer: StepTimer = NO_TIMER) -> None:
        """Start steps until every pipeline stage has one or nothing is schedulable
        (``timer``: marks "schedule" and "send step")."""
        while len(self.in_flight) < self.pipeline_depth and self.scheduler.has_schedulable():
            share = None
            if self.pipeline_depth > 1:
                unfinished = len(self.scheduler.running) + len(self.scheduler.waiting)
                share = max(1, -(-unfinished // self.pipeline_depth))
            with timer("schedule"):
                step = self.scheduler.schedule(share)
            if step.total_num_scheduled_tokens == 0:
                break
            with timer("send step"):
                self.in_flight.append((step, self.executor.execute_model(step)))

    def outstanding_tokens(self) -> int:
        """Tokens its unfinished requests still have to compute: prompt tokens not yet in
        the cache and tokens still to generate (at most ``max_tokens``)."""
        return sum(
            len(r.prompt_token_ids)
            - min(r.num_computed_tokens, len(r.prompt_token_ids))
            + (0 if r.pooling else max(0, r.sampling.max_tokens - len(r.output_token_ids)))
            for r in self.scheduler.requests.values()
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)


class LLMEngine:
    """Owns the replicas (their executors, and through them every rank), their schedulers
    and the tokenizer.

    ``step`` runs steps to completion and returns the outputs that changed; the caller adds
    requests and steps until nothing is unfinished. Under a launcher every process runs its
    own engine; they stay identical because scheduling is deterministic and every process
    gets the same step results.
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
        undo_prestart = _prestart(config, registry, environ)
        try:
            checked = check_config(loaded, registry, environ, starts_here=True)
        except BaseException:
            if undo_prestart is not None:
                undo_prestart()
            raise
        config = checked.config
        #: The memory plan of the ranks on this host, as checked before they started.
        self.capacity = checked.capacity
        checkpoint = open_checkpoint(config.model.path, environ)  # its header read in C
        self.tokenizer = load_tokenizer(checkpoint)
        #: Token ids run from 0 to vocab_size - 1.
        self.vocab_size = checkpoint.architecture.vocab_size
        self.config = config
        self.max_model_len = checked.capacity.max_model_len or _max_model_len(
            loaded, checkpoint.architecture.max_positions
        )
        executor_class = registry.get(
            "executor",
            config.parallel.distributed_executor_backend,
            "parallel.distributed_executor_backend",
        ).load_available()
        executors = start_all(
            lambda index: executor_class(
                config.model_copy(update={"parallel": config.parallel.replica(index)})
            ),
            config.parallel.data_parallel_size,
            executor_class.starts_concurrently,
            lambda executor: executor.shutdown(),
        )
        try:
            self.replicas: list[Replica] = [
                Replica(
                    index, executor, self._new_scheduler(), config.parallel.pipeline_parallel_size
                )
                for index, executor in enumerate(executors)
            ]
        except BaseException:
            for executor in executors:
                executor.shutdown()
            raise
        self._outputs: dict[str, RequestOutput] = {}
        self._detokenizers: dict[str, Detokenizer] = {}
        self._replica_of: dict[str, Replica] = {}
        self._next_id = 0
        #: Marks the parts of the driver's step while profiling (``shardline.profiling``).
        self.timer: StepTimer = NO_TIMER

    def _new_scheduler(self) -> Scheduler:
        config = self.config
        return Scheduler(
            config.scheduler,
            block_size=config.cache.block_size,
            num_blocks=config.cache.num_blocks,
            max_model_len=self.max_model_len,
            eos_token_ids=self.tokenizer.eos_token_ids if self.tokenizer else set(),
            prefix_caching=config.cache.prefix_caching,
            proposer=(
                NgramProposer(config.speculative) if config.speculative.method == "ngram" else None
            ),
        )

    @property
    def executor(self) -> Executor:
        """The first replica's executor (the only one unless ``data_parallel_size`` > 1)."""
        return self.replicas[0].executor

    @property
    def scheduler(self) -> Scheduler:
        """The first replica's scheduler (the only one unless ``data_parallel_size`` > 1)."""
        return self.replicas[0].scheduler

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
        """Queue a request on the replica with the least outstanding work once the prompt
        tokens it holds in its prefix cache are counted off (the first of equals); its output
        object fills in as steps complete. Raises RequestError for a
        token id outside the vocabulary, in the prompt or ``logit_bias`` (and as the
        scheduler does)."""
        outside = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if outside:
            raise RequestError(
                f"token id {outside[0]} is outside the vocabulary: ids run from 0 to "
                f"{self.vocab_size - 1}"
            )
        biased = [t for t, _ in sampling.logit_bias if t >= self.vocab_size]
        if biased:
            raise RequestError(
                f"logit_bias: token id {biased[0]} is outside the vocabulary: ids run from 0 "
                f"to {self.vocab_size - 1}"
            )
        req_id = str(self._next_id)
        request = Request(req_id, list(prompt_token_ids), sampling, pooling)
        # The work a replica would have with it: what it has, less the tokens it has cached.
        replica = min(
            self.replicas,
            key=lambda r: (r.outstanding_tokens() - r.scheduler.cached_tokens(request), r.index),
        )
        replica.scheduler.add_request(request)
        self._next_id += 1
        output = RequestOutput(req_id, request.prompt_token_ids)
        if sampling.logprobs is not None and pooling is None:
            output.logprobs = []
        if sampling.prompt_logprobs is not None and pooling is None:
            output.prompt_logprobs = []
        self._outputs[req_id] = output
        self._detokenizers[req_id] = Detokenizer(self.tokenizer, sampling.stop)
        self._replica_of[req_id] = replica
        return output

    def has_unfinished_requests(self) -> bool:
        return any(replica.has_unfinished() for replica in self.replicas)

    def step(self) -> list[tuple[RequestOutput, str]]:
        """Fill every replica's pipeline with steps (one per stage at most), wait for the
        oldest step of some replica (with several replicas, whichever finishes first), and
        return each changed request's output with the text it gained."""
        with self.timer("driver step, rest"):
            return self._step()

    def _step(self) -> list[tuple[RequestOutput, str]]:
        for replica in self.replicas:
            replica.fill(self.timer)
        busy = [replica for replica in self.replicas if replica.in_flight]
        if not busy:
            if self.has_unfinished_requests():
                # Nothing in flight, so nothing can free blocks or add tokens: waiting would
                # never end (a runner that did not return a token it was scheduled to give).
                raise RuntimeError("unfinished requests, but no step can be scheduled for them")
            return []
        ready = busy
        if len(busy) > 1:
            oldest = {replica.in_flight[0][1]: replica for replica in busy}
            with self.timer("wait for ranks"):
                done, _ = wait(oldest, timeout=self._step_limit_s(), return_when=FIRST_COMPLETED)
            if not done:
                raise self._step_timeout()
            ready = [oldest[future] for future in done]
        changed = []
        for replica in ready:
            step, pending = replica.in_flight.popleft()
            with self.timer("wait for ranks"):
                result = self._wait(pending)
            changed += self._apply(replica, step, result)
        return changed

    def _apply(
        self, replica: Replica, step: SchedulerOutput, result: ModelRunnerOutput | None
    ) -> list[tuple[RequestOutput, str]]:
        """A finished step's results into its replica's scheduler and the outputs."""
        changed = []
        with self.timer("scheduler update"):
            updated = replica.scheduler.update(step, result)
        for request in updated:
            output = self._outputs[request.req_id]
            known = len(output.token_ids)
            output.token_ids = list(request.output_token_ids)
            if output.logprobs is not None:
                output.logprobs += request.output_logprobs[len(output.logprobs) :]
            if output.prompt_logprobs is not None:
                output.prompt_logprobs += request.prompt_logprobs[len(output.prompt_logprobs) :]
            detokenizer = self._detokenizers[request.req_id]
            with self.timer("detokenize"):
                delta, stopped = _detokenize(detokenizer, output.token_ids, known)
            if stopped:
                early = detokenizer.num_tokens_read < len(output.token_ids)  # see _detokenize
                del output.token_ids[detokenizer.num_tokens_read :]
                if output.logprobs is not None:
                    del output.logprobs[detokenizer.num_tokens_read :]
                if not request.finished:
                    replica.scheduler.finish(request, "stop")
                elif early:  # the scheduler ended it at a later token of the same step
                    request.finish_reason = "stop"
            if request.finished and not stopped:
                with self.timer("detokenize"):
                    delta += detokenizer.finish(output.token_ids)
            output.text += delta
            if request.finished:
                output.finish_reason = request.finish_reason
                output.embedding = request.embedding
                self._forget(request.req_id)
            changed.append((output, delta))
        return changed

    def _forget(self, req_id: str) -> None:
        self._outputs.pop(req_id, None)
        self._detokenizers.pop(req_id, None)
        self._replica_of.pop(req_id, None)

    def abort(self, req_id: str) -> None:
        """Drop one request now (e.g. its client went away): its cache blocks are free for
        the next step, and a step in flight that holds it is read without it. Unknown or
        finished ids are ignored."""
        replica = self._replica_of.get(req_id)
        if replica is not None:
            replica.scheduler.abort(req_id)
        self._forget(req_id)

    def abort_all(self) -> None:
        """Drop every request (e.g. after a failed step or an interrupt), and the prefix
        cache: a step left behind may not have written the blocks it was to fill."""
        for replica in self.replicas:
            for req_id in list(replica.scheduler.requests):
                replica.scheduler.abort(req_id)
            replica.in_flight.clear()
            replica.scheduler.reset_prefix_cache()
        self._outputs.clear()
        self._detokenizers.clear()
        self._replica_of.clear()

    def check_health(self) -> None:
        """Raise as the executors do when a rank of any replica is gone."""
        for replica in self.replicas:
            replica.executor.check_health()

    def load(self) -> EngineLoad:
        """Requests waiting and running, KV-cache blocks used and in all, and since the
        engine started the prefix cache's tokens looked up and found and the draft tokens
        proposed and accepted, over the replicas."""
        schedulers = [replica.scheduler for replica in self.replicas]
        return EngineLoad(
            waiting=sum(len(s.waiting) for s in schedulers),
            running=sum(len(s.running) for s in schedulers),
            blocks_used=sum(s.blocks.num_used for s in schedulers),
            blocks_total=sum(s.blocks.num_blocks for s in schedulers),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in schedulers),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in schedulers),
            spec_draft_tokens=sum(s.spec_draft_tokens for s in schedulers),
            spec_accepted_tokens=sum(s.spec_accepted_tokens for s in schedulers),
        )

    def shutdown(self) -> None:
        """Shut every replica's executor down (all of them, even when one fails)."""
        failures = []
        for replica in self.replicas:
            try:
                replica.executor.shutdown()
            except Exception as error:
                failures.append(error)
        if failures:
            raise failures[0]

    def _step_limit_s(self) -> float:
        return self.config.parallel.timeout_s + STEP_GRACE_S

    def _step_timeout(self) -> CommTimeoutError:
        return CommTimeoutError(
            f"execute_model: no result from the output rank within {self._step_limit_s():g} s",
            op="execute_model",
        )

    def _wait(self, pending: Future[ModelRunnerOutput | None]) -> ModelRunnerOutput | None:
        try:
            return pending.result(timeout=self._step_limit_s())
        except FutureTimeout:
            if pending.done():
                # The step's own CommTimeoutError (a TimeoutError too): keep its diagnosis.
                raise
            raise self._step_timeout() from None


def _detokenize(detokenizer: Detokenizer, token_ids: list[int], known: int) -> tuple[str, bool]:
    """The text ``token_ids`` add beyond the first ``known`` (the output so far), and whether
    a stop string was reached. Where the request has stop strings, tokens that
    came in one step (a speculative step's accepted drafts) are read one at a time, so that
    it stops at the token that completes one, as one token a step would; the caller drops
    the tokens after it (those beyond ``detokenizer.num_tokens_read``)."""
    if not detokenizer.stop or len(token_ids) - known <= 1:
        return detokenizer.update(token_ids)
    delta = ""
    for end in range(known + 1, len(token_ids) + 1):
        more, stopped = detokenizer.update(token_ids[:end])
        delta += more
        if stopped:
            return delta, True
    return delta, False


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds now, over all replicas."""

    waiting: int
    running: int
    blocks_used: int
    blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_draft_tokens: int
    spec_accepted_tokens: int


#: The fields of :class:`EngineLoad` that are running totals since the engine started.
COUNTED = ("prefix_cache_queries", "prefix_cache_hits", "spec_draft_tokens", "spec_accepted_tokens")


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


def _prestart(
    config: EngineConfig, registry: Registry, environ: Mapping[str, str]
) -> Callable[[], None] | None:
    """Give the executor the config names a head start (its ``prestart`` hook), before the
    config is checked; an executor that is unknown or declares none gets nothing (the check
    says what is wrong). Returns what the hook returned: what undoes the head start where
    the config is then refused, or None."""
    name, _ = executor_name(config, environ)
    try:
        component = registry.get("executor", name)
    except ConfigError:
        return None
    return component.head_start(config)
