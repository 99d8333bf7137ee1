"""Continuous batching: which requests run in the next step, how many tokens of each, and
which KV-cache blocks they own.

Every step decodes the running requests first (one token each), then spends what is left of
the token budget on prompts: a waiting request joins as soon as budget and cache blocks
allow, and a long prompt is split into chunks over several steps (prefill and decode share
steps). A request leaves the moment it finishes. When the cache runs out, the most recently
admitted request is preempted: its blocks are freed and it is recomputed later from its
tokens so far.

The scheduler is deterministic: the same requests and the same outputs give the same steps,
which is what lets every process of a launched world run its own copy.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from shardline.config.schema import SchedulerConfig
from shardline.errors import RequestError
from shardline.interfaces.step import (
    CachedRequest,
    ModelRunnerOutput,
    NewRequest,
    SamplingParams,
    SchedulerOutput,
    TokenLogprobs,
)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A request as the scheduler tracks it. ``pooling`` set: an embedding request."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    pooling: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    #: Per output token, where ``sampling.logprobs`` asks for them.
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    #: Per prompt token scored so far, where ``sampling.prompt_logprobs`` asks for them (the
    #: first is None: nothing predicts it).
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=lambda: [None])
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    embedding: Any = None
    block_ids: list[int] = field(default_factory=list)
    #: Tokens whose keys and values are in the cache (or are being computed in flight).
    num_computed_tokens: int = 0
    #: Tokens and blocks the model runner has been told about.
    num_tokens_sent: int = 0
    num_blocks_sent: int = 0
    #: A step holding this request is in flight; it cannot be scheduled again until it returns.
    in_flight: bool = False

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


class BlockPool:
    """The free KV-cache blocks (the same block ids index every rank's cache)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks some request owns (0 when no request holds any)."""
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} cache blocks, {len(self._free)} are free")
        return [self._free.popleft() for _ in range(count)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


@dataclass
class _Step:
    """The step being built: what is left of its token budget, the requests it holds so far,
    and whether a request was preempted while building it."""

    limit: int
    budget: int
    scheduled: dict[str, int] = field(default_factory=dict)
    cached: list[CachedRequest] = field(default_factory=list)
    new: list[NewRequest] = field(default_factory=list)
    #: Whether the step embeds (True) or generates (False); set by its first request.
    task: bool | None = None
    preempted: bool = False

    def is_full(self) -> bool:
        """No token budget or no request slot is left."""
        return self.budget == 0 or len(self.scheduled) == self.limit

    def takes_kind_of(self, request: Request) -> bool:
        """Whether ``request`` is of the step's kind (any kind while the step is empty)."""
        return self.task is None or (request.pooling is not None) == self.task


class Scheduler:
    """Builds one :class:`SchedulerOutput` per step and folds each step's output back in."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: set[int],
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.blocks = BlockPool(num_blocks)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._released_ids: set[str] = set()
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        """Queue ``request``. Raises RequestError for an empty prompt, a prompt that leaves
        no room to generate within ``max_model_len``, or a duplicate id."""
        if request.req_id in self.requests:
            raise RequestError(f"request id {request.req_id!r} is already in use")
        length = len(request.prompt_token_ids)
        if length == 0:
            raise RequestError(f"request {request.req_id!r}: the prompt is empty")
        room = self.max_model_len if request.pooling else self.max_model_len - 1
        if length > room:
            raise RequestError(
                f"request {request.req_id!r}: the prompt has {length} tokens; at most {room} "
                f"fit (scheduler.max_model_len = {self.max_model_len}"
                + ("" if request.pooling else ", one token kept for the answer")
                + ")"
            )
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def abort(self, req_id: str) -> None:
        """Forget a request (unknown or finished ids are ignored)."""
        request = self.requests.get(req_id)
        if request is not None and not request.finished:
            self.finish(request, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_schedulable(self) -> bool:
        """Whether a request could take part in a new step now."""
        return bool(self.waiting) or any(not r.in_flight for r in self.running)

    def schedule(self, max_num_seqs: int | None = None) -> SchedulerOutput:
        """The next step. ``max_num_seqs`` lowers the configured request limit for this step
        (the engine spreads requests over pipeline stages with it). One step holds either
        generating or embedding requests, never both."""
        limit = min(self.config.max_num_seqs, max_num_seqs or self.config.max_num_seqs)
        step = _Step(limit=limit, budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._admit_waiting(step)
        released, self._released_ids = self._released_ids, set()
        return SchedulerOutput(
            new_requests=step.new,
            cached_requests=step.cached,
            num_scheduled_tokens=step.scheduled,
            finished_req_ids=released,
        )

    def _schedule_running(self, step: _Step) -> None:
        """Put the running requests not in flight into ``step``, oldest first: the rest of a
        chunked prompt, or the next token. Sets ``step.preempted`` when a request could not
        get its cache blocks."""
        for request in list(self.running):
            if step.is_full():
                break
            if request.in_flight or request.status is not RequestStatus.RUNNING:
                continue  # in a step in flight, or preempted earlier in this loop
            if not step.takes_kind_of(request):
                continue
            count = min(request.num_tokens - request.num_computed_tokens, step.budget)
            if count <= 0:
                continue
            if not self._grow(request, request.num_computed_tokens + count, step.scheduled):
                step.preempted = True
                continue
            step.cached.append(
                CachedRequest(
                    request.req_id,
                    request.all_token_ids[request.num_tokens_sent :],
                    request.block_ids[request.num_blocks_sent :],
                    request.num_computed_tokens,
                )
            )
            self._mark_scheduled(step, request, count)

    def _admit_waiting(self, step: _Step) -> None:
        """Admit waiting requests into ``step`` in arrival order while its budget, its request
        limit and the free cache blocks allow; the first that does not fit stops admission."""
        while self.waiting and not step.is_full():
            request = self.waiting[0]
            if not step.takes_kind_of(request):
                break
            count = min(request.num_tokens - request.num_computed_tokens, step.budget)
            needed = self._blocks_for(request.num_computed_tokens + count) - len(request.block_ids)
            if needed > self.blocks.num_free:
                break
            self.waiting.popleft()
            request.block_ids += self.blocks.allocate(needed)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.new.append(
                NewRequest(
                    request.req_id,
                    request.all_token_ids,
                    request.sampling,
                    list(request.block_ids),
                    request.pooling,
                    num_output_tokens=len(request.output_token_ids),
                )
            )
            self._mark_scheduled(step, request, count)

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput | None
    ) -> list[Request]:
        """Fold a step's output in: append sampled tokens, store embeddings, finish requests
        that stop. Returns the requests that got a token, an embedding, or finished."""
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is not None:
                request.in_flight = False
        if runner_output is None:
            if scheduler_output.total_num_scheduled_tokens:
                raise RuntimeError("the output rank returned nothing for a step with tokens")
            return []
        changed: list[Request] = []
        for index, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            if request is None or request.finished:
                continue  # aborted while its step was in flight
            if runner_output.prompt_logprobs is not None:
                _add_prompt_logprobs(request, runner_output.prompt_logprobs[index])
            if runner_output.pooled is not None:
                vector = runner_output.pooled[index]
                if vector is not None:
                    request.embedding = vector
                    self.finish(request, "pooled")
                    changed.append(request)
                continue
            token = runner_output.sampled_token_ids[index]
            if token is None:
                continue
            request.output_token_ids.append(token)
            if runner_output.logprobs is not None and request.sampling.logprobs is not None:
                request.output_logprobs.append(runner_output.logprobs[index])
            reason = self._stop_reason(request, token)
            if reason is not None:
                self.finish(request, reason)
            changed.append(request)
        return changed

    def finish(self, request: Request, reason: str) -> None:
        """End ``request`` now: free its blocks, tell the runners at the next step."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        del self.requests[request.req_id]

    def _stop_reason(self, request: Request, token: int) -> str | None:
        sampling = request.sampling
        if token in sampling.stop_token_ids:
            return "stop"
        if not sampling.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if len(request.output_token_ids) >= sampling.max_tokens:
            return "length"
        if request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _grow(self, request: Request, num_tokens: int, scheduled: dict[str, int]) -> bool:
        """Give ``request`` the blocks for ``num_tokens``, preempting the most recently
        admitted requests not in this step while blocks are short. False when ``request``
        itself was preempted or must wait for a step in flight to free blocks."""
        needed = self._blocks_for(num_tokens) - len(request.block_ids)
        while needed > self.blocks.num_free:
            candidates = [r for r in self.running if not r.in_flight and r.req_id not in scheduled]
            if not candidates:
                return False
            victim = candidates[-1]
            self._preempt(victim)
            if victim is request:
                return False
        request.block_ids += self.blocks.allocate(needed)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        """Free the request's blocks; a runner that has its state drops it next step."""
        self.blocks.free(request.block_ids)
        request.block_ids = []
        if request.num_tokens_sent:
            self._released_ids.add(request.req_id)
        request.num_tokens_sent = 0
        request.num_blocks_sent = 0

    def _mark_scheduled(self, step: _Step, request: Request, count: int) -> None:
        """``count`` tokens of ``request`` are in ``step``, which now holds its kind."""
        step.scheduled[request.req_id] = count
        step.budget -= count
        step.task = request.pooling is not None
        request.num_computed_tokens += count
        request.num_tokens_sent = request.num_tokens
        request.num_blocks_sent = len(request.block_ids)
        request.in_flight = True

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def _add_prompt_logprobs(request: Request, scored: tuple[int, list[TokenLogprobs]] | None) -> None:
    """Keep the prompt scores of one step (``(first index, scores)``; None: not asked)
    beyond those held: a prompt computed again after preemption scores its tokens again."""
    if scored is None:
        return
    first, scores = scored
    held = len(request.prompt_logprobs)
    if first <= held < first + len(scores):
        request.prompt_logprobs += scores[held - first :]
