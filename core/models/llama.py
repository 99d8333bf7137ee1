"""A tensor- and pipeline-parallel Llama decoder (RMSNorm, RoPE, GQA attention, SwiGLU).

Each rank builds only its pipeline stage: the first stage owns the embedding, the last the
final norm and LM head; stages exchange ``hidden_states`` and ``residual``. Inside a stage,
attention and MLP are column-parallel in, row-parallel out (one all-reduce each).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardline.distributed import GroupCoordinator, ParallelState
from shardline.errors import ConfigError
from shardline.interfaces import IntermediateTensors
from shardline.layers.attention import (
    AttentionMetadata,
    KVCache,
    PagedAttention,
    attention_kernels,
)
from shardline.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardline.layers.kernels import (
    TORCH_KERNELS,
    KVHeadIndex,
    LayerBlocks,
    LayerStack,
    TorchKernels,
)
from shardline.layers.linear import (
    LinearPacking,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    copy_into,
)
from shardline.layers.norm import RMSNorm
from shardline.layers.rotary import RotaryEmbedding
from shardline.layers.sharding import ShardSlice, TensorSource
from shardline.models.architecture import (
    LlamaArchitecture,
    check_tensor_parallel,
    expected_shape,
    partition_layers,
)
from shardline.profiling import NO_TIMER, StepTimer

#: Reads a full checkpoint tensor by its HF name (lazily: only the parts indexed are read).
WeightLookup = Callable[[str], TensorSource]


class LlamaAttention(nn.Module):
    def __init__(
        self, arch: LlamaArchitecture, tp: GroupCoordinator, dtype, kernels: TorchKernels
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_heads,
            arch.num_kv_heads,
            tp,
            bias=arch.attention_bias,
            dtype=dtype,
            kernels=kernels,
        )
        heads = self.qkv_proj.heads
        self.o_proj = RowParallelLinear(
            arch.num_heads * arch.head_dim,
            arch.hidden_size,
            tp,
            bias=arch.attention_bias,
            input_shard=ShardSlice(
                1, heads.q_start * arch.head_dim, heads.num_heads * arch.head_dim
            ),
            dtype=dtype,
            kernels=kernels,
        )
        kv_index = KVHeadIndex.of(torch.tensor(heads.kv_index_of_query_heads()))
        self.attn = PagedAttention(arch.head_dim**-0.5, kv_index, kernels)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        cache: KVCache,
    ) -> torch.Tensor:
        """``rope``: the step's ``(cos, sin)`` (:meth:`RotaryEmbedding.at`)."""
        heads = self.qkv_proj.heads
        q = self.kernels.rotate_and_store(
            self.qkv_proj(hidden), heads.num_heads, heads.num_kv_heads, rope, cache,
            metadata.slot_mapping,
        )  # fmt: skip
        return self.o_proj(self.attn(q, cache, metadata))

    def load(self, prefix: str, weight: WeightLookup, has_bias: bool) -> None:
        for name in "qkv":
            bias = weight(f"{prefix}.{name}_proj.bias") if has_bias else None
            self.qkv_proj.load_part(name, weight(f"{prefix}.{name}_proj.weight"), bias)
        self.o_proj.load_full(
            weight(f"{prefix}.o_proj.weight"), weight(f"{prefix}.o_proj.bias") if has_bias else None
        )


