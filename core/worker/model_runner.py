"""The Llama ModelRunner: request state, batch building, paged KV cache, logits, sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardline.config.schema import EngineConfig
from shardline.distributed import ParallelState
from shardline.dtypes import torch_dtype
from shardline.interfaces import IntermediateTensors, ModelRunner
from shardline.layers.attention import AttentionMetadata, KVCache
from shardline.models.llama import LlamaForCausalLM
from shardline.models.memory import LlamaPlan
from shardline.weights import open_checkpoint
from shardline.worker.sampler import make_generator, sample
from shardline.worker.types import ModelRunnerOutput, SamplingParams, SchedulerOutput


@dataclass
class RequestState:
    """What a rank remembers of a request between steps."""

    token_ids: list[int]
    block_ids: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    num_computed_tokens: int = 0
    pooling: str | None = None
    hidden_sum: torch.Tensor | None = None


class LlamaModelRunner(ModelRunner):
    """Runs this rank's pipeline stage of a Llama model over a paged KV cache."""

    @classmethod
    def plan(cls, config: EngineConfig) -> LlamaPlan:
        """The layout checked against the checkpoint's architecture (its metadata only), and
        what each rank will hold."""
        return LlamaPlan.of(open_checkpoint(config.model.path).architecture, config)

    def __init__(self, config: EngineConfig, state: ParallelState) -> None:
        self.config = config
        self.state = state
        self.requests: dict[str, RequestState] = {}
        self.model: LlamaForCausalLM | None = None
        self.kv_caches: dict[int, KVCache] = {}
        self._pooled: ModelRunnerOutput | None = None

    def load_model(self) -> None:
        checkpoint = open_checkpoint(self.config.model.path)
        model = LlamaForCausalLM(
            checkpoint.architecture, self.state, torch_dtype(self.config.model.dtype)
        )
        model.load_weights(checkpoint.tensor, source=str(self.config.model.path))
        self.model = model
        self.kv_caches = model.make_kv_caches(
            self.config.cache.num_blocks, self.config.cache.block_size
        )

    def execute_model(
        self, scheduler_output: SchedulerOutput, intermediate_tensors: IntermediateTensors | None
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        if self.model is None:
            raise RuntimeError("execute_model before load_model")
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return None
        req_ids, input_ids, positions, metadata, sample_rows = self._prepare_inputs(
            scheduler_output
        )
        output = self.model(input_ids, positions, metadata, self.kv_caches, intermediate_tensors)
        if isinstance(output, IntermediateTensors):
            return output
        pooling = [self.requests[req_id].pooling is not None for req_id in req_ids]
        if any(pooling):
            if not all(pooling):
                raise ValueError("a step mixes embedding (pooling) and generating requests")
            self._pooled = self._pool_hidden(output, req_ids, metadata.query_start_loc, sample_rows)
            return None
        rows = [row for row in sample_rows if row is not None]
        logits = self.model.compute_logits(output[rows]) if rows else None
        sampled: list[int | None] = []
        picked = 0
        for req_id, row in zip(req_ids, sample_rows, strict=True):
            if row is None:
                sampled.append(None)
                continue
            request = self.requests[req_id]
            sampled.append(sample(logits[picked], request.sampling, request.generator))
            picked += 1
        return ModelRunnerOutput(req_ids, sampled)

    def pool(self) -> ModelRunnerOutput | None:
        """The embeddings of the last step when it ran pooling requests (then cleared)."""
        pooled, self._pooled = self._pooled, None
        return pooled

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
            vectors.append(vector)
        return ModelRunnerOutput(req_ids, [None] * len(req_ids), pooled=vectors)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.new_requests:
            self.requests[new.req_id] = RequestState(
                list(new.prompt_token_ids),
                list(new.block_ids),
                new.sampling,
                make_generator(new.sampling),
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

    def _prepare_inputs(self, scheduler_output: SchedulerOutput):
        """Flattened token ids and positions, attention metadata, and for each request the
        batch row whose logits are sampled (None for a prompt chunk that is not the last)."""
        block_size = self.config.cache.block_size
        req_ids, tokens, positions, slots = [], [], [], []
        starts, seq_lens, tables, sample_rows = [0], [], [], []
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            first = request.num_computed_tokens
            seq_len = first + count
            if seq_len > len(request.token_ids):
                raise ValueError(
                    f"request {req_id!r}: {count} tokens scheduled from {first}, but it has only "
                    f"{len(request.token_ids)}"
                )
            if seq_len > len(request.block_ids) * block_size:
                raise ValueError(
                    f"request {req_id!r}: {seq_len} tokens need {-(-seq_len // block_size)} cache "
                    f"blocks, the scheduler gave {len(request.block_ids)}"
                )
            req_ids.append(req_id)
            tokens += request.token_ids[first:seq_len]
            positions += range(first, seq_len)
            slots += [
                request.block_ids[p // block_size] * block_size + p % block_size
                for p in range(first, seq_len)
            ]
            starts.append(starts[-1] + count)
            seq_lens.append(seq_len)
            tables.append(request.block_ids)
            sample_rows.append(starts[-1] - 1 if seq_len == len(request.token_ids) else None)
            request.num_computed_tokens = seq_len
        metadata = AttentionMetadata(
            starts, seq_lens, torch.tensor(slots, dtype=torch.long), tables
        )
        return (
            req_ids,
            torch.tensor(tokens, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            metadata,
            sample_rows,
        )
