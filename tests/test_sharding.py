"""Weight narrowing as pure functions: for every layer kind and every tp in 1-8 that divides
the shapes, the ranks' slices tile the full tensor exactly as the layout says."""

import pytest
import torch

from shardline.layers.sharding import (
    KVHeadLayout,
    column_slice,
    divide,
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


# (heads, kv heads): MHA, GQA with kv < tp for some tp, MQA
HEAD_CONFIGS = [(8, 8), (8, 2), (8, 1), (24, 8), (9, 3)]
VALID_QKV = [
    (heads, kv, tp)
    for heads, kv in HEAD_CONFIGS
    for tp in TP_SIZES
    if heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)
]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "tp"), VALID_QKV)
def test_qkv_slices(num_heads, num_kv_heads, tp):
    head_dim = 4
    q_full = torch.arange(num_heads * head_dim)
    kv_full = torch.arange(num_kv_heads * head_dim)
    layout = KVHeadLayout.of(num_kv_heads, tp)
    q_parts, kv_heads_seen = [], []
    for rank in range(tp):
        slices = qkv_slices(num_heads, num_kv_heads, head_dim, tp, rank)
        q_parts.append(slices["q"].apply(q_full))
        k = slices["k"].apply(kv_full)
        assert slices["k"] == slices["v"]
        assert len(k) == layout.heads_per_rank * head_dim
        heads = sorted({int(i) // head_dim for i in k})
        kv_heads_seen.append(heads)
        if tp >= num_kv_heads:
            # Replicated: rank r holds KV head r // (tp / kv heads).
            assert heads == [rank // (tp // num_kv_heads)]
    assert torch.equal(torch.cat(q_parts), q_full)
    counts = {h: sum(h in seen for seen in kv_heads_seen) for h in range(num_kv_heads)}
    assert set(counts.values()) == {layout.replicas}, counts  # each KV head on `replicas` ranks


def test_kv_replication_matches_the_seed_example():
    # 8 KV heads, tp=16 -> each head on 2 ranks; rank r keeps head r // 2.
    layout = KVHeadLayout.of(8, 16)
    assert (layout.heads_per_rank, layout.replicas) == (1, 2)
    assert [layout.first_head(r) for r in range(16)] == [r // 2 for r in range(16)]


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("vocab", [49152, 32000, 100, 1])
def test_vocab_shards_cover_the_vocabulary_once(tp, vocab):
    shards = [vocab_shard(vocab, tp, r, pad_to=64) for r in range(tp)]
    assert len({s.padded_per_rank for s in shards}) == 1
    padded = shards[0].padded_per_rank * tp
    assert padded % (64 * tp) == 0 and padded >= vocab
    covered = [i for s in shards for i in range(s.start, s.end)]
    assert covered == list(range(vocab))
    assert all(s.end - s.start <= s.padded_per_rank for s in shards)


def test_divide():
    assert divide(12, 4, "x") == 3
    with pytest.raises(ValueError, match=r"attention heads \(9\) is not divisible"):
        divide(9, 2, "attention heads")
