"""The operations of a decoder layer, as one object the layers are given: :class:`TorchKernels`
(torch operations, linear weights packed for oneDNN; any device and dtype) or
:class:`NativeKernels` (the same operations in C for float32 and bfloat16 on the CPU, and a
linear kernel of its own for float32 rows, its weights held in float32, bfloat16 or a GGUF
file's quantization blocks, from the optional extension ``shardline.layers._kernels``;
anything else goes to the torch path).

At decode batch sizes these operations are cheap arithmetic and costly dispatch: each torch
operation costs microseconds of Python and dispatcher, and a layer ran about twenty of them.
The C path does each group in one call (``benchmarks/layer_kernels.py`` measures both).
:func:`layer_kernels` picks the C path where it was built, unless ``SHARDLINE_NATIVE=0``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shardline.native import native_extension
from shardline.profiling import ATTENTION, COMM_ALL_REDUCE, MATMUL, NO_TIMER, StepTimer

if TYPE_CHECKING:
    from shardline.distributed import GroupCoordinator
    from shardline.layers.attention import DecodeBatch, KVCache


#: With kernels that attend in C (which read each row's keys in the cache where they are), a
#: sequence that adds at most this many query tokens in a step (a decode, a speculative step's
#: drafts, a prompt's short chunk) attends row by row: each of its queries as a one-token
#: sequence ending at that query's position, in the decode path (its keys and values are all
#: stored before any row attends, so each row sees exactly what causal attention shows it).
#: Longer runs of queries go to the prompt path (torch's fused attention), which is faster
#: from a few hundred queries (measured: see the README, Model execution).
ROW_WISE_QUERIES = 64

#: The batch size oneDNN packs weights for: measured the fastest packing for 1 and 16 rows.
PACKED_FOR_ROWS = 16

#: Lays one loaded ``[out, in]`` weight out for a kernels object's linear (returns the new
#: parameter, or the weight itself where it stays as it is).
WeightPacker = Callable[[torch.Tensor], torch.Tensor]

#: The kinds a weight may be held in as its GGUF file's blocks (``model.weight_dtype:
#: gguf``), fewest bytes first: the first that holds every part's type holds it
#: (``quantized_blocks.h``).
QUANTIZED_KINDS = ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q8_0", "Q6_K", "INT8_SCALED")
#: The kinds of codes multiplied by int8 inputs (``model.activation_dtype: int8``), tried
#: before the others: 4-bit codes with float16 scales and offsets (Q4_0 and Q4_1 blocks) or
#: float32 ones (Q4_K); 8-bit codes with float16 scales (Q8_0, Q5_0 and IQ4_NL blocks).
CODE_KINDS = ("Q4_CODES_F16", "Q4_CODES", "Q8_CODES_F16")
#: The attribute of a loaded weight that lists the file blocks its rows were decoded from
#: (:func:`~shardline.layers.linear.note_file_blocks`).
FILE_BLOCKS = "file_blocks"


def packs(device: str, dtype: str) -> bool:
    """Whether linear weights of ``dtype`` (a name: "float32") on ``device`` (a kind: "cpu")
    are packed for oneDNN: float32 on the CPU, where this torch has oneDNN; bfloat16 too where
    this CPU has oneDNN's bfloat16 instructions (AVX-512 BW/VL/DQ or AVX-NE-CONVERT: without
    them oneDNN refuses to pack bfloat16, and the weights stay plain)."""
    onednn = torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )
    if device != "cpu" or not onednn:
        return False
    if dtype == "bfloat16":
        return _cpu_packs_bfloat16()
    return dtype == "float32"


def _cpu_packs_bfloat16() -> bool:
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return supported is not None and bool(supported())


def packed(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``) in oneDNN's blocked layout, as a new parameter, where
    :func:`packs` says so; else ``weight`` itself."""
    dtype = str(weight.dtype).removeprefix("torch.")
    if weight.is_mkldnn or not packs(weight.device.type, dtype):
        return weight
    blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)
    return nn.Parameter(blocked, requires_grad=False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` with a plain or a :func:`packed` weight."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class TorchKernels:
    """The per-layer operations in torch; linear weights packed for oneDNN
    (:func:`~shardline.layers.linear.packed`).

    ``weight_dtype`` (None: the weights' own) is the precision linear weights keep: a float32
    weight with ``weight_dtype`` bfloat16 is rounded to bfloat16 when packed and multiplied in
    float32 (held in float32 here; :class:`NativeKernels` holds it in bfloat16)."""

    def __init__(self, weight_dtype: torch.dtype | None = None) -> None:
        self.weight_dtype = weight_dtype

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (``[out, in]``, loaded) in the layout :meth:`linear` reads fastest,
        rounded to ``weight_dtype``."""
        return packed(self._rounded(weight))

    def _rounded(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight``'s values rounded to ``weight_dtype``, in its own dtype and layout: a new
        parameter (``weight`` itself where there is nothing to round; it is left as it is, as
        an embedding table that the head shares is)."""
        if self.weight_dtype is None or self.weight_dtype is weight.dtype:
            return weight
        values = weight.detach().to(self.weight_dtype).to(weight.dtype)
        return nn.Parameter(values, requires_grad=False)

    def greedy_screen(self, table: torch.Tensor, held: torch.Tensor) -> GreedyScreen | None:
        """The screen that finds an LM head's largest logits reading fewer bytes
        (:class:`GreedyScreen`), for ``held``, the head's weight as :meth:`pack_linear` made it
        from ``table``; None where these kernels have none (the torch ones never do)."""
        return None

    def weight_packer(self, weights: Sequence[torch.Tensor]) -> WeightPacker:
        """A :meth:`pack_linear` for a model's weights, ``weights`` (loaded), to be called on
        each of them in this order (the order a step multiplies by them); it may place them
        together. The caller should not keep ``weights``: each original is freed as the
        packer replaces it."""
        return self.pack_linear

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x W^T + b`` with ``weight`` as :meth:`pack_linear` made it (or as loaded)."""
        return linear(x, weight, bias)

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``weight * x / rms(x)`` in float32 (cast back, as HF Llama). With ``residual``:
        ``(norm(x + residual), x + residual)``, the new residual stream."""
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:  # one fused kernel, the same arithmetic
            out = F.rms_norm(x, weight.shape, weight, eps)
            return out if residual is None else (out, residual)
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * x32.to(dtype)
        return out if residual is None else (out, residual)

    def embedding_rows(
        self, token_ids: torch.Tensor, table: torch.Tensor, first: int
    ) -> torch.Tensor:
        """``[N, hidden]``: for each of ``token_ids`` (``[N]``) the row ``token - first`` of
        ``table`` where that is one of its rows, else zeros (a vocabulary-parallel rank's
        lookup: the others' tokens add nothing to the sum over ranks)."""
        local = token_ids - first
        inside = (local >= 0) & (local < table.shape[0])
        rows = F.embedding(torch.where(inside, local, 0), table)
        return rows * inside.unsqueeze(-1).to(table.dtype)

    def rotate_and_store(
        self,
        qkv: torch.Tensor,
        q_heads: int,
        kv_heads: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """From ``qkv`` (``[N, (q_heads + 2 kv_heads) d]``): queries and keys rotated by
        ``rope`` (``(cos, sin)``, ``[N, 1, d]``), keys and values written to ``cache`` at
        ``slot_mapping``; returns the rotated queries ``[N, q_heads, d]``."""
        d = cache.key.shape[-1]
        qk = rotate(qkv[:, : (q_heads + kv_heads) * d].view(-1, q_heads + kv_heads, d), *rope)
        cache.write(slot_mapping, qk[:, q_heads:], qkv[:, (q_heads + kv_heads) * d :].view(
            -1, kv_heads, d
        ))  # fmt: skip
        return qk[:, :q_heads]

    def decode_attention(
        self,
        q: torch.Tensor,
        cache: KVCache,
        decode: DecodeBatch,
        scale: float,
        kv_index: KVHeadIndex,
    ) -> torch.Tensor:
        """Attention of every one-token sequence of ``decode`` (its rows of ``q``,
        ``[N, heads, d]``) over its cached keys: ``[B, heads, d]``. Keys and values are
        gathered block by block (whole blocks are contiguous) and cut to the longest
        sequence; query head ``i`` reads KV head ``kv_index.index[i]``."""
        count = decode.blocks.shape[0] // decode.blocks_per_seq

        def gathered(table: torch.Tensor) -> torch.Tensor:  # [B, kv_heads, L, d]
            rows = table.index_select(0, decode.blocks).view(count, -1, *table.shape[2:])
            return rows[:, : decode.length].transpose(1, 2)

        keys, values = per_query_head(gathered(cache.key), gathered(cache.value), kv_index)
        query = (q if decode.rows is None else q[decode.rows]).unsqueeze(2)  # [B, heads, 1, d]
        attended = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=decode.visible, scale=scale,
            enable_gqa=kv_index.grouped,
        )  # fmt: skip
        return attended.squeeze(2)

    def row_wise_queries(self, dtype: torch.dtype) -> int:
        """How many queries of one sequence :meth:`decode_attention` should take in a step,
        row by row, for a model of ``dtype`` (``AttentionMetadata.row_wise_queries``): one,
        since the torch path gathers every row's keys (more rows of one sequence would copy
        its keys once each)."""
        return 1

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[N, 2 size]`` = ``[gate | up]`` -> ``silu(gate) * up``, ``[N, size]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def layer_blocks(
        self,
        *,
        input_norm: tuple[torch.Tensor, float],
        qkv: tuple[torch.Tensor, torch.Tensor | None],
        heads: tuple[int, int, int],
        kv_index: KVHeadIndex,
        scale: float,
        o_proj: tuple[torch.Tensor, torch.Tensor | None],
        post_norm: tuple[torch.Tensor, float],
        gate_up: tuple[torch.Tensor, torch.Tensor | None],
        down: tuple[torch.Tensor, torch.Tensor | None],
    ) -> LayerBlocks | None:
        """A decoder layer's weights, checked once (after packing), for running each half of
        the layer in one call in steps of decodes only (:meth:`attention_block`,
        :meth:`mlp_block`) or every layer in one (:meth:`decode_layers`); None where these
        kernels have no such calls or do not take these weights. ``input_norm``/``post_norm``:
        ``(weight, eps)``; ``qkv``, ``o_proj``, ``gate_up``, ``down``: ``(weight, bias)`` (the
        row-parallel biases are added after the all-reduce); ``heads``: ``(query heads, KV
        heads, head size)`` on this rank; ``kv_index``: which KV head each query head reads."""
        return None

    def layer_stack(
        self, layers: Sequence[LayerBlocks | None], caches: Sequence[KVCache]
    ) -> LayerStack | None:
        """Every layer of a model's stage (their :meth:`layer_blocks`, in order) with its
        cache, checked once, for :meth:`decode_layers`; None where these kernels have no such
        call or the layers do not all take it."""
        return None

    def decode_layers(
        self,
        stack: LayerStack,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        decode: DecodeBatch,
        tp: GroupCoordinator,
        timer: StepTimer = NO_TIMER,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer of ``stack`` in one call, in a step of decodes only: ``(hidden,
        residual)`` as the layers one by one return them, or None where the step's tensors do
        not fit the call or ``tp``'s communicator has no
        :meth:`~shardline.distributed.GroupCoordinator.native_all_reduce` (the layers then
        run; every rank decides the same)."""
        return None

    def attention_block(
        self,
        blocks: LayerBlocks,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        slot_mapping: torch.Tensor,
        decode: DecodeBatch,
        timer: StepTimer = NO_TIMER,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The attention half of a decoder layer in one call, with ``blocks`` from
        :meth:`layer_blocks`: ``(o_proj's partial output, residual)``, or None where the
        step's tensors do not fit the call (the layer's modules run then). The torch path
        makes no blocks, so it has no such call."""
        return None

    def mlp_block(
        self,
        blocks: LayerBlocks,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        timer: StepTimer = NO_TIMER,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The MLP half of a decoder layer in one call, as :meth:`attention_block`."""
        return None


@dataclass(frozen=True)
class LayerBlocks:
    """A decoder layer's sizes and weight addresses for the fused C calls, checked when made;
    ``tensors`` keeps the tensors behind the addresses alive."""

    hidden_size: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    scale: float
    attention_args: tuple  # norm weight, eps, qkv weight, qkv bias, kv_index, o weight
    mlp_args: tuple  # norm weight, eps, gate_up weight, gate_up bias, down weight
    reduced_biases: tuple[int, int]  # o_proj's and down's, added after the all-reduce (or 0)
    weight_kinds: tuple[int, ...]  # how qkv, o_proj, gate_up and down hold theirs (WEIGHT_*)
    tensors: tuple[torch.Tensor, ...]

    @property
    def sizes(self) -> tuple[int, int, int, int, int, float]:
        """What layers run in one call (:class:`LayerStack`) must share."""
        return (self.hidden_size, self.q_heads, self.kv_heads, self.head_dim,
                self.intermediate_size, self.scale)  # fmt: skip


@dataclass(frozen=True)
class LayerStack:
    """A stage's layers and caches for :meth:`NativeKernels.decode_layers`: their sizes (the
    first layer's, equal in all), ``table`` (int64 ``[layers, LAYER_TABLE_FIELDS]``:
    addresses in the C call's order) and ``eps`` (float64 ``[layers, 2]``); ``blocks`` and
    ``caches`` keep the memory behind the addresses alive."""

    first: LayerBlocks
    table: torch.Tensor
    eps: torch.Tensor
    blocks: tuple[LayerBlocks, ...]
    caches: tuple[KVCache, ...]


class NativeKernels(TorchKernels):
    """The per-layer operations in C (``native``: the built extension) for a model on the CPU:
    contiguous float32 or bfloat16 tensors in host memory (all of one call in one dtype) take
    the C path, any other input the torch path. The C path checks slots and blocks against the
    cache; shapes and dtypes are checked here."""

    def __init__(
        self,
        native: ModuleType,
        threads: int = 1,
        weight_dtype: torch.dtype | None = None,
        quantized: bool = False,
        codes: bool = False,
        screen_kind: str | None = None,
    ) -> None:
        """``threads``: how many threads share each C linear and a fused step's decode
        attention (the rank's torch threads); with more than one, a team of helper threads
        lives as long as this object. ``weight_dtype`` bfloat16: float32 weights blocked for
        the C kernel are held in bfloat16 (half the bytes a step reads; the C kernel widens
        them exactly, so results are those of float32 weights rounded to bfloat16).
        ``quantized``: a float32 weight decoded from a GGUF file's blocks, carrying them
        (:func:`~shardline.layers.linear.note_file_blocks`), is held as those blocks
        (:data:`QUANTIZED_KINDS`; a merged one's parts in segments of several) where this
        CPU has AVX-512, or AVX2 with FMA and F16C (1.5 bytes a weight or less; the C kernel
        widens each weight to the file decoder's value, so results are the float32
        weight's, bit for bit); any other weight is held in float32. ``codes`` (with
        ``quantized``): weights of the file's 4-bit types and Q8_0 are held first as codes
        (:data:`CODE_KINDS`) that the C kernel multiplies by each input row quantized to
        int8 per 16 inputs (no longer the float32 results). ``screen_kind``: the blocks a
        :class:`GreedyScreen` holds its codes in, "Q8_0" or "Q8_CODES_F16"; None: the
        second where this CPU multiplies int8 codes in integers (AVX-512 VNNI), else the
        first."""
        super().__init__(weight_dtype)
        self.native = native
        if screen_kind is None:
            screen_kind = "Q8_CODES_F16" if native.int8_dot_available() else "Q8_0"
        if screen_kind not in ("Q8_0", "Q8_CODES_F16") or (
            screen_kind == "Q8_CODES_F16" and not native.int8_dot_available()
        ):
            raise ValueError(
                f"screen_kind = {screen_kind!r}: allowed: 'Q8_0', or 'Q8_CODES_F16' on a CPU "
                "with AVX-512 VNNI"
            )
        #: The C calls' WEIGHT_* code of the blocks a greedy screen's codes are held in.
        self.screen_kind = getattr(native, f"WEIGHT_{screen_kind}")
        #: (name, the C calls' WEIGHT_* code) of the block kinds weights are tried in; none
        #: where blocks are not held.
        tried = (CODE_KINDS if codes else ()) + QUANTIZED_KINDS
        self._block_kinds = (
            tuple((name, getattr(native, f"WEIGHT_{name}")) for name in tried)
            if quantized and native.quantized_linear_available()
            else ()
        )
        self.team = (
            native.team(threads) if threads > 1 and native.blocked_linear_available() else None
        )

    def pack_linear(self, weight):
        """A float32 CPU weight, on a CPU with AVX-512 or AVX2 and FMA, blocked for the C kernel
        (:meth:`_held`); else oneDNN's packing."""
        if self._blocks(weight):
            return self._held(weight, None)
        return super().pack_linear(weight)

    def _held(self, weight: torch.Tensor, arena: WeightArena | None) -> nn.Parameter:
        """``weight`` blocked for the C kernel (in ``arena``'s next piece, else its own
        memory): where ``quantized`` and it carries the file blocks it was decoded from
        (:func:`~shardline.layers.linear.note_file_blocks`), as those blocks
        (:meth:`_held_in_segments`, else :meth:`_held_in_one_kind`); else :func:`blocked` in
        ``weight_dtype``."""
        parts = getattr(weight, FILE_BLOCKS, None)
        if self._block_kinds and parts:
            values = weight.detach()
            held = self._held_in_segments(values, parts, arena)
            if held is None:
                held = self._held_in_one_kind(values, parts, arena)
            if held is not None:
                return held
        dtype = self._blocked_dtype
        place = None if arena is None else arena.take(weight.numel(), dtype)
        return blocked(weight, self.native.LINEAR_BLOCK, place, dtype=dtype)

    def _held_in_one_kind(self, values, parts, arena: WeightArena | None) -> nn.Parameter | None:
        """``values`` (float32, as loaded) held as its file ``parts`` in the first of
        :data:`QUANTIZED_KINDS` that holds all their types (every value checked), or None."""
        out_features, in_features = values.shape
        described = [(kind, raw.ctypes.data, raw.strides[0], first, raw.shape[0])
                     for first, kind, raw in parts]  # fmt: skip
        for name, kind in self._block_kinds:
            size = self.native.quantized_size(kind, out_features, in_features)
            place = _host_bytes(size) if arena is None else arena.peek(size)
            if self.native.pack_file_blocks(
                kind, place.data_ptr(), out_features, in_features, _loaded(values), described,
                self.team,
            ):  # fmt: skip
                return self._parameter(place, arena, values.shape, kind, name)
        return None

    def _held_in_segments(self, values, parts, arena: WeightArena | None) -> nn.Parameter | None:
        """``values`` held as ``WEIGHT_SEGMENTED`` where its file ``parts`` are of types that
        different kinds hold first (a Q4_K_M file's Q4_K queries and keys with Q6_K values):
        each run of parts in its own first kind, fewer bytes than one kind holding them all
        (the plan counts them so: ``memory.merged_block_bytes``). None where the types share
        a first kind, a part does not start on a block of ``LINEAR_BLOCK`` outputs, the runs
        are more than ``SEGMENTS_MAX``, or a value is not held."""
        native, (out_features, in_features) = self.native, values.shape
        parts = sorted(parts, key=lambda part: part[0])
        kinds = [self._first_holding(kind) for _, kind, _ in parts]
        if (
            len(set(kinds)) < 2 or None in kinds or parts[0][0] != 0
            or any(first % native.LINEAR_BLOCK for first, _, _ in parts)
        ):  # fmt: skip
            return None
        runs: list[tuple[tuple[str, int], int, list]] = []  # (kind, first row, its parts)
        for part, kind in zip(parts, kinds, strict=True):
            if runs and runs[-1][0] == kind:
                runs[-1][2].append(part)
            else:
                runs.append((kind, part[0], [part]))
        if len(runs) > native.SEGMENTS_MAX:
            return None
        ends = [first for _, first, _ in runs[1:]] + [out_features]
        sizes = [native.quantized_size(kind, end - first, in_features)
                 for ((_, kind), first, _), end in zip(runs, ends, strict=True)]  # fmt: skip
        table_bytes = native.SEGMENT_TABLE_BYTES
        total = table_bytes + sum(sizes)
        place = _host_bytes(total) if arena is None else arena.peek(total)
        offset = table_bytes
        for ((_, kind), first, run_parts), end, size in zip(runs, ends, sizes, strict=True):
            described = [(type_name, raw.ctypes.data, raw.strides[0], part_first - first,
                          raw.shape[0]) for part_first, type_name, raw in run_parts]  # fmt: skip
            if not native.pack_file_blocks(
                kind, place.data_ptr() + offset, end - first, in_features,
                _loaded(values[first:]), described, self.team,
            ):  # fmt: skip
                return None
            offset += size
        table = torch.zeros(table_bytes // 4, dtype=torch.int32, device="cpu")
        table[0] = len(runs)
        for i, ((_, kind), end) in enumerate(zip((run[0] for run in runs), ends, strict=True)):
            table[2 + 2 * i] = kind
            table[3 + 2 * i] = -(-end // native.LINEAR_BLOCK)
        place[:table_bytes].copy_(table.view(torch.uint8))
        name = "+".join(kind_name for (kind_name, _), _, _ in runs)
        return self._parameter(place, arena, values.shape, native.WEIGHT_SEGMENTED, name)

    def _first_holding(self, type_name: str) -> tuple[str, int] | None:
        """The first of the block kinds tried that holds the file's ``type_name`` blocks."""
        for name, kind in self._block_kinds:
            if self.native.kind_holds(kind, type_name):
                return name, kind
        return None

    @staticmethod
    def _parameter(place, arena: WeightArena | None, shape, kind: int, name: str) -> nn.Parameter:
        """``place`` (taken from ``arena`` where it came from there) as a held weight of
        ``shape``, held as ``kind`` (a WEIGHT_* code) called ``name``."""
        if arena is not None:
            arena.take(place.numel(), torch.uint8)
        parameter = nn.Parameter(place, requires_grad=False)
        parameter.blocked_shape = tuple(shape)
        parameter.weight_kind, parameter.held_as = kind, name
        return parameter

    def _kind(self, weight: torch.Tensor) -> int:
        """How a blocked weight holds its values, as the C calls name it (``WEIGHT_*``)."""
        if hasattr(weight, "weight_kind"):
            return weight.weight_kind
        if weight.dtype is torch.bfloat16:
            return self.native.WEIGHT_BFLOAT16
        return self.native.WEIGHT_FLOAT32

    @property
    def _blocked_dtype(self) -> torch.dtype:
        """The dtype blocked weights are held in: bfloat16 where ``weight_dtype`` says so."""
        return torch.bfloat16 if self.weight_dtype is torch.bfloat16 else torch.float32

    def weight_packer(self, weights):
        """:meth:`pack_linear`, with the blocked weights back to back in one buffer in the
        order they are packed: a decode step then reads its weights as one stream through
        memory rather than one per weight, which a core reads faster
        (``benchmarks/linear_kernels.py``). The buffer's pages are touched only as weights are
        written to it, so packing needs no more memory than one weight at a time did."""
        sizes = [self._most_bytes(weight) for weight in weights if self._blocks(weight)]
        if not sizes:
            return super().weight_packer(weights)
        arena = WeightArena(sum(_aligned(size) for size in sizes))

        def pack(weight: torch.Tensor) -> torch.Tensor:
            if not self._blocks(weight):
                return super(NativeKernels, self).pack_linear(weight)
            return self._held(weight, arena)

        return pack

    def greedy_screen(self, table, held):
        """A :class:`GreedyScreen` for a head held blocked in float32 or bfloat16 (not in a
        file's blocks) with inputs in whole groups, on a CPU that runs the Q8_0 kernel, its
        codes in ``screen_kind``'s blocks; made
        ``_SCREEN_ROWS`` rows at a time, so it needs little memory beyond its own. None
        otherwise, or where a value is not finite (or a group's scale not a float16 one)."""
        native = self.native
        if (
            held.dim() != 1
            or self._kind(held) not in (native.WEIGHT_FLOAT32, native.WEIGHT_BFLOAT16)
            or not native.quantized_linear_available()
            or held.blocked_shape[1] % native.QUANT_GROUP
        ):  # fmt: skip
            return None
        out_features, in_features = held.blocked_shape
        kind = self.screen_kind
        size = native.quantized_size(kind, out_features, in_features)
        weight = _host_bytes(size)
        bounds = torch.empty(2, out_features, dtype=torch.float32, device="cpu")
        block_bytes = native.quantized_size(kind, native.LINEAR_BLOCK, in_features)
        for first in range(0, out_features, _SCREEN_ROWS):
            values = table.detach()[first : first + _SCREEN_ROWS].to(held.dtype).float()
            screened = _q8_0_rows(native, values)
            if screened is None:
                return None
            raw, decoded, sums = screened
            rows = values.shape[0]
            place = weight[first // native.LINEAR_BLOCK * block_bytes :]
            if not native.pack_file_blocks(
                kind, place.data_ptr(), rows, in_features, _loaded(decoded),
                [("Q8_0", raw.data_ptr(), raw.stride(0), 0, rows)], self.team,
            ):  # fmt: skip
                return None
            bounds[:, first : first + rows] = _screen_bounds(in_features, sums)
        return GreedyScreen(native, weight, kind, bounds, self.team)

    def _most_bytes(self, weight: torch.Tensor) -> int:
        """The most bytes :meth:`_held` may take for ``weight``."""
        out_features, in_features = weight.shape
        most = weight.numel() * self._blocked_dtype.itemsize
        if in_features % self.native.QUANT_GROUP == 0:
            for _, kind in self._block_kinds:
                most = max(most, self.native.quantized_size(kind, out_features, in_features))
        return most

    def _blocks(self, weight: torch.Tensor) -> bool:
        """Whether :meth:`pack_linear` blocks ``weight`` for the C kernel (float32, kept in
        float32 or bfloat16 precision)."""
        return (
            weight.dtype is torch.float32 and weight.dim() == 2
            and self.weight_dtype in (None, torch.float32, torch.bfloat16)
            and _c_linear_runs(self.native, weight.device.type)
        )  # fmt: skip

    def linear(self, x, weight, bias):
        if weight.dim() != 1:
            return super().linear(x, weight, bias)
        out_features, in_features = weight.blocked_shape
        if x.shape[-1] != in_features or x.dtype is not torch.float32:
            raise ValueError(
                f"linear: input {tuple(x.shape)} {x.dtype}; the weight takes float32 rows of "
                f"{in_features}"
            )
        flat = x.dim() == 2 and x.is_contiguous()  # a step's activations: no reshape to pay
        rows = x if flat else x.reshape(-1, in_features).contiguous()
        y = rows.new_empty(rows.shape[0], out_features)
        if bias is not None:
            if bias.dtype is not torch.float32 or bias.numel() != out_features:
                raise ValueError(
                    f"linear: bias {tuple(bias.shape)} {bias.dtype}; expected float32 "
                    f"[{out_features}]"
                )
            bias = bias.contiguous()
        self.native.blocked_linear(
            weight.data_ptr(), rows.data_ptr(), y.data_ptr(),
            0 if bias is None else bias.data_ptr(), rows.shape[0], out_features, in_features,
            self.team, self._kind(weight), self.native.KERNELS_CHOSEN,
        )  # fmt: skip
        return y if flat else y.view(*x.shape[:-1], out_features)

    def rms_norm(self, x, weight, eps, residual=None):
        dtype = x.dtype
        if not (
            _fits(x) and _fits(weight, dtype) and x.dim() == 2
            and (residual is None or _fits(residual, dtype))
        ):  # fmt: skip
            return super().rms_norm(x, weight, eps, residual)
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        if weight.numel() != x.shape[1]:
            raise ValueError(f"norm weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
        out = torch.empty_like(x)
        summed = None if residual is None else torch.empty_like(x)
        self.native.rms_norm(
            dtype is torch.bfloat16, x.data_ptr(),
            0 if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
            0 if summed is None else summed.data_ptr(), x.shape[0], x.shape[1], eps,
        )  # fmt: skip
        return out if summed is None else (out, summed)

    def embedding_rows(self, token_ids, table, first):
        if not (
            _fits(table) and table.dim() == 2
            and _fits(token_ids, torch.int64) and token_ids.dim() == 1
        ):  # fmt: skip
            return super().embedding_rows(token_ids, table, first)
        out = table.new_empty(token_ids.shape[0], table.shape[1])
        self.native.embedding_rows(
            table.dtype is torch.bfloat16, table.data_ptr(), table.shape[0], table.shape[1],
            token_ids.data_ptr(), token_ids.shape[0], first, out.data_ptr(),
        )  # fmt: skip
        return out

    def rotate_and_store(self, qkv, q_heads, kv_heads, rope, cache, slot_mapping):
        cos, sin = rope
        d = cache.key.shape[-1]
        rows = qkv.shape[0]
        dtype = qkv.dtype
        if not (
            _fits(qkv) and qkv.dim() == 2 and _fits(cos, torch.float32)
            and _fits(sin, torch.float32)
            and _fits(cache.key, dtype) and _fits(cache.value, dtype)
            and qkv.shape[1] == (q_heads + 2 * kv_heads) * d and cos.numel() == rows * d
            and sin.numel() == rows * d and cache.key.shape[-2] == kv_heads
            and slot_mapping.dtype is torch.int64 and slot_mapping.shape == (rows,)
            and slot_mapping.is_contiguous()
        ):  # fmt: skip
            return super().rotate_and_store(qkv, q_heads, kv_heads, rope, cache, slot_mapping)
        q = qkv.new_empty(rows, q_heads, d)
        self.native.rope_store(
            dtype is torch.bfloat16, qkv.data_ptr(), rows, q_heads, kv_heads, d,
            cos.data_ptr(), sin.data_ptr(), q.data_ptr(), cache.key.data_ptr(),
            cache.value.data_ptr(), slot_mapping.data_ptr(), cache.key.shape[0] * cache.block_size,
        )  # fmt: skip
        return q

    def decode_attention(self, q, cache, decode, scale, kv_index):
        heads, d = q.shape[1], q.shape[2]
        kv_heads = cache.key.shape[-2]
        if not (
            _fits(q) and q.dim() == 3 and d == cache.key.shape[-1]
            and _fits(cache.key, q.dtype) and _fits(cache.value, q.dtype)
        ):  # fmt: skip
            return super().decode_attention(q, cache, decode, scale, kv_index)
        kv_heads_read = kv_index.index
        query = q if decode.rows is None else q[decode.rows].contiguous()
        count = query.shape[0]
        if not (
            kv_heads_read.numel() == heads and decode.lengths.numel() == count
            and decode.blocks.numel() == count * decode.blocks_per_seq
        ):  # fmt: skip
            raise ValueError(
                f"decode attention: {count} queries of {heads} heads, {decode.lengths.numel()} "
                f"lengths, {decode.blocks.numel()} blocks ({decode.blocks_per_seq} per "
                f"sequence), {kv_heads_read.numel()} KV head indices"
            )
        out = torch.empty_like(query)
        self.native.decode_attention(
            q.dtype is torch.bfloat16, query.data_ptr(), cache.key.data_ptr(),
            cache.value.data_ptr(), decode.blocks.data_ptr(), decode.blocks_per_seq,
            decode.lengths.data_ptr(), query.shape[0], heads, kv_heads_read.data_ptr(), kv_heads, d,
            cache.block_size, cache.key.shape[0], float(scale), out.data_ptr(), False,
        )  # fmt: skip
        return out

    def row_wise_queries(self, dtype):
        """Up to ``ROW_WISE_QUERIES`` for float32 and bfloat16, which attend in C (each row
        reads its keys in the cache); one for the dtypes left to the torch path."""
        if dtype in (torch.float32, torch.bfloat16):
            return ROW_WISE_QUERIES
        return super().row_wise_queries(dtype)

    def silu_and_mul(self, gate_up):
        if not (_fits(gate_up) and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0):
            return super().silu_and_mul(gate_up)
        rows, size = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, size)
        self.native.silu_mul(
            gate_up.dtype is torch.bfloat16, gate_up.data_ptr(), out.data_ptr(), rows, size
        )
        return out

    def layer_blocks(
        self, *, input_norm, qkv, heads, kv_index, scale, o_proj, post_norm, gate_up, down,
    ):  # fmt: skip
        """Where every linear weight is blocked for the C kernel (:meth:`pack_linear`; each
        held as it is: float32, bfloat16 or quantization blocks) and the rest is float32 and
        contiguous."""
        q_heads, kv_heads, d = heads
        kv_heads_read = kv_index.index
        (input_weight, input_eps), (post_weight, post_eps) = input_norm, post_norm
        (qkv_weight, qkv_bias), (gate_up_weight, gate_up_bias) = qkv, gate_up
        (o_weight, o_bias), (down_weight, down_bias) = o_proj, down
        width = input_weight.numel()
        size = down_weight.blocked_shape[1] if down_weight.dim() == 1 else 0
        biases = (qkv_bias, gate_up_bias, o_bias, down_bias)
        weights = (qkv_weight, o_weight, gate_up_weight, down_weight)
        if not (
            all(w.dim() == 1 for w in weights)
            and all(
                _fits(t, torch.float32)
                for t in (input_weight, post_weight, *biases) if t is not None
            )
            and all(b is None or b.numel() == width for b in (o_bias, down_bias))
            and post_weight.numel() == width
            and qkv_weight.blocked_shape == ((q_heads + 2 * kv_heads) * d, width)
            and o_weight.blocked_shape == (width, q_heads * d)
            and gate_up_weight.blocked_shape == (2 * size, width)
            and down_weight.blocked_shape == (width, size)
            and kv_heads_read.dtype is torch.int64 and kv_heads_read.numel() == q_heads
            and kv_heads_read.is_contiguous()
        ):  # fmt: skip
            return None
        return LayerBlocks(
            width, q_heads, kv_heads, d, size, float(scale),
            (input_weight.data_ptr(), float(input_eps), qkv_weight.data_ptr(),
             _address(qkv_bias), kv_heads_read.data_ptr(), o_weight.data_ptr()),
            (post_weight.data_ptr(), float(post_eps), gate_up_weight.data_ptr(),
             _address(gate_up_bias), down_weight.data_ptr()),
            (_address(o_bias), _address(down_bias)),
            tuple(self._kind(w) for w in weights),
            tuple(t for t in (input_weight, post_weight, qkv_weight, kv_heads_read, o_weight,
                              gate_up_weight, down_weight, *biases)
                  if t is not None),
        )  # fmt: skip

    def layer_stack(self, layers, caches):
        """Where every layer has blocks of one shape and every cache is float32, contiguous and
        of one size."""
        if not layers or any(blocks is None for blocks in layers) or len(caches) != len(layers):
            return None
        first, cache = layers[0], caches[0]
        if not all(
            b.sizes == first.sizes
            and _fits(c.key, torch.float32) and _fits(c.value, torch.float32)
            and c.key.shape == cache.key.shape and c.block_size == cache.block_size
            and c.key.shape[-2:] == (first.kv_heads, first.head_dim)
            for b, c in zip(layers, caches, strict=True)
        ):  # fmt: skip
            return None
        rows, eps = [], []
        for b, c in zip(layers, caches, strict=True):
            norm, input_eps, qkv, qkv_bias, kv_index, o_weight = b.attention_args
            post, post_eps, gate_up, gate_up_bias, down = b.mlp_args
            o_bias, down_bias = b.reduced_biases
            rows.append([
                norm, qkv, qkv_bias, o_weight, o_bias, post, gate_up, gate_up_bias, down,
                down_bias, kv_index, c.key.data_ptr(), c.value.data_ptr(), *b.weight_kinds,
            ])  # fmt: skip
            eps.append([input_eps, post_eps])
        table = torch.tensor(rows, dtype=torch.int64, device="cpu")
        if table.shape[1] != self.native.LAYER_TABLE_FIELDS:
            raise RuntimeError(
                f"layer table of {table.shape[1]} fields; the extension reads "
                f"{self.native.LAYER_TABLE_FIELDS} (rebuild it: pip install -e .)"
            )
        return LayerStack(
            first,
            table,
            torch.tensor(eps, dtype=torch.float64, device="cpu"),
            tuple(layers),
            tuple(caches),
        )

    def attention_block(
        self,
        blocks: LayerBlocks,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        slot_mapping: torch.Tensor,
        decode: DecodeBatch,
        timer: StepTimer = NO_TIMER,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The attention half of a decoder layer in one C call, in a step of decodes only
        (``decode.rows`` None): :meth:`rms_norm` (with the residual add), the qkv
        :meth:`linear`, :meth:`rotate_and_store`, :meth:`decode_attention` and the o_proj
        :meth:`linear` without bias, bit-identical to those calls one by one. Returns
        ``(this rank's o_proj output, before the all-reduce; the new residual)``, or None
        where the step's tensors are not what the C call takes (the caller then runs the
        operations one by one). ``timer`` gets the matmul and attention seconds."""
        cos, sin = rope
        rows, d = hidden.shape[0], blocks.head_dim
        if not (
            _decode_step_fits(blocks, hidden, residual, rope, slot_mapping, decode)
            and _fits(cache.key, torch.float32) and _fits(cache.value, torch.float32)
            and cache.key.shape[-2:] == (blocks.kv_heads, d)
        ):  # fmt: skip
            return None
        norm, eps, qkv, qkv_bias, kv_index, o_weight = blocks.attention_args
        partial = hidden.new_empty(rows, blocks.hidden_size)
        summed = None if residual is None else torch.empty_like(hidden)
        times = _times(2) if timer.active else None
        self.native.attention_block(
            hidden.data_ptr(), _address(residual), norm, eps, rows, blocks.hidden_size, qkv,
            qkv_bias, blocks.q_heads, blocks.kv_heads, d, cos.data_ptr(), sin.data_ptr(),
            slot_mapping.data_ptr(), cache.key.data_ptr(), cache.value.data_ptr(),
            cache.key.shape[0], cache.block_size, decode.blocks.data_ptr(),
            decode.blocks_per_seq, decode.lengths.data_ptr(), kv_index, blocks.scale, o_weight,
            partial.data_ptr(), _address(summed), _address(times), self.team,
            *blocks.weight_kinds[:2],
        )  # fmt: skip
        _record(timer, times)
        return partial, hidden if summed is None else summed

    def mlp_block(
        self,
        blocks: LayerBlocks,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        timer: StepTimer = NO_TIMER,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The MLP half of a decoder layer in one C call: :meth:`rms_norm` with the residual
        add, the gate_up :meth:`linear`, :meth:`silu_and_mul` and the down :meth:`linear`
        without bias; returns as :meth:`attention_block`."""
        rows = hidden.shape[0]
        if not (
            hidden.dim() == 2 and hidden.shape[1] == blocks.hidden_size
            and _fits(hidden, torch.float32) and _fits(residual, torch.float32)
            and residual.shape == hidden.shape
        ):  # fmt: skip
            return None
        norm, eps, gate_up, gate_up_bias, down = blocks.mlp_args
        partial = hidden.new_empty(rows, blocks.hidden_size)
        summed = torch.empty_like(hidden)
        times = _times(2) if timer.active else None
        self.native.mlp_block(
            hidden.data_ptr(), residual.data_ptr(), norm, eps, rows, blocks.hidden_size, gate_up,
            gate_up_bias, blocks.intermediate_size, down, partial.data_ptr(), summed.data_ptr(),
            _address(times), self.team, *blocks.weight_kinds[2:],
        )  # fmt: skip
        _record(timer, times)
        return partial, summed

    def decode_layers(self, stack, hidden, residual, rope, slot_mapping, decode, tp,
                      timer=NO_TIMER):  # fmt: skip
        """Every layer in one C call that holds no GIL while it runs (``decode_layers`` of the
        extension): the fused halves, with the all-reduce, the row-parallel bias and the
        residual add between them, bit-identical to the layers one by one. A failed
        all-reduce raises its communicator's error (``NativeAllReduce.failed``)."""
        first, cache = stack.first, stack.caches[0]
        layers = len(stack.blocks)
        if not _decode_step_fits(first, hidden, residual, rope, slot_mapping, decode):
            return None
        all_reduce = None
        if tp.world_size > 1:  # asked last: it reserves the communicator's next calls
            all_reduce = tp.native_all_reduce(hidden, 2 * layers)
            if all_reduce is None:
                return None
        cos, sin = rope
        out, summed = torch.empty_like(hidden), torch.empty_like(hidden)
        times = _times(3) if timer.active else None
        failure = self.native.decode_layers(
            stack.table.data_ptr(), stack.eps.data_ptr(), layers, hidden.data_ptr(),
            _address(residual), hidden.shape[0], first.hidden_size, first.q_heads,
            first.kv_heads, first.head_dim, first.intermediate_size, first.scale,
            cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(), cache.key.shape[0],
            cache.block_size, decode.blocks.data_ptr(), decode.blocks_per_seq,
            decode.lengths.data_ptr(), out.data_ptr(), summed.data_ptr(),
            None if all_reduce is None else all_reduce.capsule, _address(times), self.team,
        )  # fmt: skip
        if failure is not None:
            raise all_reduce.failed(*failure)
        _record(timer, times)
        return out, summed


def _decode_step_fits(
    blocks: LayerBlocks,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    rope: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    decode: DecodeBatch,
) -> bool:
    """Whether a step's tensors are what the fused C calls take: decodes only, float32 and
    contiguous, of the layer's sizes."""
    cos, sin = rope
    rows, d = hidden.shape[0], blocks.head_dim
    return (
        decode.rows is None and hidden.dim() == 2 and hidden.shape[1] == blocks.hidden_size
        and _fits(hidden, torch.float32)
        and (residual is None or (_fits(residual, torch.float32)
                                  and residual.shape == hidden.shape))
        and _fits(cos, torch.float32) and _fits(sin, torch.float32)
        and cos.numel() == rows * d and sin.numel() == rows * d
        and slot_mapping.dtype is torch.int64 and slot_mapping.shape == (rows,)
        and slot_mapping.is_contiguous()
        and decode.lengths.numel() == rows and decode.lengths.dtype is torch.int64
        and decode.blocks.numel() == rows * decode.blocks_per_seq
        and decode.blocks.dtype is torch.int64
    )  # fmt: skip


def blocked(
    weight: torch.Tensor,
    block: int,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Parameter:
    """``weight`` (``[out, in]``) as the C kernel reads it, one dimension of ``out * in``: block
    after block of ``block`` outputs, each input by input (``[in, block]``), the last holding
    the rest (``[in, out % block]``), in ``dtype`` (None: the weight's; rounded to nearest);
    written into ``out`` (that many elements of ``dtype``) where given. A full bfloat16 block
    holds each 32 outputs of an input in pairs (:func:`_paired`). Its ``blocked_shape`` is
    ``(out, in)``."""
    out_features, in_features = weight.shape
    whole = out_features // block * block
    source = weight.detach()
    dtype = dtype or weight.dtype
    if out is None:
        out = torch.empty(out_features * in_features, dtype=dtype, device=weight.device)
    blocks = source[:whole].view(-1, block, in_features)
    if dtype is torch.bfloat16:
        blocks = blocks[:, _paired(block)]
    out[: whole * in_features].view(-1, in_features, block).copy_(blocks.transpose(1, 2))
    if whole < out_features:
        out[whole * in_features :].view(in_features, -1).copy_(source[whole:].t())
    parameter = nn.Parameter(out, requires_grad=False)
    parameter.blocked_shape = (out_features, in_features)
    return parameter


def _paired(block: int) -> list[int]:
    """The outputs of a full bfloat16 block in the order the C kernel stores them: in each 32,
    output ``m`` then ``16 + m`` for m = 0..15 (one load then widens into two vectors of 16
    outputs with a shift and a mask)."""
    return [32 * (p // 32) + 16 * (p % 2) + p % 32 // 2 for p in range(block)]


class WeightArena:
    """One buffer of ``size`` bytes in host memory, handed out front to back in pieces, each
    starting on a 64-byte boundary (a cache line). Made with ``torch.empty``: memory is
    committed only as pieces are written."""

    def __init__(self, size: int) -> None:
        self.buffer = torch.empty(size, dtype=torch.uint8, device="cpu")
        self.used = 0

    def peek(self, size: int) -> torch.Tensor:
        """The next ``size`` bytes, not yet taken (the next :meth:`take` starts there too)."""
        if self.used + size > self.buffer.numel():
            raise ValueError(
                f"weight arena: {size} more bytes do not fit ({self.used} of "
                f"{self.buffer.numel()} used); pack only the weights it was made for"
            )
        return self.buffer[self.used : self.used + size]

    def take(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        """The next ``size`` elements of ``dtype`` (a view of the buffer)."""
        piece = self.peek(size * dtype.itemsize).view(dtype)
        self.used += _aligned(size * dtype.itemsize)
        return piece


#: Rows of a head a :class:`GreedyScreen` is made from at a time (a multiple of the blocked
#: kernels' 64 outputs a block).
_SCREEN_ROWS = 1024
#: The most rows a :class:`GreedyScreen` takes: past them the Q8_0 kernel's arithmetic costs
#: what the bytes save (a 24576 x 576 head from memory, one thread, head / screen: 3.7 / 2.0
#: ms at 1 row, 4.5 / 3.1 at 4, 5.0 / 4.0 at 8, 5.8 / 5.6 at 16).
SCREENED_ROWS_MAX = 8


class GreedyScreen(nn.Module):
    """Finds each row's largest logit of an LM head held blocked in float32 or bfloat16 and
    its index, as the blocked kernel's logits would give them, reading about a quarter of the
    head's bytes (a decode step's largest weight). ``weight`` holds the head's values as GGUF
    Q8_0 codes (an int8 code per value, a float16 scale per 32: decoded exactly in float32) in
    ``kind``'s blocks: WEIGHT_Q8_0, which the C kernel multiplies by each row in float32, or
    WEIGHT_Q8_CODES_F16, by each row quantized to about 16 bits, two int8 passes, in integers
    (AVX-512 VNNI; ``quantize_rows_twice`` in C). ``bounds[0, v]``, per unit of a row's L2
    norm, bounds how far output v's logit through the codes may lie from the head's own: the
    norm of the values' difference plus both float32 sums' rounding (``gamma_n`` = n u / (1 -
    n u) times each row's norm, for n inputs, u = 2^-24); ``bounds[1, v]`` is the norm of its
    codes' values, which times the norm of what quantizing a row missed bounds what that
    changes (Cauchy-Schwarz; the C call takes the larger of the row's norm and its two passes'
    for the first), both a little enlarged. The outputs whose logit can reach the highest
    lower bound are the only ones that may be the largest (its owner among them); they are
    few, and summed exactly, the kernel's way (``screened_argmax`` in C). Its tensors are
    parameters: weights the rank holds, which the memory plan counts."""

    def __init__(
        self,
        native: ModuleType,
        weight: torch.Tensor,
        kind: int,
        bounds: torch.Tensor,
        team: object,
    ) -> None:
        super().__init__()
        self.native, self.kind, self.team = native, kind, team
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bounds = nn.Parameter(bounds, requires_grad=False)

    def argmax(
        self, x: torch.Tensor, head: torch.Tensor, valid: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each row of ``x`` (``[N, in]`` float32) through ``head`` (the weight this screens):
        the largest logit among outputs ``[0, valid)`` and its first index (float32 ``[N]``,
        int64 ``[N]``); None where it does not pay (more than :data:`SCREENED_ROWS_MAX` rows)
        or a row was not settled: its norm or a logit not finite, or more than a sixteenth of
        the outputs (at least 64) within reach of the largest (then compute the logits)."""
        out_features, in_features = head.blocked_shape
        rows = x.shape[0]
        if rows > SCREENED_ROWS_MAX:
            return None
        x = x.contiguous()
        approx = x.new_empty(2 * rows, out_features)
        best = x.new_empty(rows)
        index = torch.empty(rows, dtype=torch.int64, device="cpu")
        bounds = self.bounds
        settled = self.native.screened_argmax(
            head.data_ptr(), head.dtype is torch.bfloat16, self.weight.data_ptr(), self.kind,
            bounds[0].data_ptr(), bounds[1].data_ptr(), x.data_ptr(), rows, out_features,
            in_features, valid, approx.data_ptr(), best.data_ptr(), index.data_ptr(),
            max(64, valid // 16), self.team,
        )  # fmt: skip
        return (best, index) if settled else None


def _q8_0_rows(
    native: ModuleType, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``values`` (``[rows, in]`` float32, ``in`` a multiple of 32) as GGUF Q8_0 rows in C
    (``native.quantize_q8_0``: ggml's reference quantizer's bytes): the raw blocks (uint8
    ``[rows, in / 32 * 34]``), the float32 values they decode to (scale x code: exact, an
    11-bit scale times a 7-bit code) and per row the float64 sums of (value - decoded)^2,
    value^2 and decoded^2 (``[3, rows]``); None where a value or a block's float16 scale is
    not finite."""
    values = values.contiguous()
    rows, in_features = values.shape
    raw = _host_bytes(rows * in_features // 32 * 34).view(rows, -1)
    decoded = torch.empty_like(values)
    sums = torch.empty(3, rows, dtype=torch.float64, device="cpu")
    finite = native.quantize_q8_0(
        values.data_ptr(), rows, in_features, raw.data_ptr(), decoded.data_ptr(), sums.data_ptr()
    )
    return (raw, decoded, sums) if finite else None


def _screen_bounds(in_features: int, sums: torch.Tensor) -> torch.Tensor:
    """:class:`GreedyScreen`'s bounds (``[2, rows]``) of rows screened through their Q8_0
    values, from :func:`_q8_0_rows`' float64 sums: enlarged by 2^-20 of themselves (the
    float64 sums' own rounding is ~n 2^-53), then rounded up to float32."""
    unit = 2.0**-24
    gamma = in_features * unit / (1 - in_features * unit)
    gap, exact, screened = sums.sqrt()
    bound = (gap + gamma * (exact + screened)) * (1 + 2.0**-20)
    return _rounded_up(torch.stack([bound, screened * (1 + 2.0**-20)]))


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    """float64 ``values`` as the float32 values at or above each."""
    rounded = values.float()
    up = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
    return torch.where(rounded.double() < values, up, rounded)


def _host_bytes(size: int) -> torch.Tensor:
    """``size`` uninitialized bytes in host memory, whatever torch's default device."""
    return torch.empty(size, dtype=torch.uint8, device="cpu")


def _loaded(values: torch.Tensor) -> tuple[int, int, int]:
    """A loaded float32 weight as ``pack_file_blocks`` reads it: (address, row stride,
    column stride), in elements (a model keeps its weights column by column: no copy)."""
    return (values.data_ptr(), *values.stride())


def _times(parts: int) -> torch.Tensor:
    """Zeroed seconds for a fused C call to add its parts' times to (host memory, whatever
    torch's default device)."""
    return torch.zeros(parts, dtype=torch.float64, device="cpu")


def _aligned(size: int) -> int:
    """``size`` bytes rounded up to whole 64-byte cache lines."""
    return -(-size // 64) * 64


def _address(tensor: torch.Tensor | None) -> int:
    """A tensor's address for the C path; 0 for none."""
    return 0 if tensor is None else tensor.data_ptr()


def _record(timer: StepTimer, times: torch.Tensor | None) -> None:
    """Give ``timer`` the matmul, attention (and all-reduce) seconds a fused C call measured
    (``times``)."""
    if times is not None:
        timer.record(MATMUL, float(times[0]))
        timer.record(ATTENTION, float(times[1]))
        if times.numel() > 2:
            timer.record(COMM_ALL_REDUCE, float(times[2]))


def _fits(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """A tensor the C path takes: in host memory, contiguous, float32 or bfloat16 (``dtype``
    where given)."""
    if not (tensor.is_cpu and tensor.is_contiguous()):
        return False
    return tensor.dtype in _C_DTYPES if dtype is None else tensor.dtype is dtype


_C_DTYPES = (torch.float32, torch.bfloat16)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` (``[N, heads, d]``) rotated by the angles of
    :meth:`~shardline.layers.rotary.RotaryEmbedding.at`, in float32 (cast back), as HF Llama
    computes it."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    if x.dtype == torch.float32:
        return x * cos + rotated * sin
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


@dataclass(frozen=True)
class KVHeadIndex:
    """Which KV head each query head of a layer reads (``index``: int64, contiguous, one per
    query head, in host memory for the C path), and whether consecutive query heads share each
    KV head (``grouped``: torch's attention reads a shared head itself, GQA; otherwise keys are
    gathered per query head)."""

    index: torch.Tensor
    grouped: bool
    copies: dict[torch.device, torch.Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )

    def on(self, device: torch.device) -> torch.Tensor:
        """``index`` on ``device``, copied there once (a copy per step to a GPU is a
        synchronizing host-to-device transfer in every layer); on the host, ``index`` itself."""
        copy = self.copies.get(device)
        if copy is None:
            copy = self.copies[device] = self.index.to(device)
        return copy

    @classmethod
    def of(cls, index: torch.Tensor) -> KVHeadIndex:
        index = index.to(device="cpu", dtype=torch.int64).contiguous()
        heads, kv_heads = len(index), int(index.max()) + 1
        grouped = heads % kv_heads == 0 and torch.equal(
            index, torch.arange(heads, device=index.device) // (heads // kv_heads)
        )
        return cls(index, grouped)


def per_query_head(
    keys: torch.Tensor, values: torch.Tensor, kv_index: KVHeadIndex
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (heads on dim -3) as the query heads read them: as they are for
    torch's GQA where ``kv_index`` is grouped, else gathered per query head."""
    if kv_index.grouped:
        return keys, values
    index = kv_index.on(keys.device)
    return keys.index_select(-3, index), values.index_select(-3, index)


#: The torch path, shared: it holds no state.
TORCH_KERNELS = TorchKernels()


def layer_kernels(
    device: torch.device,
    environ: Mapping[str, str],
    weight_dtype: torch.dtype | None = None,
    quantized: bool = False,
    codes: bool = False,
    threads: int | None = None,
) -> TorchKernels:
    """The kernels of a model on ``device``: the C path on the CPU where its extension was
    built (and ``SHARDLINE_NATIVE`` in ``environ`` is not ``0``), else the torch path; linear
    weights keep the precision of ``weight_dtype`` (:class:`TorchKernels`), and with
    ``quantized`` the C path holds those it can in quantization blocks (:class:`NativeKernels`;
    elsewhere they stay float32: the same values), with ``codes`` those of 4-bit types and
    Q8_0 as codes multiplied by int8 inputs. The C path's calls share ``threads`` threads
    (None: torch's)."""
    native = native_extension("shardline.layers._kernels", environ)
    if native is None or torch.device(device).type != "cpu":
        return TorchKernels(weight_dtype)
    threads = torch.get_num_threads() if threads is None else threads
    return NativeKernels(native, threads, weight_dtype, quantized, codes)


def held_weight_dtype(
    device: str, dtype: str, weight_dtype: str, environ: Mapping[str, str]
) -> str:
    """The dtype (a name) :func:`layer_kernels` holds a model's linear weights in, for a model
    of ``dtype`` whose weights keep ``weight_dtype``'s precision: float32 weights of bfloat16
    precision are held in bfloat16 where the C linear kernel blocks them, else in ``dtype``."""
    if (dtype, weight_dtype) != ("float32", "bfloat16"):
        return dtype
    native = native_extension("shardline.layers._kernels", environ)
    return weight_dtype if native is not None and _c_linear_runs(native, device) else dtype


def holds_quantization_blocks(device: str, environ: Mapping[str, str]) -> bool:
    """Whether :func:`layer_kernels` with ``quantized`` holds weights in quantization blocks
    on ``device`` (a kind): the C linear kernel runs there, with AVX-512 or with AVX2, FMA
    and F16C."""
    native = native_extension("shardline.layers._kernels", environ)
    return (
        native is not None
        and _c_linear_runs(native, device)
        and native.quantized_linear_available()
    )


def screens_greedy_head(device: str, environ: Mapping[str, str]) -> bool:
    """Whether :func:`layer_kernels`' kernels make a :class:`GreedyScreen` for an LM head they
    hold blocked in float32 or bfloat16 (of finite values, inputs in whole groups of 32): the
    C linear kernel runs on ``device`` (a kind), with its Q8_0 kernel."""
    return holds_quantization_blocks(device, environ)


def _c_linear_runs(native: ModuleType, device: str) -> bool:
    """Whether ``native``'s linear kernel multiplies float32 weights on ``device`` (a kind):
    the CPU, with oneDNN's packing there to fall back on, and AVX-512 or AVX2 with FMA."""
    return packs(device, "float32") and native.blocked_linear_available()
