"""What each rank of a Llama model holds, in bytes, computed from the architecture alone
(nothing loaded): the sizes of its weight shards as the parallel layers cut them, its KV-cache
block, and an upper estimate of the activations of its largest step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardline.config.schema import EngineConfig
from shardline.errors import ConfigError
from shardline.interfaces import ModelPlan, RankMemory
from shardline.layers.kernels import held_weight_dtype, packs, screens_greedy_head
from shardline.layers.sharding import head_shard, vocab_shard
from shardline.models.architecture import (
    LlamaArchitecture,
    partition_layers,
    pipeline_parallel_problem,
    tensor_parallel_problem,
)

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: Logits and attention scores are computed in float32 whatever the weights' dtype.
_FLOAT32 = 4
#: Bytes of one output's group of 32 inputs held in each GGUF block kind (float16 scale,
#: Q4_1's float16 minimum, the values; Q4_K: a float32 scale and offset, 16 bytes of nibbles;
#: Q5_K: Q4_K's and 4 bytes of fifth bits; Q6_K: two float32 scales, 32 int8; INT8_SCALED: two
#: float32 scales and offsets, 32 int8; the code kinds: Q4_K's bytes, Q4_1's with float16
#: scales and offsets, or Q8_0's), in blocks of 64 outputs (``quantized_blocks.h``).
_BLOCK_GROUP_BYTES = {
    "Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 24, "Q5_K": 28, "Q6_K": 40, "INT8_SCALED": 48,
    "Q4_CODES": 24, "Q4_CODES_F16": 20, "Q8_CODES_F16": 34,
}  # fmt: skip
_GROUP, _BLOCK_OUTPUTS = 32, 64
#: The file's block types each kind holds (``quantized_blocks.h``: holds_type), in the order
#: a weight's kind is chosen: the first that holds all of its parts' types.
_HOLDS = {
    "Q4_0": ("Q4_0",),
    "Q4_1": ("Q4_1",),
    "Q4_K": ("Q4_K",),
    "Q5_K": ("Q5_K", "Q5_1", "Q4_K", "Q4_1"),
    "Q8_0": ("Q8_0", "Q4_0", "Q5_0", "IQ4_NL"),
    "Q6_K": ("Q6_K", "Q3_K", "Q8_0", "Q4_0", "Q5_0", "IQ4_NL"),
    "INT8_SCALED": ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL",
                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
}  # fmt: skip
#: The types the code kinds hold (``model.activation_dtype: int8``: tried before the others).
#: A Q4_0 weight with a scale past 8188, whose -8 scales float16 cannot hold, takes Q4_0's
#: own kind: fewer bytes than planned.
_CODE_HOLDS = {
    "Q4_CODES_F16": ("Q4_0", "Q4_1"),
    "Q4_CODES": ("Q4_K",),
    "Q8_CODES_F16": ("Q8_0", "Q5_0", "IQ4_NL"),
}
#: The inputs one block of a file's type spans: a shard that cuts one is held in float32.
_K_TYPES, _SUPER_BLOCK = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"), 256
#: A weight held in segments (``quantized_blocks.h``: SegmentTable): the table's bytes, and
#: the most runs of parts of one kind it holds.
_SEGMENT_TABLE_BYTES, _SEGMENTS_MAX = 64, 7


@dataclass(frozen=True)
class HeldKind:
    """How one weight is held (``model.weight_dtype: gguf``): ``kind``, a block kind
    (``Q4_0``, ``Q4_1``, ``Q4_K``, ``Q5_K``, ``Q8_0``, ``Q6_K``, ``INT8_SCALED``,
    ``Q4_CODES_F16``, ``Q4_CODES``, ``Q8_CODES_F16``) or ``F32``, and ``inputs``, the inputs
    one of the file's blocks spans (a shard's inputs must be whole blocks); ``layers``, for a
    merged weight (q/k/v, gate/up), each different layer's one kind holding all its parts and
    each part's first kind, in row order: the kernels hold a layer whose parts' first kinds
    differ in segments of them, where the parts start on blocks of 64 outputs
    (:func:`merged_block_bytes`)."""

    kind: str
    inputs: int = _GROUP
    layers: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def of(cls, types: list[list[str]], codes: bool = False) -> HeldKind:
        """The kind a weight is held in, each of whose layers has parts of the file's
        ``types`` (a list a layer): the one with the most bytes among its layers', each
        layer's the first kind that holds all its parts' types (``F32`` where none does;
        with ``codes``, the code kinds first); with each different layer's kinds
        (``layers``)."""
        kinds = [_first_holding(parts, codes) for parts in types]
        inputs = _SUPER_BLOCK if any(t in _K_TYPES for parts in types for t in parts) else _GROUP
        layers = {(kind, tuple(_first_holding([part], codes) for part in parts)): None
                  for parts, kind in zip(types, kinds, strict=True)}  # fmt: skip
        return cls(max(kinds, key=_bytes_per_weight, default="F32"), inputs, tuple(layers))


def _first_holding(types: list[str], codes: bool = False) -> str:
    """The first block kind holding every one of ``types`` (``F32`` where none does; with
    ``codes``, the code kinds before the others)."""
    tried = {**_CODE_HOLDS, **_HOLDS} if codes else _HOLDS
    held = [kind for kind, holds in tried.items() if set(types) <= set(holds)]
    return held[0] if types and held else "F32"


@dataclass(frozen=True)
class HeldBlocks:
    """The GGUF block kinds a model's weights are held in (``model.weight_dtype: gguf``),
    one for each weight a layer multiplies by (the query, key and value projections merged;
    the output projection; gate and up merged; down), over every layer, and the LM head's."""

    qkv: HeldKind
    o: HeldKind
    gate_up: HeldKind
    down: HeldKind
    head: HeldKind

    @classmethod
    def of(cls, tensor_types: Mapping[str, str], tied: bool, codes: bool = False) -> HeldBlocks:
        """From the file's tensor types (GGUF name -> type name); ``codes``: weights of
        4-bit types and Q8_0 held as codes (``model.activation_dtype: int8``)."""
        layers: dict[str, dict[str, str]] = {}
        for name, kind in tensor_types.items():
            if name.startswith("blk.") and name.endswith(".weight"):
                _, layer, role, _ = name.split(".", 3)
                layers.setdefault(layer, {})[role] = kind

        def held(*roles: str) -> HeldKind:
            return HeldKind.of([
                [parts[role] for role in roles if role in parts]
                for parts in layers.values() if any(role in parts for role in roles)
            ], codes)  # fmt: skip

        head = tensor_types.get("token_embd.weight" if tied else "output.weight", "F32")
        return cls(
            held("attn_q", "attn_k", "attn_v"),
            held("attn_output"),
            held("ffn_gate", "ffn_up"),
            held("ffn_down"),
            HeldKind.of([[head]], codes),
        )