class LlamaMLP(nn.Module):
    def __init__(
        self, arch: LlamaArchitecture, tp: GroupCoordinator, dtype, kernels: TorchKernels
    ) -> None:
        super().__init__()
        self.kernels = kernels
        size = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, [size, size], tp, bias=arch.mlp_bias, dtype=dtype, kernels=kernels
        )
        self.down_proj = RowParallelLinear(
            size, arch.hidden_size, tp, bias=arch.mlp_bias, dtype=dtype, kernels=kernels
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(hidden)))

    def load(self, prefix: str, weight: WeightLookup, has_bias: bool) -> None:
        for index, name in enumerate(("gate_proj", "up_proj")):
            bias = weight(f"{prefix}.{name}.bias") if has_bias else None
            self.gate_up_proj.load_part(index, weight(f"{prefix}.{name}.weight"), bias)
        bias = weight(f"{prefix}.down_proj.bias") if has_bias else None
        self.down_proj.load_full(weight(f"{prefix}.down_proj.weight"), bias)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, arch: LlamaArchitecture, tp: GroupCoordinator, dtype, kernels: TorchKernels
    ) -> None:
        super().__init__()
        self.kernels = kernels
        #: The layer's fused calls (:meth:`prepare_blocks`); None: the modules run.
        self.blocks: LayerBlocks | None = None
        eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, dtype, kernels)
        self.self_attn = LlamaAttention(arch, tp, dtype, kernels)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, dtype, kernels)
        self.mlp = LlamaMLP(arch, tp, dtype, kernels)

    def forward(self, hidden, residual, rope, metadata, cache, timer: StepTimer = NO_TIMER):
        """Returns ``(hidden, residual)`` with the last add deferred to the next layer.

        In a step of decodes only, each half of the layer (attention, MLP) is one call of the
        kernels where they have one (:meth:`prepare_blocks` found them): the same operations
        on the same values as the modules one by one, without a Python call per operation;
        ``timer`` then gets the matmul and attention time measured inside the call. Otherwise
        the modules run."""
        decode = metadata.decode_batch(cache.block_size)
        fused = self.blocks is not None and decode is not None and decode.rows is None
        attn, mlp = self.self_attn, self.mlp
        block = None
        if fused:
            block = self.kernels.attention_block(
                self.blocks, hidden, residual, rope, cache, metadata.slot_mapping, decode, timer
            )
        if block is not None:
            partial, residual = block
            hidden = attn.o_proj.reduce(partial)
        elif residual is None:
            residual = hidden
            hidden = attn(self.input_layernorm(hidden), rope, metadata, cache)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
            hidden = attn(hidden, rope, metadata, cache)
        block = self.kernels.mlp_block(self.blocks, hidden, residual, timer) if fused else None
        if block is not None:
            partial, residual = block
            return mlp.down_proj.reduce(partial), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return mlp(hidden), residual

    def prepare_blocks(self) -> None:
        """Ask the kernels for one call per half of the layer (after the weights are loaded and
        packed; the blocks hold the weights as they are now)."""
        attn, mlp = self.self_attn, self.mlp
        heads = attn.qkv_proj.heads
        self.blocks = self.kernels.layer_blocks(
            input_norm=(self.input_layernorm.weight, self.input_layernorm.eps),
            qkv=(attn.qkv_proj.weight, attn.qkv_proj.bias),
            heads=(heads.num_heads, heads.num_kv_heads, attn.qkv_proj.head_dim),
            kv_index=attn.attn.kv_index, scale=attn.attn.scale,
            o_proj=(attn.o_proj.weight, attn.o_proj.bias),
            post_norm=(self.post_attention_layernorm.weight, self.post_attention_layernorm.eps),
            gate_up=(mlp.gate_up_proj.weight, mlp.gate_up_proj.bias),
            down=(mlp.down_proj.weight, mlp.down_proj.bias),
        )  # fmt: skip

    def load(self, prefix: str, weight: WeightLookup, arch: LlamaArchitecture) -> None:
        for norm in ("input_layernorm", "post_attention_layernorm"):
            name = f"{prefix}.{norm}.weight"
            copy_into(getattr(self, norm).weight, weight(name)[:], name)
        self.self_attn.load(f"{prefix}.self_attn", weight, arch.attention_bias)
        self.mlp.load(f"{prefix}.mlp", weight, arch.mlp_bias)


