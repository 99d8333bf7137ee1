"""The decoder layer's operations in C (``shardline.layers._kernels``) against the torch path
they replace, in float32 and bfloat16: RoPE and the cache store bit for bit, the rest within
rounding; odd sizes (tails past the 16-wide lanes), uneven head groups, mixed prefill and
decode steps; inputs the C path does not take go to torch; bad slots and blocks are errors,
not writes."""

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from shardline.layers.attention import AttentionMetadata, KVCache, paged_attention
from shardline.layers.kernels import (
    ROW_WISE_QUERIES,
    TORCH_KERNELS,
    KVHeadIndex,
    NativeKernels,
    TorchKernels,
    blocked,
    layer_kernels,
    per_query_head,
)
from shardline.layers.linear import pack_linear_weights
from shardline.layers.rotary import RotaryEmbedding
from shardline.models.memory import HeldBlocks, HeldKind, block_bytes, merged_block_bytes
from support.cpu_flags import (
    AVX2_FLAGS,
    AVX512_FLAGS,
    has_avx2_f16c,
    has_avx512,
    vendor_family_flags,
)
from support.gguf_values import file_weight, quantized_weight, random_blocks

native_module = pytest.importorskip(
    "shardline.layers._kernels",
    reason="the C extension was not built (pip install found no compiler); torch path only",
)
NATIVE = NativeKernels(native_module)
#: The same C path with each linear shared out among three threads (two helpers).
TEAM = NativeKernels(native_module, threads=3)
#: Whether this CPU runs the C vector kernels (AVX-512, else AVX2 with FMA): the blocked
#: linear kernel and decode attention by KV head (head sizes a multiple of 16).
VECTOR_KERNELS = native_module.blocked_linear_available()
#: Tests of the C linear kernel, which runs where the CPU has AVX-512 or AVX2 with FMA.
needs_c_linear = pytest.mark.skipif(
    not VECTOR_KERNELS,
    reason="the C linear kernel needs AVX-512 or AVX2 with FMA; this CPU has neither (oneDNN runs)",
)
#: The C path holding blocked linear weights in bfloat16 (model.weight_dtype bfloat16).
HALF_WEIGHTS = NativeKernels(native_module, weight_dtype=torch.bfloat16)
#: The C path holding weights in GGUF quantization blocks where they are exact
#: (model.weight_dtype gguf).
BLOCK_WEIGHTS = NativeKernels(native_module, quantized=True)
#: Tests of weights held in quantization blocks, whose kernels need AVX-512 or AVX2 + F16C.
needs_quantized_linear = pytest.mark.skipif(
    not native_module.quantized_linear_available(),
    reason="weights held in quantization blocks need AVX-512, or AVX2 with FMA and F16C",
)
#: Four query heads reading two KV heads, two each (GQA).
GROUPED_4_OVER_2 = KVHeadIndex.of(torch.tensor([0, 0, 1, 1]))


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 4e-6) -> None:
    assert a.shape == b.shape
    assert torch.allclose(a, b, rtol=rel, atol=rel), float((a - b).abs().max())


def test_the_c_path_is_chosen_on_the_cpu_unless_switched_off():
    assert isinstance(layer_kernels(torch.device("cpu"), {}), NativeKernels)
    assert type(layer_kernels(torch.device("cpu"), {"SHARDLINE_NATIVE": "0"})) is TorchKernels
    assert type(layer_kernels(torch.device("cuda", 0), {})) is TorchKernels


@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 100), (16, 7)])
def test_rms_norm_with_and_without_the_residual_add(rows, hidden):
    x, residual, weight = torch.randn(rows, hidden), torch.randn(rows, hidden), torch.rand(hidden)
    _close(NATIVE.rms_norm(x, weight, 1e-5), TORCH_KERNELS.rms_norm(x, weight, 1e-5))
    out, summed = NATIVE.rms_norm(x, weight, 1e-6, residual)
    expected_out, expected_sum = TORCH_KERNELS.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(summed, expected_sum)
    _close(out, expected_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_vocabulary_parallel_lookup_copies_its_ranges_rows_and_zeros_the_rest(dtype):
    """Tokens below, inside and past the range [100, 100 + 64): the C path's rows are the
    torch path's (which masks a lookup of the clamped ids with a multiply by zero)."""
    table = torch.randn(64, 40).to(dtype)
    tokens = torch.tensor([0, 99, 100, 131, 163, 164, 5000, 120, 100])
    expected = TORCH_KERNELS.embedding_rows(tokens, table, 100)
    rows = NATIVE.embedding_rows(tokens, table, 100)
    assert torch.equal(rows, expected)
    assert torch.equal(rows[2], table[0]) and torch.equal(rows[4], table[63])
    assert not rows[[0, 1, 5, 6]].any()
    strided = tokens[::2]  # not contiguous: the torch path
    assert torch.equal(NATIVE.embedding_rows(strided, table, 100), expected[::2])


@pytest.mark.parametrize("rows,size", [(1, 768), (4, 13)])
def test_silu_and_mul(rows, size):
    gate_up = torch.randn(rows, 2 * size) * 8  # far into both tails of the exponential
    _close(NATIVE.silu_and_mul(gate_up), TORCH_KERNELS.silu_and_mul(gate_up))


@pytest.mark.parametrize("rows,q_heads,kv_heads,d", [(1, 9, 3, 64), (7, 5, 2, 8), (3, 2, 2, 6)])
def test_rope_and_cache_store_are_bit_identical(rows, q_heads, kv_heads, d):
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * d)
    rope = RotaryEmbedding(d, 10000.0, 512).at(torch.randint(0, 512, (rows,)))
    slots = torch.randperm(8 * 4)[:rows]
    caches = [KVCache(8, 4, kv_heads, d, torch.float32) for _ in range(2)]
    queries = [
        kernels.rotate_and_store(qkv, q_heads, kv_heads, rope, cache, slots)
        for kernels, cache in zip((NATIVE, TORCH_KERNELS), caches, strict=True)
    ]
    assert torch.equal(queries[0], queries[1])
    assert torch.equal(caches[0].key, caches[1].key)
    assert torch.equal(caches[0].value, caches[1].value)


def _filled_cache(
    kv_heads: int, d: int, num_blocks: int = 40, block_size: int = 4, dtype=torch.float32
) -> KVCache:
    cache = KVCache(num_blocks, block_size, kv_heads, d, dtype)
    cache.key.normal_()
    cache.value.normal_()
    return cache


def _metadata(
    query_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int = 40
) -> AttentionMetadata:
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(starts, seq_lens, torch.zeros(starts[-1], dtype=torch.long), tables)


@pytest.mark.parametrize(
    "kv_index,grouped",
    [
        (torch.arange(6) // 3, True),
        (torch.tensor([0, 0, 1, 1], dtype=torch.int32), True),
        (torch.tensor([1, 0, 1]), False),
        (torch.tensor([0, 0, 1, 0, 0, 0, 1]), False),
    ],
    ids=["grouped", "grouped-int32", "uneven", "five-on-one-kv-head"],
)
@pytest.mark.parametrize(
    "d,block_size",
    [(16, 4), (64, 16), (80, 32), (128, 16), (8, 4)],
    ids=["16x4", "64x16", "80x32", "128x16", "8x4"],
)
def test_decode_attention_over_the_paged_cache(kv_index, grouped, d, block_size):
    """Head sizes the vector kernel takes (multiples of 16: 64 and 128, which it compiles as
    constants, and 80 = 4 + 1 vectors) and one it leaves to the portable loop (8); cached
    tokens in whole and partial groups of 16; the vector kernel's groups of up to 4 query
    heads of a KV head (five: 4 + 1, interleaved with another KV head's). Grouped heads go to
    torch's GQA, the others are gathered per query head."""
    heads, kv_heads = len(kv_index), 2
    kv_index = KVHeadIndex.of(kv_index)
    assert kv_index.grouped is grouped and kv_index.index.dtype is torch.int64
    cache = _filled_cache(kv_heads, d, block_size=block_size)
    metadata = _metadata([1, 1, 1, 1], [1, 9, 23, 70], cache.block_size)
    q = torch.randn(4, heads, d)
    decode = metadata.decode_batch(cache.block_size)
    _close(
        NATIVE.decode_attention(q, cache, decode, 0.3, kv_index),
        TORCH_KERNELS.decode_attention(q, cache, decode, 0.3, kv_index),
    )


@pytest.mark.parametrize("kernels", [NATIVE, TORCH_KERNELS], ids=["C", "torch"])
def test_short_runs_of_queries_attend_row_by_row_as_causal_attention(kernels):
    """A sequence adding up to ``row_wise_queries`` queries in a step (a decode, a
    speculative step's drafts, a short chunk) goes to the decode path, one row per query
    ending at its position; a longer run to the prompt path. Both give what causal attention
    over the cache gives, which the prompt path alone computes (``row_wise_queries`` 0)."""
    kv_index = KVHeadIndex.of(torch.arange(6) // 3)
    cache = _filled_cache(2, 64, block_size=16)
    query_lens, seq_lens = [1, 5, 16, 17], [9, 23, 40, 70]
    metadata = _metadata(query_lens, seq_lens, cache.block_size)
    metadata.row_wise_queries = 16
    decode = metadata.decode_batch(cache.block_size)
    assert decode.rows.tolist() == list(range(1 + 5 + 16))
    assert decode.lengths.tolist() == [9, *range(19, 24), *range(25, 41)]
    q = torch.randn(sum(query_lens), 6, 64)
    got = paged_attention(q, cache, metadata, 0.3, kv_index, kernels)
    reference = _metadata(query_lens, seq_lens, cache.block_size)
    reference.block_tables, reference.row_wise_queries = metadata.block_tables, 0
    assert reference.decode_batch(cache.block_size) is None
    _close(got, paged_attention(q, cache, reference, 0.3, kv_index, kernels), rel=2e-5)


def test_only_kernels_that_attend_in_c_take_several_queries_of_a_sequence_row_by_row():
    """The torch path gathers each row's keys: several rows of one sequence would copy them
    once each, so it takes one-token sequences only."""
    assert TORCH_KERNELS.row_wise_queries(torch.float32) == 1
    assert NATIVE.row_wise_queries(torch.float32) == ROW_WISE_QUERIES
    assert NATIVE.row_wise_queries(torch.bfloat16) == ROW_WISE_QUERIES
    assert NATIVE.row_wise_queries(torch.float16) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 80])
