"""Weight narrowing as pure functions: for every layer kind and every tp in 1-8 that divides
the shapes, the ranks' slices tile the full tensor exactly as the layout says."""

import pytest
import torch

from shardline.layers.sharding import (
    VOCAB_PADDING,
    column_slice,
    divide,
    head_shard,
    qkv_slices,
    row_slice,
    vocab_shard,
)

TP_SIZES = range(1, 9)
FULL = torch.arange(48 * 40, dtype=torch.float32).reshape(48, 40)  # [out, in]


@pytest.mark.parametrize("tp", [t for t in TP_SIZES if 48 % t == 0])
def test_column_slices_tile_the_output_dim(tp):
    parts = [column_slice(48, tp, r).apply(FULL) for r in range(tp)]
    assert all(p.shape == (48 // tp, 40) for p in parts)
    assert torch.equal(torch.cat(parts, dim=0), FULL)


@pytest.mark.parametrize("tp", [t for t in TP_SIZES if 40 % t == 0])
def test_row_slices_tile_the_input_dim(tp):
    parts = [row_slice(40, tp, r).apply(FULL) for r in range(tp)]
    assert all(p.shape == (48, 40 // tp) for p in parts)
    assert torch.equal(torch.cat(parts, dim=1), FULL)


@pytest.mark.parametrize("tp", [3, 7])
def test_indivisible_sizes_name_what_does_not_divide(tp):
    with pytest.raises(
        ValueError,
        match=rf"output features \(40\) is not divisible by the tensor-parallel size \({tp}\)",
    ):
        column_slice(40, tp, 0)


# (heads, kv heads): MHA, GQA with kv < tp for some tp, MQA, and SmolLM2's 9 / 3.
HEAD_CONFIGS = [(8, 8), (8, 2), (8, 1), (24, 8), (9, 3)]
QKV_CASES = [(heads, kv, tp) for heads, kv in HEAD_CONFIGS for tp in TP_SIZES if tp <= heads]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "tp"), QKV_CASES)
def test_qkv_slices(num_heads, num_kv_heads, tp):
    head_dim = 4
    group = num_heads // num_kv_heads
    q_full = torch.arange(num_heads * head_dim)
    kv_full = torch.arange(num_kv_heads * head_dim)
    q_parts = []
    for rank in range(tp):
        slices = qkv_slices(num_heads, num_kv_heads, head_dim, tp, rank)
        heads = head_shard(num_heads, num_kv_heads, tp, rank)
        q_parts.append(slices["q"].apply(q_full))
        assert slices["k"] == slices["v"]
        kv_heads = sorted({int(i) // head_dim for i in slices["k"].apply(kv_full)})
        q_heads = range(heads.q_start, heads.q_end)
        # A rank keeps exactly the KV heads its query heads read, and maps each correctly.
        assert kv_heads == sorted({h // group for h in q_heads})
        assert [kv_heads[i] for i in heads.kv_index_of_query_heads()] == [
            h // group for h in q_heads
        ]
        if num_heads % tp == 0 and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0):
            # The reference layout: even split, or rank r holding KV head r // replicas.
            assert heads.num_heads == num_heads // tp
            if tp >= num_kv_heads:
                assert kv_heads == [rank // (tp // num_kv_heads)]
            else:
                assert len(kv_heads) == num_kv_heads // tp
    assert torch.equal(torch.cat(q_parts), q_full)  # query heads tile exactly, in order


def test_kv_replication_matches_the_seed_example():
    # 8 KV heads, 16 query heads, tp=16 -> each KV head on 2 ranks; rank r keeps head r // 2.
    assert [head_shard(16, 8, 16, r).kv_start for r in range(16)] == [r // 2 for r in range(16)]


def test_uneven_heads_split_in_balanced_ranges():
    # SmolLM2: 9 heads, 3 KV heads over 2 ranks -> 4 + 5 query heads, KV head 1 on both.
    first, second = head_shard(9, 3, 2, 0), head_shard(9, 3, 2, 1)
    assert (first.q_start, first.q_end, first.kv_start, first.kv_end) == (0, 4, 0, 2)
    assert (second.q_start, second.q_end, second.kv_start, second.kv_end) == (4, 9, 1, 3)
    assert second.kv_index_of_query_heads() == [0, 0, 1, 1, 1]
    with pytest.raises(
        ValueError, match=r"attention heads \(9\) is not divisible by key/value heads \(2\)"
    ):
        head_shard(9, 2, 1, 0)
    with pytest.raises(ValueError, match="fewer than the tensor-parallel size"):
        head_shard(4, 2, 8, 0)


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("vocab", [49152, 32000, 100, 1])
def test_vocab_shards_cover_the_vocabulary_once(tp, vocab):
    shards = [vocab_shard(vocab, tp, r) for r in range(tp)]
    assert len({s.padded_per_rank for s in shards}) == 1
    padded = shards[0].padded_per_rank * tp
    assert padded % (VOCAB_PADDING * tp) == 0 and padded >= vocab
    covered = [i for s in shards for i in range(s.start, s.end)]
    assert covered == list(range(vocab))
    assert all(s.end - s.start <= s.padded_per_rank for s in shards)


def test_divide_names_both_quantities():
    assert divide(12, 4, "x") == 3
    with pytest.raises(
        ValueError,
        match=r"^output features \(9\) is not divisible by the tensor-parallel size \(2\)$",
    ):
        divide(9, 2, "output features")
    with pytest.raises(
        ValueError, match=r"^attention heads \(9\) is not divisible by key/value heads \(2\)$"
    ):
        divide(9, 2, "attention heads", "key/value heads")
