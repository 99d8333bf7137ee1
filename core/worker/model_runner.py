"""The model runner of decoder-only language models: request state, batch building, a paged
KV cache, logits, sampling and pooling, for any model that runs one pipeline stage over a
paged cache (:class:`CausalLM`). A model family says only how to build and load its model
(:meth:`CausalLMRunner.build_model`); the Llama family is
:class:`shardline.models.llama_runner.LlamaModelRunner`.

The rank's device (:func:`rank_device`) is data: the model and its cache are built with it
as torch's default device, each step's inputs are moved there once, and only the sampled
token ids (and pooled vectors) come back to the host."""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from shardline.config.schema import EngineConfig
from shardline.distributed import ParallelState
from shardline.interfaces import IntermediateTensors, ModelRunner
from shardline.interfaces.step import (
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
    TokenLogprobs,
)
from shardline.launch.launcher_env import local_rank
from shardline.layers.attention import AttentionMetadata, KVCache
from shardline.profiling import NO_TIMER, StepTimer
from shardline.worker.sampler import (
    adjust_logits,
    sample_rows,
    token_logprobs,
)


def rank_device(kind: str, rank: int, environ: Mapping[str, str] = os.environ) -> torch.device:
    """Where ``rank`` computes for ``parallel.device = kind``: the CPU, or the CUDA device of
    its rank on its host (``cuda:{local_rank}``, the launcher's local rank in ``environ``)."""
    if kind == "cuda":
        return torch.device("cuda", local_rank(rank, environ))
    return torch.device(kind)