def test_a_query_heads_attention_does_not_depend_on_the_heads_read_with_it(d, dtype):
    """The vector kernel scores the query heads of a KV head together (up to 4 at a time):
    each head's output is bit for bit what it gets alone."""
    kv_index = torch.tensor([0, 0, 1, 0, 0, 0, 1])
    cache = _filled_cache(2, d, block_size=16, dtype=dtype)
    metadata = _metadata([1, 1], [23, 70], cache.block_size)
    q = torch.randn(2, len(kv_index), d).to(dtype)
    decode = metadata.decode_batch(cache.block_size)
    together = NATIVE.decode_attention(q, cache, decode, 0.3, KVHeadIndex.of(kv_index))
    for head in range(len(kv_index)):
        alone = NATIVE.decode_attention(
            q[:, head : head + 1].contiguous(), cache, decode, 0.3, KVHeadIndex.of(kv_index[[head]])
        )
        assert torch.equal(alone[:, 0], together[:, head]), head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [16, 64, 80, 128])
@needs_c_linear
def test_the_avx2_decode_attention_gives_the_widest_kernels_bits(d, dtype):
    """The AVX2 decode attention (what a CPU without AVX-512 runs) against the widest this CPU
    runs (AVX-512 where it has it: otherwise both are AVX2): the same sums in the same order,
    bit for bit, for groups of 1 to 4 query heads of a KV head and cached tokens in whole and
    partial groups of 8 and 16."""
    kv_index = torch.tensor([0, 0, 1, 0, 0, 0, 1])
    cache = _filled_cache(2, d, block_size=16, dtype=dtype)
    decode = _metadata([1, 1, 1, 1], [1, 9, 23, 70], 16).decode_batch(16)
    q = torch.randn(4, len(kv_index), d).to(dtype)
    widest, avx2 = torch.empty_like(q), torch.empty_like(q)
    for out, only_avx2 in ((widest, False), (avx2, True)):
        native_module.decode_attention(
            dtype is torch.bfloat16, q.data_ptr(), cache.key.data_ptr(), cache.value.data_ptr(),
            decode.blocks.data_ptr(), decode.blocks_per_seq, decode.lengths.data_ptr(), 4,
            len(kv_index), kv_index.data_ptr(), 2, d, 16, cache.key.shape[0], 0.3,
            out.data_ptr(), only_avx2,
        )  # fmt: skip
    assert torch.equal(widest, avx2)


@pytest.mark.parametrize("d,block_size", [(64, 16), (80, 32), (8, 4)], ids=["64", "80", "8"])
def test_bfloat16_decode_attention_is_the_float32_kernels_on_the_widened_tensors(d, block_size):
    """bfloat16 keys, values and queries widen to float32 exactly: the vector kernel (head sizes
    that are multiples of 16) computes what it computes on the widened tensors and rounds once,
    bit for bit; every head size stays within a bfloat16 step of torch."""
    bf16 = torch.bfloat16
    kv_index = KVHeadIndex.of(torch.tensor([0, 0, 1, 0, 0, 0, 1]))
    cache = _filled_cache(2, d, block_size=block_size, dtype=bf16)
    wide = KVCache(40, block_size, 2, d, torch.float32)
    wide.key.copy_(cache.key)
    wide.value.copy_(cache.value)
    decode = _metadata([1, 1, 1, 1], [1, 9, 23, 70], block_size).decode_batch(block_size)
    q = torch.randn(4, 7, d).to(bf16)
    got = NATIVE.decode_attention(q, cache, decode, 0.3, kv_index)
    assert got.dtype == bf16
    if d % 16 == 0:
        widened = NATIVE.decode_attention(q.float(), wide, decode, 0.3, kv_index)
        assert torch.equal(got, widened.to(bf16))
    expected = TORCH_KERNELS.decode_attention(q, cache, decode, 0.3, kv_index)
    _close(got.float(), expected.float(), rel=2**-7)


def test_a_kv_head_index_is_copied_to_another_device_once():
    """The torch path gathers keys per query head with the index on the keys' device: made
    there on first use and kept (on a GPU, a copy per layer and step would synchronize)."""
    kv_index = KVHeadIndex.of(torch.tensor([0, 1, 1]))
    assert kv_index.on(torch.device("cpu")) is kv_index.index
    elsewhere = kv_index.on(torch.device("meta"))
    assert elsewhere.is_meta and kv_index.on(torch.device("meta")) is elsewhere
    keys = torch.empty(2, 2, 5, 4, device="meta")  # [batch, kv_heads, tokens, d]
    gathered, _ = per_query_head(keys, keys, kv_index)
    assert gathered.shape == (2, 3, 5, 4) and kv_index.on(torch.device("meta")) is elsewhere


def test_a_step_mixing_prefill_and_decode_attends_alike():
    d, heads, kv_heads = 8, 4, 2
    cache = _filled_cache(kv_heads, d)
    metadata = _metadata([1, 5, 1], [6, 5, 12], cache.block_size)
    q = torch.randn(7, heads, d)
    _close(
        paged_attention(q, cache, metadata, 0.35, GROUPED_4_OVER_2, NATIVE),
        paged_attention(q, cache, metadata, 0.35, GROUPED_4_OVER_2, TORCH_KERNELS),
    )


def test_inputs_the_c_path_does_not_take_go_to_torch():
    x = torch.randn(4, 32, dtype=torch.float64)
    weight = torch.rand(32, dtype=torch.float64)
    assert torch.equal(NATIVE.rms_norm(x, weight, 1e-5), TORCH_KERNELS.rms_norm(x, weight, 1e-5))
    gate_up = torch.randn(8, 3).t()  # not contiguous
    assert torch.equal(NATIVE.silu_and_mul(gate_up), TORCH_KERNELS.silu_and_mul(gate_up))
    elsewhere = torch.empty(4, 6, device="meta")  # not in host memory: no address to give C
    assert NATIVE.silu_and_mul(elsewhere).shape == (4, 3)
    assert NATIVE.rms_norm(elsewhere, torch.ones(6, device="meta"), 1e-5).is_meta


def test_a_slot_or_block_outside_the_cache_is_an_error_not_a_write():
    cache = KVCache(2, 4, 1, 8, torch.float32)
    qkv = torch.randn(1, 3 * 8)
    rope = RotaryEmbedding(8, 10000.0, 16).at(torch.tensor([0]))
    with pytest.raises(IndexError, match="slot 8 is outside the cache's 8 slots"):
        NATIVE.rotate_and_store(qkv, 1, 1, rope, cache, torch.tensor([8]))
    assert not cache.key.any() and not cache.value.any()
    metadata = AttentionMetadata([0, 1], [3], torch.zeros(1, dtype=torch.long), [[5]])
    with pytest.raises(IndexError, match="block 5 is outside the cache's 2 blocks"):
        NATIVE.decode_attention(
            torch.randn(1, 1, 8), cache, metadata.decode_batch(cache.block_size), 1.0,
            KVHeadIndex.of(torch.tensor([0])),
        )  # fmt: skip
    metadata = AttentionMetadata([0, 1], [3], torch.zeros(1, dtype=torch.long), [[1]])
    with pytest.raises(IndexError, match="query head 1 reads KV head 1 of 1"):
        NATIVE.decode_attention(
            torch.randn(1, 2, 8), cache, metadata.decode_batch(cache.block_size), 1.0,
            KVHeadIndex.of(torch.tensor([0, 1])),
        )  # fmt: skip
    with pytest.raises(ValueError, match="norm weight"):
        NATIVE.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-5)