class LlamaForCausalLM(nn.Module):
    """One pipeline stage of a Llama model, sharded over the rank's TP group; the operations
    between weight multiplies run on ``kernels`` (:func:`~shardline.layers.kernels.layer_kernels`
    picks them)."""

    def __init__(
        self,
        arch: LlamaArchitecture,
        state: ParallelState,
        dtype: torch.dtype = torch.float32,
        kernels: TorchKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        tp, pp = state.tp, state.pp
        check_tensor_parallel(arch, tp.world_size)
        self.arch = arch
        self.dtype = dtype
        self.tp = tp
        self.kernels = kernels
        #: The most queries of one sequence a step's attention takes row by row.
        self.row_wise_queries = kernels.row_wise_queries(dtype)
        #: Every layer for one decode_layers call, made for the caches in _stack_caches.
        self._stack: LayerStack | None = None
        self._stack_caches: dict[int, KVCache] | None = None
        #: Gets the time of parts measured inside fused kernel calls while profiling.
        self.timer: StepTimer = NO_TIMER
        self.layer_range = partition_layers(arch.num_layers, pp.world_size, pp.rank_in_group)
        self.is_first_stage = pp.is_first_rank
        self.is_last_stage = pp.is_last_rank
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.max_positions)
        self.embed_tokens = (
            VocabParallelEmbedding(
                arch.vocab_size, arch.hidden_size, tp, dtype=dtype, kernels=kernels
            )
            if self.is_first_stage
            else None
        )
        self.layers = nn.ModuleDict(
            {str(i): LlamaDecoderLayer(arch, tp, dtype, kernels) for i in self.layer_range}
        )
        if self.is_last_stage:
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, kernels)
            tied = self.embed_tokens if arch.tie_word_embeddings else None
            self.lm_head = ParallelLMHead(
                arch.vocab_size, arch.hidden_size, tp, tied_to=tied, dtype=dtype, kernels=kernels
            )
        first_layer = self.layers[str(self.layer_range.start)]
        self.kv_heads_per_rank = first_layer.self_attn.qkv_proj.heads.num_kv_heads

    def make_kv_caches(self, num_blocks: int, block_size: int) -> dict[int, KVCache]:
        """An empty paged cache for every layer of this stage."""
        return {
            i: KVCache(
                num_blocks, block_size, self.kv_heads_per_rank, self.arch.head_dim, self.dtype
            )
            for i in self.layer_range
        }

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_caches: dict[int, KVCache],
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """First stage: from ``input_ids``; others: from ``intermediate``. Returns the final
        normalized hidden states ``[N, hidden]`` on the last stage, else IntermediateTensors."""
        longest = max(metadata.seq_lens, default=0)
        if longest > self.arch.max_positions:
            raise ValueError(
                f"position {longest - 1} is past the model's context "
                f"of {self.arch.max_positions} tokens"
            )
        if self.is_first_stage:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate["hidden_states"], intermediate["residual"]
        rope = self.rotary.at(positions)
        stacked = self._decode_layers(hidden, residual, rope, metadata, kv_caches)
        if stacked is not None:
            hidden, residual = stacked
        else:
            with attention_kernels():  # torch's attention, in the layers one by one
                for i in self.layer_range:
                    hidden, residual = self.layers[str(i)](
                        hidden, residual, rope, metadata, kv_caches[i], self.timer
                    )
        if not self.is_last_stage:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _decode_layers(self, hidden, residual, rope, metadata, kv_caches):
        """Every layer in one kernels call (:meth:`~TorchKernels.decode_layers`) in a step of
        decodes only, where the kernels and the TP communicator have it; else None."""
        first_cache = kv_caches[self.layer_range.start]
        decode = metadata.decode_batch(first_cache.block_size)
        if decode is None or decode.rows is not None:
            return None
        if self._stack is None or self._stack_caches is not kv_caches:
            self._stack_caches = kv_caches
            self._stack = self.kernels.layer_stack(
                [self.layers[str(i)].blocks for i in self.layer_range],
                [kv_caches[i] for i in self.layer_range],
            )
        if self._stack is None:
            return None
        return self.kernels.decode_layers(
            self._stack, hidden, residual, rope, metadata.slot_mapping, decode, self.tp,
            self.timer,
        )  # fmt: skip

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` (last stage only), equal on every TP rank."""
        return self.lm_head(hidden)

    @torch.inference_mode()
    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N]``: the argmax of :meth:`compute_logits` (last stage only),
        equal on every TP rank, with no logits gathered."""
        return self.lm_head(hidden, greedy=True)

    def load_weights(self, weight: WeightLookup, source: str = "checkpoint") -> None:
        """Load this rank's shard of this stage's weights, by HF tensor name, packing each
        layer for the CPU's fastest kernel once it is loaded
        (:class:`~shardline.layers.linear.LinearPacking`: one layer's unpacked weights held at
        a time). Every tensor's full shape is checked against the config first: a mismatch is
        a ConfigError naming ``source`` and the tensor."""
        arch = self.arch
        packing = LinearPacking(self)

        def checked(name: str) -> TensorSource:
            tensor = weight(name)
            expected = expected_shape(arch, name)
            if tuple(tensor.shape) != expected:
                raise ConfigError(
                    f"{source}: tensor {name} has shape {tuple(tensor.shape)}; the model config "
                    f"implies {expected}"
                )
            return tensor

        if self.embed_tokens is not None:
            self.embed_tokens.load_full(checked("model.embed_tokens.weight"))
        for i in self.layer_range:
            self.layers[str(i)].load(f"model.layers.{i}", checked, arch)
            packing.pack(self.layers[str(i)])
        if self.is_last_stage:
            copy_into(self.norm.weight, checked("model.norm.weight")[:], "model.norm.weight")
            if not arch.tie_word_embeddings:
                self.lm_head.load_full(checked("lm_head.weight"))
            elif self.embed_tokens is None:
                # Tied head on a stage without the embedding: load the shared table here.
                self.lm_head.load_full(checked("model.embed_tokens.weight"))
        packing.pack(self)
        for layer in self.layers.values():
            layer.prepare_blocks()
        self._stack = self._stack_caches = None  # made again from the new blocks