class CausalLM(Protocol):
    """One pipeline stage of a decoder-only model, as the runner drives it."""

    def __call__(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_caches: dict[int, KVCache],
        intermediate: IntermediateTensors | None,
    ) -> torch.Tensor | IntermediateTensors:
        """The final hidden states ``[N, hidden]`` on the last stage, else the tensors the
        next stage needs."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` (last stage), equal on every TP rank."""

    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N]``: each row's argmax of :meth:`compute_logits` (the first
        of equal maxima), equal on every TP rank; a model may avoid making the full logits."""

    def make_kv_caches(self, num_blocks: int, block_size: int) -> dict[int, KVCache]:
        """An empty paged cache for every layer of this stage."""

    #: Optional (1 when absent): the most queries of one sequence its attention takes row by
    #: row in the decode path (``AttentionMetadata.row_wise_queries``).
    row_wise_queries: int


#: Prompt rows whose full-vocabulary logits are made at once (a bound on the memory they take).
_PROMPT_ROWS_AT_ONCE = 256


@dataclass
class RequestState:
    """What a rank remembers of a request between steps."""

    token_ids: list[int]
    block_ids: list[int]
    sampling: SamplingParams
    #: The first tokens of ``token_ids`` that are prompt; the rest are output.
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    pooling: str | None = None
    hidden_sum: torch.Tensor | None = None
    #: This step's drafts (speculative decoding): computed after ``token_ids``, not part of it.
    spec_token_ids: tuple[int, ...] = ()


class CausalLMRunner(ModelRunner):
    """Runs this rank's pipeline stage of a decoder-only model over a paged KV cache.

    ``timer`` marks the parts of a step outside the model ("prepare inputs", "sampling");
    a profiler sets it (:meth:`shardline.worker.worker.Worker.start_profile`)."""

    prefix_caching = True
    speculative_decoding = True

    def __init__(self, config: EngineConfig, state: ParallelState) -> None:
        self.config = config
        self.state = state
        self.requests: dict[str, RequestState] = {}
        self.model: CausalLM | None = None
        self.kv_caches: dict[int, KVCache] = {}
        self.device = rank_device(config.parallel.device, state.rank)
        #: Draws every sampled token (seeded for each draw from its request's seed).
        self.generator = torch.Generator(device=self.device)
        self.timer: StepTimer = NO_TIMER

    @abc.abstractmethod
    def build_model(self) -> CausalLM:
        """This rank's stage of the model, with only this rank's shard of the weights loaded
        (``self.config.model``, ``self.state``). Called with ``self.device`` as torch's
        default device: tensors made without a device argument land there."""

    def load_model(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        with self.device:
            self.model = self.build_model()
            self.kv_caches = self.model.make_kv_caches(
                self.config.cache.num_blocks, self.config.cache.block_size
            )

    def execute_model(
        self, scheduler_output: SchedulerOutput, intermediate_tensors: IntermediateTensors | None
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        if self.model is None:
            raise RuntimeError("execute_model before load_model")
        with self.timer("prepare inputs"):
            self._update_states(scheduler_output)
            if scheduler_output.total_num_scheduled_tokens == 0:
                return None
            req_ids, input_ids, positions, metadata, final_rows = self._prepare_inputs(
                scheduler_output
            )
        output = self.model(input_ids, positions, metadata, self.kv_caches, intermediate_tensors)
        if isinstance(output, IntermediateTensors):
            return output
        pooling = [self.requests[req_id].pooling is not None for req_id in req_ids]
        if any(pooling):
            if not all(pooling):
                raise ValueError("a step mixes embedding (pooling) and generating requests")
            return self._pool_hidden(output, req_ids, metadata.query_start_loc, final_rows)
        prompt_scores = self._score_prompts(output, req_ids, metadata)
        if all(row is None for row in final_rows):
            return ModelRunnerOutput(req_ids, [None] * len(req_ids), prompt_logprobs=prompt_scores)
        # The rows sampled: each finishing request's last row, after the rows of its drafts.
        # A draft row is sampled as if the drafts before it were the request's tokens (its
        # history, its output token's index and so its seeded draw): where they are accepted,
        # each row's token is the one a step without drafts would choose.
        rows, finishing, output_indexes, histories = [], [], [], []
        for req_id, row in zip(req_ids, final_rows, strict=True):
            if row is None:
                continue
            request = self.requests[req_id]
            drafts = request.spec_token_ids
            rows += range(row - len(drafts), row + 1)
            finishing += [request] * (len(drafts) + 1)
            first_output = len(request.token_ids) - request.num_prompt_tokens
            output_indexes += range(first_output, first_output + len(drafts) + 1)
            if request.sampling.adjusts_logits:
                histories += [request.token_ids + list(drafts[:i]) for i in range(len(drafts) + 1)]
            else:
                histories += [request.token_ids] * (len(drafts) + 1)
        params = [request.sampling for request in finishing]
        asked = [p.logprobs for p in params]
        found = None
        if all(p.temperature == 0 and p.logprobs is None and not p.adjusts_logits for p in params):
            greedy = self.model.greedy_token_ids(output[rows])
            with self.timer("sampling"):
                tokens = greedy.tolist()
        else:
            logits = self.model.compute_logits(output[rows])
            with self.timer("sampling"):
                chosen_from = logits
                if any(p.adjusts_logits for p in params):
                    chosen_from = adjust_logits(
                        logits,
                        params,
                        histories,
                        [request.num_prompt_tokens for request in finishing],
                    )
                tokens = sample_rows(chosen_from, params, output_indexes, self.generator)
                if any(k is not None for k in asked):
                    found = token_logprobs(logits, tokens, asked)
        sampled: list[int | None] = []
        accepted: list[int] = []
        logprobs = None if found is None else []
        draft_logprobs = None if found is None else []
        at = 0  # the first row of the request's sampled rows
        for req_id, row in zip(req_ids, final_rows, strict=True):
            drafts = () if row is None else self.requests[req_id].spec_token_ids
            kept = _accepted_drafts(drafts, tokens[at : at + len(drafts)])
            sampled.append(None if row is None else tokens[at + kept])
            accepted.append(kept)
            if found is not None:
                logprobs.append(None if row is None else found[at + kept])
                draft_logprobs.append(found[at : at + kept] if drafts else None)
            at += 0 if row is None else len(drafts) + 1
        with_drafts = any(r.spec_token_ids for r in finishing)
        return ModelRunnerOutput(
            req_ids,
            sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_scores,
            num_accepted_drafts=accepted if with_drafts else None,
            draft_logprobs=draft_logprobs if with_drafts else None,
        )

    def _score_prompts(
        self, hidden: torch.Tensor, req_ids: list[str], metadata: AttentionMetadata
    ) -> list[tuple[int, list[TokenLogprobs]] | None] | None:
        """For the requests that ask for prompt log-probabilities: the scores of the prompt
        tokens this step's rows predict (the row of position q predicts token q + 1), with
        the index of the first; None when no request of the step asks."""
        asking = [self.requests[r].sampling.prompt_logprobs is not None for r in req_ids]
        if not any(asking):
            return None
        starts, seq_lens = metadata.query_start_loc, metadata.seq_lens
        found: list[tuple[int, list[TokenLogprobs]] | None] = [None] * len(req_ids)
        with self.timer("sampling"):
            for i, req_id in enumerate(req_ids):
                request = self.requests[req_id]
                if not asking[i]:
                    continue
                first = seq_lens[i] - (starts[i + 1] - starts[i])  # this step's first position
                count = min(seq_lens[i], request.num_prompt_tokens - 1) - first
                if count <= 0:
                    continue
                targets = request.token_ids[first + 1 : first + 1 + count]
                k = request.sampling.prompt_logprobs
                scores: list[TokenLogprobs] = []
                for block in range(0, count, _PROMPT_ROWS_AT_ONCE):
                    rows = slice(
                        starts[i] + block, starts[i] + min(count, block + _PROMPT_ROWS_AT_ONCE)
                    )
                    logits = self.model.compute_logits(hidden[rows])
                    chunk = targets[block : block + _PROMPT_ROWS_AT_ONCE]
                    scores += token_logprobs(logits, chunk, [k] * len(chunk))
                found[i] = (first + 1, scores)
        return found

    def _pool_hidden(
        self,
        hidden: torch.Tensor,
        req_ids: list[str],
        starts: list[int],
        final_rows: list[int | None],
    ) -> ModelRunnerOutput:
        """Fold this step's final hidden states into each pooling request; a request whose
        prompt is now complete gets its vector (L2-normalized when configured)."""
        vectors: list[torch.Tensor | None] = []
        for index, req_id in enumerate(req_ids):
            request = self.requests[req_id]
            rows = hidden[starts[index] : starts[index + 1]].float()
            if request.pooling == "mean":
                chunk_sum = rows.sum(dim=0)
                request.hidden_sum = (
                    chunk_sum if request.hidden_sum is None else request.hidden_sum + chunk_sum
                )
            if final_rows[index] is None:
                vectors.append(None)
                continue
            if request.pooling == "mean":
                vector = request.hidden_sum / len(request.token_ids)
            else:
                vector = rows[-1].clone()
            if self.config.model.normalize_embeddings:
                vector = torch.nn.functional.normalize(vector, dim=0)
            vectors.append(vector.cpu())
        return ModelRunnerOutput(req_ids, [None] * len(req_ids), pooled=vectors)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.new_requests:
            self.requests[new.req_id] = RequestState(
                list(new.prompt_token_ids),
                list(new.block_ids),
                new.sampling,
                len(new.prompt_token_ids) - new.num_output_tokens,
                num_computed_tokens=new.num_computed_tokens,
                pooling=new.pooling,
            )
        for cached in scheduler_output.cached_requests:
            request = self.requests.get(cached.req_id)
            if request is None:
                raise ValueError(
                    f"scheduler continued request {cached.req_id!r}, which this rank never saw"
                )
            request.token_ids.extend(cached.new_token_ids)
            request.block_ids.extend(cached.new_block_ids)
            request.num_computed_tokens = cached.num_computed_tokens
            request.spec_token_ids = tuple(cached.spec_token_ids)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput):
        """Flattened token ids and positions and the attention metadata, on the rank's device,
        and for each request the batch row whose logits are sampled (None for a prompt chunk
        that is not the last)."""
        block_size = self.config.cache.block_size
        req_ids, tokens, positions, slots = [], [], [], []
        starts, seq_lens, tables, final_rows = [0], [], [], []
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            first = request.num_computed_tokens
            seq_len = first + count
            drafts = request.spec_token_ids
            if seq_len > len(request.token_ids) + len(drafts) or (
                drafts and seq_len != len(request.token_ids) + len(drafts)
            ):
                raise ValueError(
                    f"request {req_id!r}: {count} tokens scheduled from {first}, but it has "
                    f"{len(request.token_ids)} and {len(drafts)} drafts"
                    + (" (a step with drafts computes all of them)" if drafts else "")
                )
            if seq_len > len(request.block_ids) * block_size:
                raise ValueError(
                    f"request {req_id!r}: {seq_len} tokens need {-(-seq_len // block_size)} cache "
                    f"blocks, the scheduler gave {len(request.block_ids)}"
                )
            req_ids.append(req_id)
            tokens += request.token_ids[first:seq_len]
            tokens += drafts
            positions += range(first, seq_len)
            slots += [
                request.block_ids[p // block_size] * block_size + p % block_size
                for p in range(first, seq_len)
            ]
            starts.append(starts[-1] + count)
            seq_lens.append(seq_len)
            tables.append(request.block_ids)
            complete = seq_len == len(request.token_ids) + len(drafts)
            final_rows.append(starts[-1] - 1 if complete else None)
            request.num_computed_tokens = seq_len
        device = self.device
        metadata = AttentionMetadata(
            starts,
            seq_lens,
            torch.tensor(slots, dtype=torch.long, device=device),
            tables,
            device,
            row_wise_queries=getattr(self.model, "row_wise_queries", 1),
        )
        return (
            req_ids,
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            metadata,
            final_rows,
        )


def _accepted_drafts(drafts: tuple[int, ...], chosen: list[int]) -> int:
    """How many ``drafts`` the model accepts: those up to the first that differs from the
    token chosen at its place (``chosen[i]`` is the choice after the tokens before draft i)."""
    for kept, (draft, token) in enumerate(zip(drafts, chosen, strict=True)):
        if draft != token:
            return kept
    return len(drafts)