def test_bfloat16_rounds_where_the_torch_path_rounds():
    """RoPE and the cache store bit for bit; the rest within a bfloat16 step (2**-8) of torch,
    which computes the same float32 arithmetic in another order."""
    bf16 = torch.bfloat16
    x, residual, weight = (torch.randn(3, 200).to(bf16) for _ in range(3))
    out, summed = NATIVE.rms_norm(x, weight[0], 1e-5, residual)
    expected_out, expected_sum = TORCH_KERNELS.rms_norm(x, weight[0], 1e-5, residual)
    assert out.dtype == bf16 and torch.equal(summed, expected_sum)
    _close(out.float(), expected_out.float(), rel=2**-7)
    gate_up = (torch.randn(2, 2 * 40) * 4).to(bf16)
    _close(NATIVE.silu_and_mul(gate_up).float(), TORCH_KERNELS.silu_and_mul(gate_up).float(), 2**-7)
    qkv = torch.randn(2, (3 + 2 * 1) * 16).to(bf16)
    rope = RotaryEmbedding(16, 10000.0, 64).at(torch.tensor([5, 40]))
    caches = [KVCache(4, 4, 1, 16, bf16) for _ in range(2)]
    slots = torch.tensor([3, 9])
    queries = [
        kernels.rotate_and_store(qkv, 3, 1, rope, cache, slots)
        for kernels, cache in zip((NATIVE, TORCH_KERNELS), caches, strict=True)
    ]
    assert torch.equal(queries[0], queries[1])
    assert torch.equal(caches[0].key, caches[1].key)
    assert torch.equal(caches[0].value, caches[1].value)
    cache = KVCache(40, 4, 2, 16, bf16)
    cache.key.normal_()
    cache.value.normal_()
    decode = _metadata([1, 1], [7, 18], cache.block_size).decode_batch(cache.block_size)
    q = torch.randn(2, 4, 16).to(bf16)
    _close(
        NATIVE.decode_attention(q, cache, decode, 0.25, GROUPED_4_OVER_2).float(),
        TORCH_KERNELS.decode_attention(q, cache, decode, 0.25, GROUPED_4_OVER_2).float(),
        2**-7,
    )


@pytest.mark.parametrize("rows", [1, 5, 6, 16, 40, 64, 65])
@pytest.mark.parametrize("out_features,in_features", [(100, 37), (64, 16), (130, 576), (320, 40)])
@needs_c_linear
def test_the_c_linear_multiplies_as_f_linear(rows, out_features, in_features):
    """Blocked by 64 outputs (a partial last block, inputs past the 16-wide lanes, one piece
    of 32 inputs and several), every row tile size of both paths (pairs of blocks up to 64
    rows, one block at a time past it), with and without a bias, and a 3-d input; the layout
    takes no more memory than the weight."""
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    blocked = NATIVE.pack_linear(weight)
    assert blocked.shape == (out_features * in_features,)
    assert blocked.blocked_shape == (out_features, in_features)
    x = torch.randn(rows, in_features)
    close = {"rtol": 1e-5, "atol": 5e-4}  # sums of up to 576 products in another order
    torch.testing.assert_close(
        NATIVE.linear(x, blocked, bias), torch.nn.functional.linear(x, weight, bias), **close
    )
    x3 = torch.randn(2, rows, in_features)
    torch.testing.assert_close(
        NATIVE.linear(x3, blocked, None), torch.nn.functional.linear(x3, weight), **close
    )


@pytest.mark.parametrize("out_features", [64, 128, 320, 330, 490])
@needs_c_linear
def test_a_row_gets_the_same_bits_alone_as_in_any_batch(out_features):
    """One row goes through four blocks at a time, then a pair, then one (490: 4 + 2 + 1 full
    blocks and a partial one); up to 64 rows through pairs of blocks a piece at a time, in
    tiles of up to 3 rows; more rows through one block at a time in tiles of up to 6, in one
    pass (on AVX2: halves of a block in tiles of up to 3 rows below 12 rows, quarters in tiles
    of up to 6 from there): each output is the same sum in the same order every way (pairs of
    blocks, an odd block left over, a partial last block, pieces of 32 of the 96 inputs; with a
    bias)."""
    weight, bias = NATIVE.pack_linear(torch.randn(out_features, 96)), torch.randn(out_features)
    x = torch.randn(70, 96)
    batch = NATIVE.linear(x, weight, bias)
    for rows in (1, 2, 3, 4, 7, 11, 12, 13, 64):
        for first in range(0, 70 - rows + 1, rows):
            part = x[first : first + rows]
            assert torch.equal(NATIVE.linear(part, weight, bias), batch[first : first + rows])


@pytest.mark.parametrize("held", [torch.float32, torch.bfloat16], ids=str)
@needs_c_linear
def test_the_avx2_kernels_give_the_widest_kernels_bits(held):
    """The AVX2 kernels (what a CPU without AVX-512 runs), the AVX-512 ones where this CPU has
    them (one row too, which a CPU that halves them takes on AVX2) and those this CPU takes for
    the rows: the same sums in the same order, bit for bit, at every row count and for full,
    paired and partial last blocks."""
    kernels = [native_module.KERNELS_CHOSEN, native_module.KERNELS_AVX2]
    if has_avx512():
        kernels.append(native_module.KERNELS_AVX512)
    for out_features in (64, 130, 330):
        weight = blocked(torch.randn(out_features, 96), native_module.LINEAR_BLOCK, dtype=held)
        bias = torch.randn(out_features)
        for rows in (1, 2, 3, 4, 7, 11, 12, 16, 70):
            x = torch.randn(rows, 96)
            outputs = [torch.empty(rows, out_features) for _ in kernels]
            for y, chosen in zip(outputs, kernels, strict=True):
                native_module.blocked_linear(
                    weight.data_ptr(), x.data_ptr(), y.data_ptr(), bias.data_ptr(), rows,
                    out_features, 96, None, held is torch.bfloat16, chosen,
                )  # fmt: skip
            for y in outputs[1:]:
                assert torch.equal(y, outputs[0]), (out_features, rows)


@needs_c_linear
def test_a_kernels_choice_outside_the_three_is_refused():
    """blocked_linear's last argument names the kernels: an unknown value is refused, naming
    the allowed ones; the AVX-512 ones are refused on a CPU without them."""
    weight = NATIVE.pack_linear(torch.randn(64, 32))
    x, y = torch.randn(1, 32), torch.empty(1, 64)

    def call(kernels: int) -> None:
        native_module.blocked_linear(
            weight.data_ptr(), x.data_ptr(), y.data_ptr(), 0, 1, 64, 32, None,
            native_module.WEIGHT_FLOAT32, kernels,
        )  # fmt: skip

    for wrong in (-1, 3):
        with pytest.raises(ValueError, match=r"kernels = .*allowed: KERNELS_CHOSEN \(0\)"):
            call(wrong)
    if has_avx512():
        call(native_module.KERNELS_AVX512)
        assert torch.equal(y, NATIVE.linear(x, weight, None))
    else:
        with pytest.raises(RuntimeError, match="no AVX-512"):
            call(native_module.KERNELS_AVX512)


@needs_c_linear
@pytest.mark.skipif(
    not os.path.exists("/proc/cpuinfo"),
    reason="reads the CPU's vendor, family and flags from /proc/cpuinfo (Linux only)",
)
def test_one_row_takes_the_avx2_kernels_where_the_cpu_halves_avx512():
    """AMD's family 19h with AVX-512 (Zen 4) runs a 512-bit operation as two 256-bit halves:
    there one row (a decode) of a weight that is not codes, and up to 8 rows of a Q8_0 one, go
    through the AVX2 kernels, which run them faster; more rows, and every row count on other
    CPUs, through the widest kernels the CPU has (the sums are the same:
    test_the_avx2_kernels_give_the_widest_kernels_bits and the block kinds' tests)."""
    vendor, family, flags = vendor_family_flags()
    avx512, avx2 = flags >= AVX512_FLAGS, flags >= AVX2_FLAGS
    halves = avx512 and avx2 and vendor == "AuthenticAMD" and family == 0x19
    kinds = {name: getattr(native_module, f"WEIGHT_{name}") for name in
             ("FLOAT32", "BFLOAT16", "Q4_0", "Q6_K", "Q8_0")}  # fmt: skip
    for name, kind in kinds.items():
        for rows in (1, 2, 3, 8, 9, 16, 70):
            on_avx2 = halves and (rows == 1 or (name == "Q8_0" and rows <= 8))
            expected = "avx512" if avx512 and not on_avx2 else "avx2"
            assert native_module.linear_isa(rows, kind) == expected, (name, rows)


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 70])
@pytest.mark.parametrize("out_features", [64, 130, 330, 6144])
@needs_c_linear
def test_a_team_multiplies_to_the_same_bits_as_one_thread(rows, out_features):
    """Chunks of blocks shared out among three threads (one chunk only, pairs of blocks up to
    64 rows, a partial last block, many more chunks than threads; a bias): each output is computed
    as one thread computes it, call after call as the helpers wake and sleep."""
    assert native_module.team_threads(TEAM.team) == 3
    weight, bias = NATIVE.pack_linear(torch.randn(out_features, 96)), torch.randn(out_features)
    x = torch.randn(rows, 96)
    alone = NATIVE.linear(x, weight, bias)
    for call in range(30):
        if call % 10 == 9:
            time.sleep(0.005)  # past the helpers' spin and yield: they sleep, then are woken
        assert torch.equal(TEAM.linear(x, weight, bias), alone)


