"""Parallel layers in real gloo worlds (tp = 2 and 4) against the unsharded computation."""

import os

import pytest
import torch
import torch.nn.functional as F

from shardline.config import load_config
from shardline.launch.comm_world import ParallelSetup
from shardline.launch.local_world import LocalWorld
from shardline.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardline.layers.kernels import layer_kernels, screens_greedy_head
from shardline.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from shardline.layers.sharding import ShardSlice, head_shard

pytestmark = pytest.mark.timeout(180)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 8, 2, 4, 100
# SmolLM2's head counts: the query heads split unevenly (4, 5 over 2 ranks; 2, 2, 2, 3 over 4).
UNEVEN_HEADS, UNEVEN_KV_HEADS = 9, 3


def _full_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    return {
        "x": randn(5, HIDDEN),
        "w": randn(48, HIDDEN),
        "b": randn(48),
        "gate": randn(64, HIDDEN),
        "up": randn(64, HIDDEN),
        "q": randn(HEADS * HEAD_DIM, HIDDEN),
        "k": randn(KV_HEADS * HEAD_DIM, HIDDEN),
        "v": randn(KV_HEADS * HEAD_DIM, HIDDEN),
        "row_w": randn(HIDDEN, 64),
        "row_b": randn(HIDDEN),
        "row_x": randn(5, 64),
        "o_w": randn(HIDDEN, UNEVEN_HEADS * HEAD_DIM),
        "o_x": randn(5, UNEVEN_HEADS * HEAD_DIM),
        "embedding": randn(VOCAB, HIDDEN),
        "ids": torch.tensor([0, 1, 63, 64, 99, 50, 7]),
    }


def _run_layers(ctx) -> dict:
    tp = ctx.state.tp
    w = _full_weights()
    out = {}
    column = ColumnParallelLinear(HIDDEN, 48, tp, bias=True)
    column.load_full(w["w"], w["b"])
    out["column"] = column(w["x"])
    merged = MergedColumnParallelLinear(HIDDEN, [64, 64], tp)
    merged.load_part(0, w["gate"])
    merged.load_part(1, w["up"])
    out["merged"] = merged(w["x"])
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, tp)
    for name in "qkv":
        qkv.load_part(name, w[name])
    out["qkv"] = qkv(w["x"])
    row = RowParallelLinear(64, HIDDEN, tp, bias=True)
    row.load_full(w["row_w"], w["row_b"])
    shard = 64 // tp.world_size
    out["row"] = row(w["row_x"][:, tp.rank_in_group * shard : (tp.rank_in_group + 1) * shard])
    # The attention output projection: each rank's input is its (uneven) query heads' range.
    heads = head_shard(UNEVEN_HEADS, UNEVEN_KV_HEADS, tp.world_size, tp.rank_in_group)
    columns = ShardSlice(1, heads.q_start * HEAD_DIM, heads.num_heads * HEAD_DIM)
    o_proj = RowParallelLinear(UNEVEN_HEADS * HEAD_DIM, HIDDEN, tp, input_shard=columns)
    o_proj.load_full(w["o_w"])
    out["row_uneven"] = o_proj(columns.apply(w["o_x"]))
    embedding = VocabParallelEmbedding(VOCAB, HIDDEN, tp)
    embedding.load_full(w["embedding"])
    out["embedding"] = embedding(w["ids"])
    # Loading writes every row, padding too: a table made over memory holding NaN looks up
    # alike (a lookup outside a rank's shard reads its row 0, masked with a 0 multiply).
    stale = VocabParallelEmbedding(VOCAB, HIDDEN, tp)
    stale.weight.data.fill_(float("nan"))
    stale.load_full(w["embedding"])
    out["embedding_over_stale_memory"] = stale(w["ids"])
    head = ParallelLMHead(VOCAB, HIDDEN, tp, tied_to=embedding)
    out["logits"] = head(w["x"])
    out["greedy"] = head(w["x"], greedy=True)
    # Tokens 10 and 90 (on different ranks at tp 2) share one row: equal best logits.
    twins = w["embedding"].clone()
    twins[90] = twins[10]
    twin_table = VocabParallelEmbedding(VOCAB, HIDDEN, tp)
    twin_table.load_full(twins)
    twin_head = ParallelLMHead(VOCAB, HIDDEN, tp, tied_to=twin_table)
    twin_head.pack()  # its own copy, packed for oneDNN where this torch has it
    out["greedy_twins"] = twin_head(twins[[10, 90]] * 10, greedy=True)
    # The same head on the C kernels where built: blocked, and screened where they screen
    # (each rank's best found through its Q8_0 screen), then with the screen dropped.
    screened = ParallelLMHead(
        VOCAB, HIDDEN, tp, tied_to=twin_table, kernels=layer_kernels(torch.device("cpu"), {})
    )
    screened.pack()
    out["screened"] = screened.screen is not None
    out["screened_twins"] = screened(twins[[10, 90]] * 10, greedy=True)
    out["screened_greedy"] = screened(w["x"], greedy=True)
    screened.screen = None
    out["unscreened_greedy"] = screened(w["x"], greedy=True)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def tp_world(request):
    config = load_config(overrides=[f"parallel.tensor_parallel_size={request.param}"], environ={})
    with LocalWorld(request.param, ParallelSetup(config.config), call_timeout_s=60) as world:
        yield request.param, world


def test_layers_match_the_unsharded_computation(tp_world):
    tp, world = tp_world
    w = _full_weights()
    results = world.run(_run_layers)
    full_column = F.linear(w["x"], w["w"], w["b"])
    full_row = F.linear(w["row_x"], w["row_w"], w["row_b"])

    for rank, out in enumerate(results):
        close = {"atol": 1e-5, "rtol": 1e-5}
        torch.testing.assert_close(out["column"], full_column.chunk(tp, -1)[rank], **close)
        gate_up = torch.cat(
            [
                F.linear(w["x"], w["gate"]).chunk(tp, -1)[rank],
                F.linear(w["x"], w["up"]).chunk(tp, -1)[rank],
            ],
            -1,
        )
        torch.testing.assert_close(out["merged"], gate_up, **close)
        q = F.linear(w["x"], w["q"]).chunk(tp, -1)[rank]
        heads = head_shard(HEADS, KV_HEADS, tp, rank)
        kv_cols = slice(heads.kv_start * HEAD_DIM, heads.kv_end * HEAD_DIM)
        k = F.linear(w["x"], w["k"])[:, kv_cols]
        v = F.linear(w["x"], w["v"])[:, kv_cols]
        torch.testing.assert_close(out["qkv"], torch.cat([q, k, v], -1), **close)
        torch.testing.assert_close(out["row"], full_row, **close)
        torch.testing.assert_close(out["row_uneven"], F.linear(w["o_x"], w["o_w"]), **close)
        assert torch.equal(out["embedding"], F.embedding(w["ids"], w["embedding"]))
        assert torch.equal(out["embedding_over_stale_memory"], out["embedding"])
        torch.testing.assert_close(out["logits"], F.linear(w["x"], w["embedding"]), **close)
        # Greedy without gathering: the argmax of the logits, the lowest id among equals.
        assert torch.equal(out["greedy"], out["logits"].argmax(dim=-1))
        assert out["greedy_twins"].tolist() == [10, 10]
        assert out["screened"] == screens_greedy_head("cpu", os.environ)
        assert out["screened_twins"].tolist() == [10, 10]
        assert torch.equal(out["screened_greedy"], out["unscreened_greedy"])