def _bytes_per_weight(kind: str) -> float:
    return _BLOCK_GROUP_BYTES[kind] / _GROUP if kind in _BLOCK_GROUP_BYTES else _FLOAT32


def in_blocks(held: HeldKind, in_features: int, first_input: int = 0) -> bool:
    """Whether a shard of ``in_features`` inputs (from ``first_input`` of the full row) is
    held as ``held``'s block kind: it is one, and the shard's inputs fall in whole blocks (else
    the kernel holds it in float32)."""
    return (
        held.kind in _BLOCK_GROUP_BYTES
        and in_features % held.inputs == 0
        and first_input % held.inputs == 0
    )


def block_bytes(
    held: HeldKind | str, out_features: int, in_features: int, first_input: int = 0
) -> int:
    """Bytes of an ``[out, in]`` weight shard held as ``held`` (a kind name: blocks of 32
    inputs): float32 where the kind is not a block kind or the shard's inputs (from
    ``first_input`` of the full row) do not fall in whole blocks, as the kernel then holds
    it."""
    held = HeldKind(held) if isinstance(held, str) else held
    if not in_blocks(held, in_features, first_input):
        return out_features * in_features * _FLOAT32
    outputs = -(-out_features // _BLOCK_OUTPUTS) * _BLOCK_OUTPUTS
    return outputs * in_features // _GROUP * _BLOCK_GROUP_BYTES[held.kind]


def merged_block_bytes(
    held: HeldKind, rows: Sequence[int], in_features: int, first_input: int = 0
) -> int:
    """Bytes of a merged weight shard (parts of ``rows`` rows each, in order: q/k/v or
    gate/up) held as ``held``: the most any of its ``layers`` takes (:func:`block_bytes` of
    ``kind`` where they are not known). A layer whose parts' first kinds differ and start on
    blocks of 64 outputs takes the segment table and each run of parts of one kind in its
    kind; any other layer its one kind."""
    total = sum(rows)
    if not held.layers:
        return block_bytes(held, total, in_features, first_input)
    starts = [sum(rows[:i]) for i in range(len(rows))]
    most = 0
    for kind, part_kinds in held.layers:
        layer = block_bytes(HeldKind(kind, held.inputs), total, in_features, first_input)
        if (
            len(set(part_kinds)) > 1 and len(part_kinds) == len(rows)
            and "F32" not in part_kinds and layer < total * in_features * _FLOAT32
            and not any(start % _BLOCK_OUTPUTS for start in starts)
        ):  # fmt: skip
            runs = [(part_kind, start)
                    for i, (part_kind, start) in enumerate(zip(part_kinds, starts, strict=True))
                    if i == 0 or part_kinds[i - 1] != part_kind]  # fmt: skip
            ends = [start for _, start in runs[1:]] + [total]
            if len(runs) <= _SEGMENTS_MAX:
                layer = _SEGMENT_TABLE_BYTES + sum(
                    block_bytes(HeldKind(part_kind, held.inputs), end - start, in_features)
                    for (part_kind, start), end in zip(runs, ends, strict=True)
                )
        most = max(most, layer)
    return most


@dataclass(frozen=True)
class LlamaPlan(ModelPlan):
    """The plan of ``arch`` over the config's tensor- and pipeline-parallel sizes."""

    arch: LlamaArchitecture
    dtype: str
    tp_size: int
    pp_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    #: Whether linear weights are packed for oneDNN (:func:`~shardline.layers.kernels.packs`):
    #: a tied LM head then holds its own packed copy of the embedding table.
    packed: bool = False
    #: The dtype the linear weights (and a packed LM head) are held in
    #: (:func:`~shardline.layers.kernels.held_weight_dtype`); None: ``dtype``.
    weight_dtype: str | None = None
    #: The GGUF block kinds they are held in instead, where they are (None: not).
    held_blocks: HeldBlocks | None = None
    #: Whether the kernels make a greedy screen of a head they hold blocked in float32 or
    #: bfloat16 (:func:`~shardline.layers.kernels.screens_greedy_head`): Q8_0 codes (in Q8_0
    #: or Q8_CODES_F16 blocks, of one size) and two float32 bounds an output, beside the head.
    screens_head: bool = False

    @classmethod
    def of(
        cls,
        arch: LlamaArchitecture,
        config: EngineConfig,
        environ: Mapping[str, str],
        held_blocks: HeldBlocks | None = None,
    ) -> LlamaPlan:
        """The plan, or a ConfigError listing every way the layout cannot hold the model;
        ``environ`` decides which kernels hold the weights (:func:`held_weight_dtype`), and
        ``held_blocks`` which GGUF block kinds hold them where the kernels do."""
        parallel = config.parallel
        problems = [
            problem
            for problem in (
                tensor_parallel_problem(arch, parallel.tensor_parallel_size),
                pipeline_parallel_problem(arch.num_layers, parallel.pipeline_parallel_size),
            )
            if problem is not None
        ]
        if len(problems) == 1:
            raise ConfigError(problems[0])
        if problems:
            raise ConfigError("the model does not fit the layout:\n  " + "\n  ".join(problems))
        return cls(
            arch,
            config.model.dtype,
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens,
            config.cache.block_size,
            packs(parallel.device, config.model.dtype),
            held_weight_dtype(
                parallel.device, config.model.dtype, config.model.weight_precision, environ
            ),
            held_blocks,
            config.model.dtype == "float32" and screens_greedy_head(parallel.device, environ),
        )

    @property
    def context_length(self) -> int:
        return self.arch.max_positions

    def rank_memory(
        self, pp_rank: int, tp_rank: int, max_model_len: int, cache_tokens: int
    ) -> RankMemory:
        arch, size = self.arch, _BYTES[self.dtype]
        held = _BYTES[self.weight_dtype or self.dtype]
        layers = len(partition_layers(arch.num_layers, self.pp_size, pp_rank))
        heads = head_shard(arch.num_heads, arch.num_kv_heads, self.tp_size, tp_rank)
        q, kv = heads.num_heads * arch.head_dim, heads.num_kv_heads * arch.head_dim
        mlp = arch.intermediate_size // self.tp_size
        hidden = arch.hidden_size
        linear = (q + 2 * kv) * hidden + hidden * q + 3 * mlp * hidden
        linear_bytes = linear * held
        if self.held_blocks is not None:
            blocks = self.held_blocks
            linear_bytes = (
                merged_block_bytes(blocks.qkv, (q, kv, kv), hidden)
                + block_bytes(blocks.o, hidden, q, heads.q_start * arch.head_dim)
                + merged_block_bytes(blocks.gate_up, (mlp, mlp), hidden)
                + block_bytes(blocks.down, hidden, mlp, tp_rank * mlp)
            )
        others = 2 * hidden  # the norms
        if arch.attention_bias:
            others += q + 2 * kv + hidden
        if arch.mlp_bias:
            others += 2 * mlp + hidden
        vocab_rows = vocab_shard(arch.vocab_size, self.tp_size, tp_rank).padded_per_rank
        first, last = pp_rank == 0, pp_rank == self.pp_size - 1
        shares_table = arch.tie_word_embeddings and first and not self.packed
        head_table = last and not shares_table
        # A packed head is held as the linear weights are; the embedding table as loaded.
        head_bytes = (held if self.packed else size) * vocab_rows * hidden
        head_kind = self.held_blocks.head if self.held_blocks is not None and self.packed else None
        if head_kind is not None:
            head_bytes = block_bytes(head_kind, vocab_rows, hidden)
        # A head held blocked in floats has its greedy screen beside it.
        floats = head_kind is None or not in_blocks(head_kind, hidden)
        if self.screens_head and self.packed and floats and hidden % _GROUP == 0:
            head_bytes += block_bytes("Q8_0", vocab_rows, hidden) + 2 * _FLOAT32 * vocab_rows
        weight_bytes = (
            layers * (linear_bytes + others * size)
            + int(first) * size * vocab_rows * hidden
            + int(head_table) * head_bytes
            + int(last) * hidden * size
        )
        # Loading converts one tensor shard at a time (GGUF dequantizes to float32 first).
        tables = int(first) + int(head_table)
        largest_shard = max(vocab_rows * hidden if tables else 0, mlp * hidden * 2, q * hidden)
        return RankMemory(
            weights=weight_bytes,
            loading=largest_shard * _FLOAT32,
            activations=self._activations(
                heads.num_heads, q, kv, mlp, vocab_rows, last, max_model_len, cache_tokens
            ),
            kv_cache_block=layers * 2 * self.block_size * kv * size,
        )

    def _activations(
        self,
        num_heads: int,
        q: int,
        kv: int,
        mlp: int,
        vocab_rows: int,
        last: bool,
        max_model_len: int,
        cache_tokens: int,
    ) -> int:
        """An upper estimate of one step's transient tensors (one layer's at a time): the
        per-token tensors of the step's token budget; attention over the cache, whichever is
        larger of a prefill chunk (keys, values and float32 scores of one sequence) and the
        batched decode (keys and values gathered for every running sequence); and on the last
        stage the logits of every sequence, local and gathered, in float32."""
        size = _BYTES[self.dtype]
        arch, tokens = self.arch, self.max_num_batched_tokens
        per_token = tokens * (4 * arch.hidden_size + q + 2 * kv + 3 * mlp) * size
        context = min(max_model_len, cache_tokens)
        prefill = context * (2 * q) * size + num_heads * min(tokens, context) * context * _FLOAT32
        gathered = min(self.max_num_seqs * max_model_len, cache_tokens)
        decode = gathered * (2 * q + 2 * kv) * size + gathered * 16
        logits = self.max_num_seqs * (vocab_rows + arch.vocab_size) * _FLOAT32 if last else 0
        return per_token + max(prefill, decode) + logits