@needs_c_linear
def test_threads_calling_through_one_team_at_once_each_get_their_own_product():
    """The linear runs without the GIL: a call made while another thread's has the team runs
    alone in its thread, and neither sees the other's work."""
    weights = [NATIVE.pack_linear(torch.randn(640, 96)) for _ in range(3)]
    inputs = [torch.randn(rows, 96) for rows in (1, 3, 16)]
    expected = [NATIVE.linear(x, w, None) for x, w in zip(inputs, weights, strict=True)]
    wrong: list[int] = []

    def multiply(which: int) -> None:
        for _ in range(200):
            if not torch.equal(TEAM.linear(inputs[which], weights[which], None), expected[which]):
                wrong.append(which)

    threads = [threading.Thread(target=multiply, args=(which,)) for which in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads) and not wrong


def test_a_teams_helpers_live_as_long_as_it():
    """team(3) starts two threads, named; they end when it is freed. A team needs 1 to 4096
    threads."""
    before = set(os.listdir("/proc/self/task"))
    team = native_module.team(3)
    helpers = set(os.listdir("/proc/self/task")) - before
    assert len(helpers) == 2 and native_module.team_threads(team) == 3
    for helper in helpers:  # named for top -H and py-spy
        with open(f"/proc/self/task/{helper}/comm", encoding="ascii") as comm:
            assert comm.read().strip() == "shardline-team"
    del team  # joins the helpers
    # A joined thread may stay listed a moment: its ID is released before its task entry.
    deadline = time.monotonic() + 5.0
    while helpers & set(os.listdir("/proc/self/task")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not helpers & set(os.listdir("/proc/self/task"))
    assert native_module.team_threads(None) == 1
    for threads in (0, -1, 4097):
        with pytest.raises(ValueError, match=f"threads = {threads}; allowed: 1 to 4096"):
            native_module.team(threads)


@needs_c_linear
def test_a_forked_child_runs_a_teams_calls_alone():
    """A forked child has none of the helper threads: its copy of the team runs every chunk
    in the calling thread, with the same results."""
    weight, x = NATIVE.pack_linear(torch.randn(330, 96)), torch.randn(1, 96)
    expected = NATIVE.linear(x, weight, None)
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when it ran alone and got the same bits
        alone = native_module.team_threads(TEAM.team) == 1
        os._exit(0 if alone and torch.equal(TEAM.linear(x, weight, None), expected) else 1)
    deadline = time.monotonic() + 30
    while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if ended[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not finish its linear within 30 s")
    assert os.waitstatus_to_exitcode(ended[1]) == 0


@needs_c_linear
def test_a_models_blocked_weights_lie_back_to_back_in_packing_order():
    """weight_packer puts the blocked weights in one buffer, each where the one before ended
    (rounded up to a cache line), in the order they are packed; a weight the C kernel does
    not take (bfloat16) is packed as before and takes no room; more than the packer was
    made for is an error, not a write past the buffer."""
    weights = [torch.randn(70, 3), torch.randn(64, 8).bfloat16(), torch.randn(130, 9)]
    pack = NATIVE.weight_packer(weights)
    first, other, last = (pack(weight) for weight in weights)
    assert other.dim() == 2 and other.dtype is torch.bfloat16
    assert first.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()
    assert last.data_ptr() - first.data_ptr() == 4 * 224  # 210 floats, to 14 cache lines
    x = torch.randn(2, 9)
    torch.testing.assert_close(NATIVE.linear(x, last, None), x @ weights[2].t())
    with pytest.raises(ValueError, match="weight arena"):
        pack(torch.randn(70, 3))


@needs_c_linear
def test_packing_a_model_gives_each_kernels_object_one_packer_in_module_order():
    """pack_linear_weights packs every module with a ``pack`` method in module order, with
    one packer per kernels object: the C kernels' weights end up back to back."""

    class Layer(torch.nn.Module):
        def __init__(self, out_features: int, kernels) -> None:
            super().__init__()
            self.kernels, self.weight = kernels, torch.randn(out_features, 16)

        def pack(self, packer) -> None:
            self.weight = packer(self.weight)

    model = torch.nn.Sequential(Layer(64, NATIVE), Layer(32, TORCH_KERNELS), Layer(80, NATIVE))
    pack_linear_weights(model)
    first, other, last = (layer.weight for layer in model)
    assert first.dim() == last.dim() == 1 and other.dim() == 2
    assert last.data_ptr() - first.data_ptr() == 4 * 64 * 16


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64, 65])
@pytest.mark.parametrize("out_features,in_features", [(100, 37), (130, 576), (320, 40), (6, 9)])
@needs_c_linear
def test_bfloat16_weights_give_the_sums_of_float32_weights_rounded_to_bfloat16(
    rows, out_features, in_features
):
    """A weight held in bfloat16 (half the bytes; every path: pairs of blocks a piece at a
    time, one row, a partial last block of any width, tiles past 64 rows; alone and on a team
    of three) multiplies to the very bits of its float32 copy rounded to bfloat16, and the
    torch path with weight_dtype bfloat16 rounds its weight the same way."""
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    rounded = weight.bfloat16().float()
    held = HALF_WEIGHTS.pack_linear(weight.clone())
    assert held.dtype is torch.bfloat16 and held.shape == (out_features * in_features,)
    assert held.blocked_shape == (out_features, in_features)
    team = NativeKernels(native_module, threads=3, weight_dtype=torch.bfloat16)
    x = torch.randn(rows, in_features)
    expected = NATIVE.linear(x, NATIVE.pack_linear(rounded), bias)
    assert torch.equal(HALF_WEIGHTS.linear(x, held, bias), expected)
    assert torch.equal(team.linear(x, held, bias), expected)
    torch_path = TorchKernels(torch.bfloat16)
    original = weight.clone()
    torch.testing.assert_close(
        torch_path.linear(x, torch_path.pack_linear(weight), bias),
        torch.nn.functional.linear(x, rounded, bias),
        rtol=1e-5,
        atol=5e-4,
    )  # fmt: skip  (sums of up to 576 products in another order)
    assert torch.equal(weight, original)  # a table the head shares stays as it is


@needs_c_linear
def test_bfloat16_weights_lie_back_to_back_on_cache_lines():
    """A bfloat16 packer's weights share one bfloat16 buffer, each on a cache line (32
    elements) after the one before."""
    weights = [torch.randn(70, 3), torch.randn(130, 9)]
    pack = HALF_WEIGHTS.weight_packer(weights)
    first, last = (pack(weight) for weight in weights)
    assert first.dtype is last.dtype is torch.bfloat16
    assert last.data_ptr() - first.data_ptr() == 2 * 224  # 210 elements, to 7 cache lines


def test_another_dtype_keeps_onednn():
    weight = torch.randn(64, 32)
    assert NATIVE.pack_linear(weight.to(torch.bfloat16)).dim() == 2
    x = torch.randn(3, 32, dtype=torch.float64)
    torch.testing.assert_close(
        NATIVE.linear(x, NATIVE.pack_linear(weight.double()), None),
        x.double() @ weight.double().t(),
    )


def _layer_blocks(hidden: int, heads: tuple[int, int, int], size: int, bias: bool, kernels=NATIVE):
    """A decoder layer's weights (random, blocked for ``kernels``' C linear kernel) and their
    blocks."""
    if not native_module.blocked_linear_available():
        pytest.skip(
            "the fused layer calls need the C linear kernel: AVX-512 or AVX2 with FMA, which "
            "this CPU lacks"
        )
    q_heads, kv_heads, d = heads
    weights = {
        "input_norm": torch.rand(hidden) + 0.5,
        "qkv": torch.randn((q_heads + 2 * kv_heads) * d, hidden) * 0.1,
        "qkv_bias": torch.randn((q_heads + 2 * kv_heads) * d) if bias else None,
        "o": torch.randn(hidden, q_heads * d) * 0.1,
        "post_norm": torch.rand(hidden) + 0.5,
        "gate_up": torch.randn(2 * size, hidden) * 0.1,
        "gate_up_bias": torch.randn(2 * size) if bias else None,
        "down": torch.randn(hidden, size) * 0.1,
        "o_bias": torch.randn(hidden) if bias else None,
        "down_bias": torch.randn(hidden) if bias else None,
    }
    for name in ("qkv", "o", "gate_up", "down"):
        weights[name] = kernels.pack_linear(weights[name])
    kv_index = KVHeadIndex.of(torch.tensor([0, 1, 1])[:q_heads])  # uneven, as SmolLM2's TP rank
    blocks = kernels.layer_blocks(
        input_norm=(weights["input_norm"], 1e-5), qkv=(weights["qkv"], weights["qkv_bias"]),
        heads=heads, kv_index=kv_index, scale=0.3, o_proj=(weights["o"], weights["o_bias"]),
        post_norm=(weights["post_norm"], 1e-6),
        gate_up=(weights["gate_up"], weights["gate_up_bias"]),
        down=(weights["down"], weights["down_bias"]),
    )  # fmt: skip
    assert blocks is not None
    return weights, kv_index, blocks


