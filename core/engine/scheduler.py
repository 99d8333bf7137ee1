"""Continuous batching: which requests run in the next step, how many tokens of each, and
which KV-cache blocks they own.

Every step decodes the running requests first (one token each), then spends what is left of
the token budget on prompts: a waiting request joins as soon as budget and cache blocks
allow, and a long prompt is split into chunks over several steps (prefill and decode share
steps). A request leaves the moment it finishes. When the cache runs out, the most recently
admitted request is preempted: its blocks are freed and it is recomputed later from its
tokens so far.

With prefix caching, a block that holds a whole block of tokens is remembered by its tokens
and every token before them (a hash chain). A request admitted later whose tokens begin the
same way shares those blocks and starts computing after them; a freed block keeps what it
holds until it is taken for something else, the least recently freed first.

With a proposer (speculative decoding), a request's decode step also carries its drafts,
guessed next tokens (:mod:`shardline.engine.speculative`), as far as the budget and its blocks
allow; the output says how many the model accepted, and the cache positions of the rest stop
counting as computed (they are overwritten later).

The scheduler is deterministic: the same requests and the same outputs give the same steps,
which is what lets every process of a launched world run its own copy.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from shardline.config.schema import SchedulerConfig
from shardline.engine.speculative import NgramIndex, NgramProposer
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
    #: The prefix-cache hash of each whole block of tokens so far (made as blocks fill).
    block_hashes: list[bytes] = field(default_factory=list)
    #: The first blocks of ``block_ids`` offered to the prefix cache.
    num_blocks_remembered: int = 0
    #: Tokens and blocks the model runner has been told about.
    num_tokens_sent: int = 0
    num_blocks_sent: int = 0
    #: A step holding this request is in flight; it cannot be scheduled again until it returns.
    in_flight: bool = False
    #: The drafts of the step in flight (speculative decoding), and the request's lookup state.
    spec_token_ids: list[int] = field(default_factory=list)
    ngram_index: NgramIndex | None = None
    #: How many drafts it may propose a step (the proposer's schedule; set with the index).
    draft_length: int = 0

    def token_ids_from(self, start: int) -> list[int]:
        """The tokens from position ``start`` on (without copying the prompt when it is
        behind: what each decode step needs)."""
        prompt = len(self.prompt_token_ids)
        if start >= prompt:
            return self.output_token_ids[start - prompt :]
        return self.prompt_token_ids[start:] + self.output_token_ids

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
    """The KV-cache blocks (the same block ids index every rank's cache): how many requests
    share each, which are free, and, with prefix caching, which hold a known run of tokens.

    A free block that holds a known run stays findable (:meth:`cached`) until
    :meth:`allocate` takes it for something else; free blocks are taken in the order they
    were freed. Deterministic, like the scheduler."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        """Blocks no request holds (those remembered by the prefix cache included)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks some request holds (0 when no request holds any)."""
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` free blocks for one request, the least recently freed first (what a
        block held is forgotten)."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} cache blocks, {len(self._free)} are free")
        taken = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            digest = self._hash_of.pop(block, None)
            if digest is not None:
                del self._block_of[digest]
            self._refs[block] = 1
            taken.append(block)
        return taken

    def free(self, block_ids: list[int]) -> None:
        """One holder fewer for each block; a block nobody holds is free. A request's last
        blocks are freed first, so they are taken before its first ones (which more
        requests share)."""
        for block in reversed(block_ids):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    def cached(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest run of ``hashes`` from the first."""
        found = []
        for digest in hashes:
            block = self._block_of.get(digest)
            if block is None:
                break
            found.append(block)
        return found

    def num_unheld(self, block_ids: list[int]) -> int:
        """How many of ``block_ids`` no request holds (sharing them takes them off the free
        list)."""
        return sum(1 for block in block_ids if self._refs[block] == 0)

    def share(self, block_ids: list[int]) -> None:
        """One holder more for each of ``block_ids`` (cached blocks a request now reads)."""
        for block in block_ids:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def remember(self, block: int, digest: bytes) -> None:
        """``block`` holds the run ``digest`` names (ignored when another block already
        does)."""
        if digest not in self._block_of and block not in self._hash_of:
            self._block_of[digest] = block
            self._hash_of[block] = digest

    def forget_all(self) -> None:
        """Drop what the prefix cache knows (e.g. a step failed before writing its blocks)."""
        self._block_of.clear()
        self._hash_of.clear()


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
        prefix_caching: bool,
        proposer: NgramProposer | None = None,
    ) -> None:
        """``proposer``: drafts for decoding requests (speculative decoding); None:
        off."""
        self.config = config
        self.proposer = proposer
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.blocks = BlockPool(num_blocks)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._released_ids: set[str] = set()
        self.num_preemptions = 0
        #: Tokens of admitted requests looked up in the prefix cache, and those found there.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        #: Draft tokens proposed, and those the model accepted.
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0

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

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (what a failed or abandoned step should have written
        may be missing), once every request is dropped: none may hold such a block."""
        if self.requests:
            raise RuntimeError(
                f"reset_prefix_cache with {len(self.requests)} requests held; drop them first"
            )
        self.blocks.forget_all()

    def cached_tokens(self, request: Request) -> int:
        """How many of ``request``'s tokens it would find in this scheduler's prefix cache if
        it were admitted now."""
        return len(self._cached_blocks(request)) * self.block_size

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
        released = set()
        if step.scheduled:  # an empty step is not sent: the runners hear of these next time
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
            drafts = self._drafts(request, step.budget) if count == 1 else []
            drafts = drafts[: self._room_for_drafts(request)]
            count += len(drafts)
            if not self._grow(request, request.num_computed_tokens + count, step.scheduled):
                step.preempted = True
                continue
            request.spec_token_ids = drafts
            step.cached.append(
                CachedRequest(
                    request.req_id,
                    request.token_ids_from(request.num_tokens_sent),
                    request.block_ids[request.num_blocks_sent :],
                    request.num_computed_tokens,
                    tuple(drafts),
                )
            )
            self._mark_scheduled(step, request, count)

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Drafts for ``request``'s next step, which decodes its last token, as many as the
        proposer finds within the request's draft length, the step's token budget, the
        tokens it may still generate and ``max_model_len``."""
        sampling = request.sampling
        if self.proposer is None or request.pooling is not None:
            return []
        if request.ngram_index is None:
            request.ngram_index = self.proposer.new_index()
            request.draft_length = self.proposer.first_length()
        limit = min(
            request.draft_length,
            budget - 1,
            sampling.max_tokens - len(request.output_token_ids) - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        if limit <= 0:
            return []
        index = request.ngram_index
        return self.proposer.propose(index, request.token_ids_from(index.num_tokens), limit)

    def _room_for_drafts(self, request: Request) -> int:
        """How many drafts ``request``'s blocks and the free blocks can hold beyond its last
        token (drafts never make the scheduler preempt a request)."""
        blocks = len(request.block_ids) + self.blocks.num_free
        return max(0, blocks * self.block_size - request.num_computed_tokens - 1)

    def _admit_waiting(self, step: _Step) -> None:
        """Admit waiting requests into ``step`` in arrival order while its budget, its request
        limit and the free cache blocks allow; the first that does not fit stops admission."""
        while self.waiting and not step.is_full():
            request = self.waiting[0]
            if not step.takes_kind_of(request):
                break
            hits = self._cached_blocks(request)
            computed = len(hits) * self.block_size
            count = min(request.num_tokens - computed, step.budget)
            needed = self._blocks_for(computed + count) - len(hits)
            if needed + self.blocks.num_unheld(hits) > self.blocks.num_free:
                break
            self.waiting.popleft()
            if self._looks_up(request):
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += computed
            self.blocks.share(hits)
            request.block_ids = hits + self.blocks.allocate(needed)
            request.num_computed_tokens = computed
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
                    num_computed_tokens=computed,
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
            accepted = self._accepted(request, runner_output, index)
            if runner_output.logprobs is not None and request.sampling.logprobs is not None:
                scores = runner_output.draft_logprobs
                found = (scores[index] or []) if scores is not None and accepted else []
                if len(found) != len(accepted):
                    raise RuntimeError(
                        f"request {request.req_id!r}: {len(accepted)} drafts accepted, "
                        f"{len(found)} with log-probabilities"
                    )
                request.output_logprobs += [*found, runner_output.logprobs[index]]
            for new_token in [*accepted, token]:
                request.output_token_ids.append(new_token)
                reason = self._stop_reason(request, new_token)
                if reason is not None:
                    del request.output_logprobs[len(request.output_token_ids) :]
                    self.finish(request, reason)
                    break
            changed.append(request)
        return changed

    def _accepted(self, request: Request, output: ModelRunnerOutput, index: int) -> list[int]:
        """The drafts of ``request``'s step (its ``index`` in ``output``) that the model
        accepted; the cache positions of the others no longer count as computed."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts:
            return []
        counts = output.num_accepted_drafts
        accepted = None if counts is None else counts[index]
        if accepted is None or not 0 <= accepted <= len(drafts):
            raise RuntimeError(
                f"request {request.req_id!r} had {len(drafts)} drafts; the output rank "
                f"accepted {accepted} (0 to {len(drafts)} expected)"
            )
        request.num_computed_tokens -= len(drafts) - accepted
        request.draft_length = self.proposer.next_length(
            request.draft_length, len(drafts), accepted
        )
        self.spec_draft_tokens += len(drafts)
        self.spec_accepted_tokens += accepted
        return drafts[:accepted]

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
        request.spec_token_ids = []
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        """Free the request's blocks; a runner that has its state drops it next step."""
        self.blocks.free(request.block_ids)
        request.block_ids = []
        request.num_blocks_remembered = 0
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
        if self.prefix_caching:
            self._remember_blocks(request)

    def _looks_up(self, request: Request) -> bool:
        """Whether ``request`` may start from cached blocks: not when it needs every prompt
        position computed (prompt log-probabilities, an embedding)."""
        return (
            self.prefix_caching
            and request.pooling is None
            and request.sampling.prompt_logprobs is None
        )

    def _cached_blocks(self, request: Request) -> list[int]:
        """The cached blocks ``request`` can start from: its longest cached run of whole
        blocks, short of its last token (which must be computed to give logits)."""
        if not self._looks_up(request):
            return []
        whole = (request.num_tokens - 1) // self.block_size
        return self.blocks.cached(self._block_hashes(request, whole))

    def _remember_blocks(self, request: Request) -> None:
        """Offer the prefix cache each block of ``request`` that this step fills. A step's
        blocks are cached as it is scheduled: a request admitted into the same step or a
        later one reads them after this step wrote them (ranks run steps in order, and a
        step writes its keys and values before it attends)."""
        # Drafts are not the request's tokens (yet): only its own tokens' blocks are known.
        full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if full <= request.num_blocks_remembered:
            return
        hashes = self._block_hashes(request, full)
        for index in range(request.num_blocks_remembered, full):
            self.blocks.remember(request.block_ids[index], hashes[index])
        request.num_blocks_remembered = full

    def _block_hashes(self, request: Request, count: int) -> list[bytes]:
        """The hashes of ``request``'s first ``count`` whole blocks: each one's digest of the
        one before and its own tokens (so equal hashes mean equal tokens from the start)."""
        hashes, size = request.block_hashes, self.block_size
        if len(hashes) < count:
            tokens = request.all_token_ids
            while len(hashes) < count:
                start = len(hashes) * size
                digest = hashlib.blake2b(hashes[-1] if hashes else b"", digest_size=16)
                digest.update(array("q", tokens[start : start + size]).tobytes())
                hashes.append(digest.digest())
        return hashes[:count]

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