def _three_decodes():
    """A step of three one-token sequences (3, 17 and 30 tokens, blocks of 4, head size 32),
    each writing its last slot: ``(metadata, its decode batch, the step's rope)``."""
    metadata = _metadata([1, 1, 1], [3, 17, 30], 4)
    metadata.slot_mapping = torch.tensor(
        [table[(n - 1) // 4] * 4 + (n - 1) % 4 for table, n in zip(
            metadata.block_tables, metadata.seq_lens, strict=True)]
    )  # fmt: skip
    rope = RotaryEmbedding(32, 10000.0, 64).at(torch.tensor(metadata.seq_lens) - 1)
    return metadata, metadata.decode_batch(4), rope


@pytest.mark.parametrize("bias", [False, True])
def test_a_fused_layer_half_is_its_operations_one_by_one(bias):
    """attention_block and mlp_block against the kernels they chain, called one by one on the
    same inputs: bit-identical results and cache writes (uneven heads, a head size and widths
    past the 16-wide lanes, several sequences, with and without the residual and biases)."""
    heads, hidden, size = (3, 2, 32), 72, 40
    weights, kv_index, blocks = _layer_blocks(hidden, heads, size, bias)
    metadata, decode, rope = _three_decodes()
    x, residual = torch.randn(3, hidden), torch.randn(3, hidden)
    for start in (None, residual):
        fused_cache, single_cache = _filled_cache(2, 32), _filled_cache(2, 32)
        single_cache.key.copy_(fused_cache.key)
        single_cache.value.copy_(fused_cache.value)
        partial, new_residual = NATIVE.attention_block(
            blocks, x, start, rope, fused_cache, metadata.slot_mapping, decode
        )
        if start is None:
            normed, expected_residual = NATIVE.rms_norm(x, weights["input_norm"], 1e-5), x
        else:
            normed, expected_residual = NATIVE.rms_norm(x, weights["input_norm"], 1e-5, start)
        qkv = NATIVE.linear(normed, weights["qkv"], weights["qkv_bias"])
        q = NATIVE.rotate_and_store(qkv, 3, 2, rope, single_cache, metadata.slot_mapping)
        attended = NATIVE.decode_attention(q, single_cache, decode, 0.3, kv_index)
        expected = NATIVE.linear(attended.reshape(3, -1), weights["o"], None)
        assert torch.equal(partial, expected) and torch.equal(new_residual, expected_residual)
        assert torch.equal(fused_cache.key, single_cache.key)
        assert torch.equal(fused_cache.value, single_cache.value)
    partial, new_residual = NATIVE.mlp_block(blocks, x, residual)
    normed, expected_residual = NATIVE.rms_norm(x, weights["post_norm"], 1e-6, residual)
    gate_up = NATIVE.linear(normed, weights["gate_up"], weights["gate_up_bias"])
    expected = NATIVE.linear(NATIVE.silu_and_mul(gate_up), weights["down"], None)
    assert torch.equal(partial, expected) and torch.equal(new_residual, expected_residual)


class _OneRank:
    """A tensor-parallel group of one rank: nothing to reduce between the halves."""

    world_size = 1


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_every_layer_in_one_call_is_the_layers_one_by_one(bias, threads):
    """decode_layers (three layers, one rank; its linears on one thread or shared by a team
    of three) against each layer's fused halves with the row-parallel bias and the residual
    stream between them, as the decoder layer chains them: the same bits out and in the
    caches, starting with no residual (the first stage) and with one (a later pipeline
    stage)."""
    kernels = TEAM if threads == 3 else NATIVE
    heads, hidden, size = (3, 2, 32), 72, 40
    layers = [_layer_blocks(hidden, heads, size, bias) for _ in range(3)]
    metadata, decode, rope = _three_decodes()
    x, residual = torch.randn(3, hidden), torch.randn(3, hidden)
    for start in (None, residual):
        caches = [_filled_cache(2, 32) for _ in layers]
        copies = [KVCache(40, 4, 2, 32, torch.float32) for _ in layers]
        for cache, copy in zip(caches, copies, strict=True):
            copy.key.copy_(cache.key)
            copy.value.copy_(cache.value)
        stack = kernels.layer_stack([blocks for _, _, blocks in layers], caches)
        got, got_residual = kernels.decode_layers(
            stack, x, start, rope, metadata.slot_mapping, decode, _OneRank()
        )
        expected, stream = x, start
        for (weights, _, blocks), cache in zip(layers, copies, strict=True):
            partial, stream = NATIVE.attention_block(
                blocks, expected, stream, rope, cache, metadata.slot_mapping, decode
            )
            expected = partial if weights["o_bias"] is None else partial + weights["o_bias"]
            partial, stream = NATIVE.mlp_block(blocks, expected, stream)
            expected = partial if weights["down_bias"] is None else partial + weights["down_bias"]
        assert torch.equal(got, expected) and torch.equal(got_residual, stream)
        for cache, copy in zip(caches, copies, strict=True):
            assert torch.equal(cache.key, copy.key) and torch.equal(cache.value, copy.value)


def test_layers_with_bfloat16_weights_run_as_with_float32_weights_rounded_to_them():
    """decode_layers and the fused halves of layers whose weights are held in bfloat16: the
    bits of the same layers with float32 weights rounded to bfloat16 (three layers, with
    biases, one rank)."""
    heads, hidden, size = (3, 2, 32), 72, 40
    rounded, held = [], []
    for seed in range(3):
        torch.manual_seed(seed)
        held.append(_layer_blocks(hidden, heads, size, True, HALF_WEIGHTS)[2])
        torch.manual_seed(seed)
        rounded.append(_layer_blocks(hidden, heads, size, True, _Rounding())[2])
    assert all(b.weight_kinds == (native_module.WEIGHT_BFLOAT16,) * 4 for b in held)
    assert all(b.weight_kinds == (native_module.WEIGHT_FLOAT32,) * 4 for b in rounded)
    _assert_layers_run_alike((held, HALF_WEIGHTS), (rounded, NATIVE), hidden)


def _assert_layers_run_alike(first, second, hidden: int) -> None:
    """Two stacks of layers (each ``(layers, kernels)``) give the same bits through
    decode_layers (three decodes, the same cached keys and values) and the first layer's
    fused MLP half."""
    metadata, decode, rope = _three_decodes()
    x = torch.randn(3, hidden)
    results = []
    for layers, kernels in (first, second):
        torch.manual_seed(3)  # the same cached keys and values for both
        caches = [_filled_cache(2, 32) for _ in layers]
        stack = kernels.layer_stack(layers, caches)
        out = kernels.decode_layers(stack, x, None, rope, metadata.slot_mapping, decode, _OneRank())
        half = kernels.mlp_block(layers[0], x, x)
        results.append((out, half, [c.key for c in caches]))
    (out, half, keys), (expected, expected_half, expected_keys) = results
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
    assert torch.equal(half[0], expected_half[0])
    assert all(torch.equal(a, b) for a, b in zip(keys, expected_keys, strict=True))


GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
              "Q6_K")  # fmt: skip
#: The kind each type is held in alone: the first that holds it (quantized_blocks.h).
HELD_AS = {
    "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q8_0", "IQ4_NL": "Q8_0",
    "Q4_K": "Q4_K", "Q6_K": "Q6_K", "Q3_K": "Q6_K", "Q5_K": "Q5_K", "Q5_1": "Q5_K",
}  # fmt: skip
BYTES_PER_WEIGHT = {
    "Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q4_K": 24 / 32, "Q5_K": 28 / 32,
    "Q6_K": 40 / 32, "INT8_SCALED": 48 / 32,
}  # fmt: skip


def _assert_multiplies_as_float32(held, weight, rows):
    """``held`` gives the float32 kernel's bits for ``weight``: with a bias, on a team of
    three, on the AVX2 kernels where this CPU runs them and on the AVX-512 ones where it has
    them (also for one row, which a CPU that halves them takes on AVX2)."""
    out_features, in_features = weight.shape
    bias = torch.randn(out_features)
    x = torch.randn(rows, in_features)
    expected = _float32_product(x, weight, bias)
    assert torch.equal(BLOCK_WEIGHTS.linear(x, held, bias), expected)
    team = NativeKernels(native_module, threads=3, quantized=True)
    assert torch.equal(team.linear(x, held, None), _float32_product(x, weight))
    kernels = [native_module.KERNELS_AVX2] if has_avx2_f16c() else []
    kernels += [native_module.KERNELS_AVX512] if has_avx512() else []
    for chosen in kernels:
        y = torch.empty(rows, out_features)
        native_module.blocked_linear(
            held.data_ptr(), x.data_ptr(), y.data_ptr(), bias.data_ptr(), rows, out_features,
            in_features, None, held.weight_kind, chosen,
        )  # fmt: skip
        assert torch.equal(y, expected), chosen


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 65])
@pytest.mark.parametrize("kind", GGUF_TYPES)
@needs_quantized_linear
def test_a_weight_held_as_its_files_blocks_gives_the_bits_of_its_float32_weight(kind, rows):
    """A weight decoded from a GGUF file's blocks of any type, carrying them, is held as
    them: Q4_0, Q4_1 and Q4_K in their own kinds, Q8_0, Q5_0 and IQ4_NL in Q8_0 blocks, Q5_K
    and Q5_1 as Q5_K, Q6_K and Q3_K as Q6_K, any other type split (INT8_SCALED), in whole
    blocks of 64 outputs; and
    multiplies to the very
    bits of the float32 kernel (one row, four blocks at a time and one, tiles of rows, partial
    last blocks, a bias; alone, on a team of three, on the AVX2 and the AVX-512 kernels)."""
    rng = np.random.default_rng([GGUF_TYPES.index(kind), rows])
    shapes = [(130, 512), (330, 256), (7, 256)] if kind.endswith("_K") else [
        (100, 64), (130, 576), (330, 64), (7, 96)]  # fmt: skip
    for out_features, in_features in shapes:
        weight = file_weight([(kind, random_blocks(kind, out_features, in_features, rng))],
                             out_features)  # fmt: skip
        held = BLOCK_WEIGHTS.pack_linear(weight)
        held_as = HELD_AS.get(kind, "INT8_SCALED")
        assert held.held_as == held_as and held.dtype is torch.uint8
        assert held.blocked_shape == (out_features, in_features)
        padded = -(-out_features // 64) * 64
        assert held.numel() == padded * in_features * BYTES_PER_WEIGHT[held_as]
        _assert_multiplies_as_float32(held, weight, rows)


@needs_quantized_linear
def test_a_weight_of_parts_of_several_types_is_held_in_the_first_kind_holding_them_all():
    """A merged projection's parts: Q4_0 with Q8_0 in Q8_0 blocks; Q6_K with Q5_0 as Q6_K;
    Q4_K with Q5_K, or Q4_1 with Q5_1, as Q5_K; Q4_1 with Q8_0, or Q4_K with Q6_K (a
    Q4_K_M file's query/key and value projections), split; vocabulary padding rows after
    them held as zeros."""
    rng = np.random.default_rng(5)
    for (first, second), held_as in (
        (("Q4_0", "Q8_0"), "Q8_0"), (("Q6_K", "Q5_0"), "Q6_K"), (("Q4_K", "Q5_K"), "Q5_K"),
        (("Q4_1", "Q5_1"), "Q5_K"), (("Q4_1", "Q8_0"), "INT8_SCALED"),
        (("Q4_K", "Q6_K"), "INT8_SCALED"),
    ):  # fmt: skip
        parts = [(first, random_blocks(first, 70, 512, rng)),
                 (second, random_blocks(second, 60, 512, rng))]  # fmt: skip
        weight = file_weight(parts, 136)
        held = BLOCK_WEIGHTS.pack_linear(weight)
        assert held.held_as == held_as
        _assert_multiplies_as_float32(held, weight, 3)


@needs_quantized_linear
def test_a_merged_weight_whose_parts_cheaper_kinds_differ_is_held_in_segments():
    """Parts starting on blocks of 64 outputs whose types different kinds hold first (Q4_K
    queries and keys with Q6_K values, as a Q4_K_M file's; Q4_0 with Q8_0) are held each in
    its own kind (runs of one kind together), padding rows in the last, behind a 64-byte
    table: fewer bytes than the one kind holding them all, and the float32 kernel's bits;
    parts not starting on a block stay in one kind."""
    rng = np.random.default_rng(8)
    for types, rows, held_as in (
        (("Q4_K", "Q4_K", "Q6_K"), (128, 64, 64), "Q4_K+Q6_K"),
        (("Q6_K", "Q4_K", "Q5_K", "Q6_K"), (64, 64, 128, 70), "Q6_K+Q4_K+Q5_K+Q6_K"),
        (("Q4_0", "Q8_0"), (64, 96), "Q4_0+Q8_0"),
    ):
        inputs = 256 if types[0].endswith("_K") else 96
        parts = [(t, random_blocks(t, n, inputs, rng)) for t, n in zip(types, rows, strict=True)]
        out_features = sum(rows) + 9
        weight = file_weight(parts, out_features)
        held = BLOCK_WEIGHTS.pack_linear(weight)
        assert held.held_as == held_as and held.weight_kind == native_module.WEIGHT_SEGMENTED
        segments, blocks, first = held_as.split("+"), [], 0
        for kind, end in zip(segments, _run_ends(types, rows, out_features), strict=True):
            code = getattr(native_module, f"WEIGHT_{kind}")
            blocks.append(native_module.quantized_size(code, end - first, inputs))
            first = end
        assert held.numel() == native_module.SEGMENT_TABLE_BYTES + sum(blocks)
        one_kind = native_module.quantized_size(native_module.WEIGHT_INT8_SCALED, out_features,
                                                inputs)  # fmt: skip
        assert held.numel() < one_kind
        for rows_in in (1, 5, 16):
            _assert_multiplies_as_float32(held, weight, rows_in)
    unaligned = file_weight([("Q4_K", random_blocks("Q4_K", 100, 256, rng)),
                             ("Q6_K", random_blocks("Q6_K", 28, 256, rng))], 128)  # fmt: skip
    assert BLOCK_WEIGHTS.pack_linear(unaligned).held_as == "INT8_SCALED"


def _run_ends(types, rows, out_features):
    """Where each run of parts of one type (each held in its own kind) ends (the last at
    ``out_features``)."""
    ends, at = [], 0
    for i, n in enumerate(rows):
        at += n
        if i + 1 == len(rows) or types[i + 1] != types[i]:
            ends.append(at)
    ends[-1] = out_features
    return ends


@needs_quantized_linear
def test_file_blocks_that_are_not_the_loaded_values_or_rows_are_refused():
    """pack_file_blocks says False where one loaded value is not its block's (a float32 ulp
    off), a row no part covers is not zeros, or the kind does not hold a part's type; and
    refuses parts outside the weight, overlapping, or naming no block type."""
    raw = random_blocks("Q4_K", 64, 256, np.random.default_rng(3))
    weight = file_weight([("Q4_K", raw)], 72)
    code = native_module.WEIGHT_INT8_SCALED
    held = torch.empty(native_module.quantized_size(code, 72, 256), dtype=torch.uint8)
    part = ("Q4_K", raw.ctypes.data, raw.strides[0], 0, 64)

    def pack(values, parts, kind=code):
        loaded = (values.data_ptr(), *values.stride())
        return native_module.pack_file_blocks(kind, held.data_ptr(), 72, 256, loaded, parts,
                                              None)  # fmt: skip

    assert pack(weight, [part])
    nudged = weight.clone()
    nudged[40, 100] = torch.nextafter(nudged[40, 100], torch.tensor(1.0))
    assert not pack(nudged, [part])
    padding = weight.clone()
    padding[70, 3] = 1.0
    assert not pack(padding, [part])
    assert not pack(weight, [part], native_module.WEIGHT_Q8_0)
    with pytest.raises(ValueError, match=r"part 0, rows \[40, 104\), lies outside out 72"):
        pack(weight, [(*part[:3], 40, 64)])
    with pytest.raises(ValueError, match="parts overlap at row 32"):
        pack(weight, [part, (*part[:3], 32, 8)])
    with pytest.raises(ValueError, match="no block type IQ2_XXS"):
        pack(weight, [("IQ2_XXS", *part[1:])])
    last_kind = native_module.WEIGHT_SEGMENTED - 1
    with pytest.raises(ValueError, match=f"kind 1; allowed: 2 to {last_kind}"):
        pack(weight, [part], native_module.WEIGHT_BFLOAT16)


@needs_quantized_linear
def test_a_team_holds_a_weight_in_the_same_bytes_as_one_thread():
    """Packing shared out by a team of three (blocks of 64 rows a chunk, as a rank with
    three threads packs its layers) lays out the very bytes one thread does, for each kind,
    segments and a vocabulary's padding rows included, and so does a weight kept column by
    column (as a model keeps them); a refused value is refused alike."""
    rng = np.random.default_rng(9)
    team = NativeKernels(native_module, threads=3, quantized=True)
    weights = [
        file_weight([(t, random_blocks(t, 300, 256, rng))], 333)
        for t in ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q8_0", "Q6_K", "Q2_K")
    ]
    weights.append(file_weight([("Q4_K", random_blocks("Q4_K", 128, 256, rng)),
                                ("Q6_K", random_blocks("Q6_K", 100, 256, rng))], 230))  # fmt: skip
    for weight in weights:
        alone, shared = BLOCK_WEIGHTS.pack_linear(weight), team.pack_linear(weight)
        assert shared.held_as == alone.held_as and torch.equal(shared, alone)
        by_columns = weight.t().contiguous().t()
        by_columns.file_blocks = weight.file_blocks
        assert torch.equal(team.pack_linear(by_columns), alone)
    for nudged in (weights[2].clone(), weights[2].t().contiguous().t()):
        nudged[250, 7] = torch.nextafter(nudged[250, 7], torch.tensor(1.0))
        nudged.file_blocks = weights[2].file_blocks
        assert team.pack_linear(nudged).dtype is torch.float32


@needs_quantized_linear
def test_weights_without_their_blocks_stay_float32():
    """Weights carrying no file blocks (random values; the same values as a file's blocks,
    but without them), or inputs not in whole groups of 32, are held blocked in float32 (and
    still multiply right); the torch path and a C path without ``quantized`` never hold
    blocks."""
    rng = np.random.default_rng(4)
    blocked = file_weight([("Q4_1", random_blocks("Q4_1", 64, 64, rng))], 64)
    uneven = file_weight([("IQ4_NL", random_blocks("IQ4_NL", 64, 32, rng))], 64)[:, :24]
    uneven.file_blocks = blocked.file_blocks
    for weight in (torch.randn(64, 64), blocked.clone(), uneven):
        held = BLOCK_WEIGHTS.pack_linear(weight)
        assert held.dtype is torch.float32 and not hasattr(held, "held_as")
        x = torch.randn(3, weight.shape[1])
        assert torch.equal(BLOCK_WEIGHTS.linear(x, held, None), _float32_product(x, weight))
    assert NATIVE.pack_linear(blocked).dtype is torch.float32
    assert TorchKernels().pack_linear(blocked).dtype is torch.float32


@needs_quantized_linear
def test_block_kinds_are_tried_fewest_bytes_first_and_lie_back_to_back():
    """A model's weights share one buffer, each in the first kind that holds its blocks, each
    on a cache line after the one before; a float32 one among them too."""
    rng = np.random.default_rng(6)
    weights = [
        file_weight([("Q4_1", random_blocks("Q4_1", 64, 64, rng))], 64),
        file_weight([("Q4_0", random_blocks("Q4_0", 70, 32, rng))], 70),
        torch.randn(64, 32),
        file_weight([("Q6_K", random_blocks("Q6_K", 64, 256, rng))], 64),
        file_weight([("Q8_0", random_blocks("Q8_0", 64, 64, rng))], 64),
    ]
    pack = BLOCK_WEIGHTS.weight_packer(weights)
    held = [pack(weight) for weight in weights]
    assert [getattr(h, "held_as", None) for h in held] == [
        "Q4_1", "Q4_0", None, "Q6_K", "Q8_0"
    ]  # fmt: skip
    starts = [h.data_ptr() for h in held]
    sizes = [h.numel() * h.element_size() for h in held]
    assert len({h.untyped_storage().data_ptr() for h in held}) == 1
    assert starts == [starts[0] + sum(-(-size // 64) * 64 for size in sizes[:i]) for i in range(5)]
    for weight, h in zip(weights, held, strict=True):
        x = torch.randn(2, weight.shape[1])
        assert torch.equal(BLOCK_WEIGHTS.linear(x, h, None), _float32_product(x, weight))


@needs_quantized_linear
def test_a_weight_of_blocks_is_refused_where_its_kernel_cannot_run():
    """The C call refuses a quantized kind for inputs not in whole groups and an unknown
    kind, naming what it needs."""
    weight = file_weight([("Q8_0", random_blocks("Q8_0", 64, 64, np.random.default_rng(7)))], 64)
    held = BLOCK_WEIGHTS.pack_linear(weight)
    x, y = torch.randn(1, 64), torch.empty(1, 64)

    def call(in_features: int, kind: int) -> None:
        native_module.blocked_linear(
            held.data_ptr(), x.data_ptr(), y.data_ptr(), 0, 1, 64, in_features, None, kind, False
        )

    with pytest.raises(ValueError, match="whole groups of 32"):
        call(40, held.weight_kind)
    segmented = native_module.WEIGHT_SEGMENTED
    with pytest.raises(ValueError, match=f"allowed: 0 to {segmented}"):
        call(64, segmented + 1)


@needs_quantized_linear
def test_layers_with_weights_in_blocks_run_as_with_their_float32_weights():
    """decode_layers and the fused halves of layers whose weights are held in quantization
    blocks (each layer another kind; the last's merged weights in two, segments): the bits of
    the same layers with the float32 weights."""
    heads, hidden, size = (3, 2, 32), 64, 64
    held, plain = [], []
    types = ("Q4_1", "Q8_0", "Q4_0", "Q5_1", "Q4_0/Q8_0")
    for seed, kind in enumerate(types):
        torch.manual_seed(seed)
        held.append(_layer_blocks(hidden, heads, size, True, _FileBlocks(kind, True))[2])
        torch.manual_seed(seed)
        plain.append(_layer_blocks(hidden, heads, size, True, _FileBlocks(kind, False))[2])
    kinds = [getattr(native_module, f"WEIGHT_{k}") for k in ("Q4_1", "Q8_0", "Q4_0", "Q5_K")]
    segmented, q4_0 = native_module.WEIGHT_SEGMENTED, native_module.WEIGHT_Q4_0
    assert [b.weight_kinds for b in held] == [
        *((k,) * 4 for k in kinds),
        (segmented, q4_0, segmented, q4_0),
    ]
    _assert_layers_run_alike((held, NATIVE), (plain, NATIVE), hidden)


def _float32_product(x, weight, bias=None):
    """``x W^T + b`` by the C kernel with ``weight`` held in float32."""
    return NATIVE.linear(x, NATIVE.pack_linear(weight), bias)


class _FileBlocks(NativeKernels):
    """The C path with weights quantized to a GGUF type's blocks and decoded again, carrying
    them: held as those blocks (``quantized``) or in float32. ``kind`` "A/B": the first 64
    rows of type A, the rest of type B."""

    def __init__(self, kind: str, quantized: bool) -> None:
        super().__init__(native_module, quantized=quantized)
        self.kind = kind

    def pack_linear(self, weight):
        first, _, rest = self.kind.partition("/")
        if not rest or weight.shape[0] <= 64:
            return super().pack_linear(quantized_weight(weight, first))
        from support.requantized import quantized

        rows = weight.float().numpy()
        parts = [(first, quantized(rows[:64], first)), (rest, quantized(rows[64:], rest))]
        return super().pack_linear(file_weight(parts, weight.shape[0]))


class _Rounding(NativeKernels):
    """The C path with float32 weights whose values are rounded to bfloat16."""

    def __init__(self) -> None:
        super().__init__(native_module)

    def pack_linear(self, weight):
        return super().pack_linear(weight.bfloat16().float())


@pytest.mark.parametrize("d", [32, 24])
def test_long_sequences_are_attended_in_pieces_merged_as_one_softmax(d):
    """Past 256 tokens a fused layer run by a team attends a sequence's KV heads in pieces of
    256 tokens, shared out over its threads, and merges them by their softmax sums (here 600,
    20 and 290 tokens in blocks of 16: three, one and two pieces): within rounding of its
    operations one by one, which attend each sequence whole (as one thread does, bit for bit),
    and the same bits on a team of two as on one of three. A head size the vector kernels do
    not take (24), or a CPU without them, attends each sequence whole, a sequence a chunk."""
    heads, hidden, size = (3, 2, d), 72, 40
    weights, kv_index, blocks = _layer_blocks(hidden, heads, size, bias=False)
    metadata = _metadata([1, 1, 1], [600, 20, 290], 16, num_blocks=64)
    slots = torch.tensor(
        [table[(n - 1) // 16] * 16 + (n - 1) % 16 for table, n in zip(
            metadata.block_tables, metadata.seq_lens, strict=True)]
    )  # fmt: skip
    decode = metadata.decode_batch(16)
    rope = RotaryEmbedding(d, 10000.0, 1024).at(torch.tensor(metadata.seq_lens) - 1)
    x = torch.randn(3, hidden)
    cache = _filled_cache(2, d, num_blocks=64, block_size=16)

    def fused(kernels: NativeKernels) -> torch.Tensor:
        copy = KVCache(64, 16, 2, d, torch.float32)
        copy.key.copy_(cache.key)
        copy.value.copy_(cache.value)
        partial, _ = kernels.attention_block(blocks, x, None, rope, copy, slots, decode)
        return partial

    normed = NATIVE.rms_norm(x, weights["input_norm"], 1e-5)
    qkv = NATIVE.linear(normed, weights["qkv"], None)
    q = NATIVE.rotate_and_store(qkv, 3, 2, rope, cache, slots)
    attended = NATIVE.decode_attention(q, cache, decode, 0.3, kv_index)
    expected = NATIVE.linear(attended.reshape(3, -1), weights["o"], None)
    assert torch.equal(fused(NATIVE), expected)
    team = fused(TEAM)
    if d % 16 or not VECTOR_KERNELS:
        assert torch.equal(team, expected)
        return
    assert not torch.equal(team, expected)  # the pieces were merged, not one softmax
    _close(team, expected, rel=2e-5)
    assert torch.equal(fused(NativeKernels(native_module, threads=2)), team)


def test_a_layer_stack_takes_only_layers_of_one_shape_and_float32_caches():
    first = _layer_blocks(72, (3, 2, 32), 40, False)[2]
    wider = _layer_blocks(72, (3, 2, 32), 48, False)[2]
    caches = [_filled_cache(2, 32), _filled_cache(2, 32)]
    assert NATIVE.layer_stack([first, first], caches) is not None
    assert NATIVE.layer_stack([first, wider], caches) is None
    assert NATIVE.layer_stack([first, None], caches) is None
    assert NATIVE.layer_stack([first], [KVCache(40, 4, 2, 32, torch.bfloat16)]) is None
    assert TORCH_KERNELS.layer_stack([first], caches[:1]) is None


def test_a_fused_call_checks_slots_and_blocks_and_declines_what_it_does_not_take():
    _, _, blocks = _layer_blocks(72, (3, 2, 32), 40, False)
    cache = KVCache(2, 4, 2, 32, torch.float32)
    rope = RotaryEmbedding(32, 10000.0, 64).at(torch.tensor([2]))
    x = torch.randn(1, 72)
    metadata = AttentionMetadata([0, 1], [3], torch.tensor([8]), [[0]])
    decode = metadata.decode_batch(4)
    with pytest.raises(IndexError, match="slot 8 is outside the cache's 8 slots"):
        NATIVE.attention_block(blocks, x, None, rope, cache, metadata.slot_mapping, decode)
    metadata = AttentionMetadata([0, 1], [3], torch.tensor([2]), [[5]])
    with pytest.raises(IndexError, match="block 5 is outside the cache's 2 blocks"):
        NATIVE.attention_block(
            blocks, x, None, rope, cache, metadata.slot_mapping, metadata.decode_batch(4)
        )
    assert not cache.key.any() and not cache.value.any()
    # Not float32, or another width: None (the layer then runs its modules).
    assert NATIVE.mlp_block(blocks, x.double(), x.double()) is None
    assert NATIVE.mlp_block(blocks, torch.randn(1, 64), torch.randn(1, 64)) is None
    # Weights the C linear kernel does not hold (oneDNN's, or torch's): no blocks at all.
    assert TORCH_KERNELS.layer_blocks(
        input_norm=(torch.ones(72), 1e-5), qkv=(torch.randn(224, 72), None), heads=(3, 2, 32),
        kv_index=KVHeadIndex.of(torch.tensor([0, 1, 1])), scale=0.3,
        o_proj=(torch.randn(72, 96), None), post_norm=(torch.ones(72), 1e-5),
        gate_up=(torch.randn(80, 72), None), down=(torch.randn(72, 40), None),
    ) is None  # fmt: skip


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "INT8_SCALED"])
def test_the_memory_plan_counts_blocks_as_the_kernel_holds_them(kind):
    """memory.block_bytes (what a plan counts) is what the C packing takes, in whole blocks
    of 64 outputs; float32 where the inputs do not fall in whole blocks of the file (32, or
    256 for a K type)."""
    code = getattr(native_module, f"WEIGHT_{kind}")
    for out_features, in_features in ((64, 64), (65, 32), (7, 576)):
        planned = block_bytes(kind, out_features, in_features)
        assert planned == native_module.quantized_size(code, out_features, in_features)
    assert block_bytes(kind, 64, 40) == 4 * 64 * 40
    assert block_bytes(kind, 64, 64, first_input=16) == 4 * 64 * 64
    assert block_bytes("F16", 64, 64) == 4 * 64 * 64
    super_blocks = HeldKind(kind, 256)
    assert block_bytes(super_blocks, 64, 512) == block_bytes(kind, 64, 512)
    assert block_bytes(super_blocks, 64, 512, first_input=32) == 4 * 64 * 512
    assert block_bytes(super_blocks, 64, 288) == 4 * 64 * 288


def test_the_plan_holds_each_weight_in_the_widest_kind_of_its_layers():
    """Each weight a layer multiplies by is planned, per layer, in the first kind holding all
    its parts' types (Q4_0, Q4_1, Q4_K, Q6_K as themselves; Q5_K for Q5_K, Q5_1 and Q4_K
    with Q4_1; Q8_0 for Q8_0, Q4_0, Q5_0, IQ4_NL; Q6_K for those and Q3_K; INT8_SCALED for
    any, of 256 inputs where a K type is among them; float32 where a float type is), and over
    the layers in the one with the most bytes; the head as its own tensor's (the embedding's
    where tied)."""
    types = {
        "blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q4_0",
        "blk.0.attn_v.weight": "Q8_0", "blk.1.attn_q.weight": "Q4_0",
        "blk.1.attn_k.weight": "Q4_0", "blk.1.attn_v.weight": "Q4_0",
        "blk.0.attn_output.weight": "Q4_1", "blk.0.attn_q.bias": "F32",
        "blk.0.ffn_gate.weight": "Q4_K", "blk.0.ffn_up.weight": "Q5_1",
        "blk.0.ffn_down.weight": "Q6_K", "blk.1.ffn_down.weight": "BF16",
        "output.weight": "Q6_K", "token_embd.weight": "IQ4_NL",
    }  # fmt: skip
    held = HeldBlocks.of(types, tied=False)
    assert _kinds(held) == _kinds(HeldBlocks(
        qkv=HeldKind("Q8_0"),
        o=HeldKind("Q4_1"),
        gate_up=HeldKind("Q5_K", 256),
        down=HeldKind("F32", 256),
        head=HeldKind("Q6_K", 256),
    ))  # fmt: skip
    assert held.qkv.layers == (("Q8_0", ("Q4_0", "Q4_0", "Q8_0")), ("Q4_0", ("Q4_0",) * 3))
    assert held.gate_up.layers == (("Q5_K", ("Q4_K", "Q5_K")),)
    assert _kinds(HeldBlocks.of(types, tied=True))["head"] == ("Q8_0", 32)
    mixed = {"blk.0.attn_q.weight": "Q4_1", "blk.0.attn_k.weight": "Q8_0"}
    assert HeldBlocks.of(mixed, tied=True).qkv.kind == "INT8_SCALED"
    k_mix = {"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_v.weight": "Q6_K",
             "blk.1.attn_q.weight": "Q5_0", "blk.1.attn_v.weight": "Q8_0"}  # fmt: skip
    assert _kinds(HeldBlocks.of(k_mix, tied=True))["qkv"] == ("INT8_SCALED", 256)
    del k_mix["blk.0.attn_q.weight"]
    assert _kinds(HeldBlocks.of(k_mix, tied=True))["qkv"] == ("Q6_K", 256)
    down_only = HeldBlocks.of({"blk.0.ffn_down.weight": "Q4_K"}, tied=True)
    assert _kinds(down_only)["down"] == ("Q4_K", 256)


def _kinds(held: HeldBlocks) -> dict[str, tuple[str, int]]:
    """Each weight's (kind, inputs) of a plan's held blocks."""
    return {role: (getattr(held, role).kind, getattr(held, role).inputs)
            for role in ("qkv", "o", "gate_up", "down", "head")}  # fmt: skip


@needs_quantized_linear
def test_the_plan_counts_a_merged_weight_in_segments_as_the_kernel_holds_it():
    """merged_block_bytes is the bytes the packing takes for a merged weight: in segments
    where its parts' first kinds differ and start on blocks of 64 outputs (a Q4_K_M file's
    queries, keys and values), in the one kind holding them all where they do not; over
    layers, the most any takes."""
    rng = np.random.default_rng(10)
    for types, rows in (
        (("Q4_K", "Q4_K", "Q6_K"), (128, 64, 64)), (("Q4_K", "Q4_K", "Q6_K"), (100, 28, 28)),
        (("Q4_0", "Q8_0"), (64, 96)), (("Q4_K", "Q5_K"), (192, 192)),
    ):  # fmt: skip
        parts = [(t, random_blocks(t, n, 256, rng)) for t, n in zip(types, rows, strict=True)]
        held = BLOCK_WEIGHTS.pack_linear(file_weight(parts, sum(rows)))
        names = [f"blk.0.attn_{role}.weight" for role in "qkv"[: len(types)]]
        plan = HeldBlocks.of(dict(zip(names, types, strict=True)), tied=True).qkv
        assert merged_block_bytes(plan, rows, 256) == held.numel(), (types, rows)
    two_layers = HeldKind.of([["Q4_K", "Q4_K", "Q6_K"], ["Q8_0", "Q8_0", "Q8_0"]])
    whole_q8_0 = native_module.quantized_size(native_module.WEIGHT_Q8_0, 256, 256)
    assert merged_block_bytes(two_layers, (128, 64, 64), 256) == whole_q8_0
