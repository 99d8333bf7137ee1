"""The decoder layer's operations between weight multiplies, torch path against the C path
(``shardline.layers.kernels``), at SmolLM2-135M's shapes for one TP=2 rank (the second: query
heads 4-8 reading KV heads 1-2, of 64; hidden 576, 768 intermediate) and 1 and 16 sequences,
one torch thread, in one run: microseconds per call (median), and the largest difference of
the results.

    python benchmarks/layer_kernels.py [--json F]
"""

from __future__ import annotations

import argparse
import json

import torch
from linear_kernels import median_s  # this directory's timing helper

from shardline.cli.table import render
from shardline.layers.attention import AttentionMetadata, KVCache
from shardline.layers.kernels import TORCH_KERNELS, KVHeadIndex, NativeKernels, layer_kernels
from shardline.layers.rotary import RotaryEmbedding

HIDDEN, INTERMEDIATE, Q_HEADS, KV_HEADS, HEAD_DIM = 576, 768, 5, 2, 64
#: Which of the rank's KV heads each query head reads.
KV_INDEX = KVHeadIndex.of(torch.tensor([0, 0, 1, 1, 1]))
BLOCK_SIZE, NUM_BLOCKS, CONTEXT = 16, 256, 140  # each sequence: 140 tokens in the cache


def median_us(call, repeats: int = 2000) -> float:
    return median_s(call, repeats) * 1e6


def operations(rows: int) -> dict:
    """name -> a function of the kernels that runs that operation on fixed inputs."""
    x, residual, weight = torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN), torch.rand(HIDDEN)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE)
    qkv = torch.randn(rows, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)
    rope = RotaryEmbedding(HEAD_DIM, 10000.0, 2048).at(torch.full((rows,), CONTEXT - 1))
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32)
    cache.key.normal_()
    cache.value.normal_()
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:rows]
    blocks = torch.randperm(NUM_BLOCKS).tolist()
    tables = [[blocks.pop() for _ in range(-(-CONTEXT // BLOCK_SIZE))] for _ in range(rows)]
    metadata = AttentionMetadata(
        list(range(rows + 1)), [CONTEXT] * rows, slots, tables
    )  # fmt: skip
    decode = metadata.decode_batch(BLOCK_SIZE)
    q = torch.randn(rows, Q_HEADS, HEAD_DIM)
    return {
        "add + rms_norm": lambda k: k.rms_norm(x, weight, 1e-5, residual)[0],
        "rope + cache store": lambda k: k.rotate_and_store(
            qkv, Q_HEADS, KV_HEADS, rope, cache, slots
        ),
        f"decode attention ({CONTEXT} tokens)": lambda k: k.decode_attention(
            q, cache, decode, HEAD_DIM**-0.5, KV_INDEX
        ),
        "silu * up": lambda k: k.silu_and_mul(gate_up),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    native = layer_kernels(torch.device("cpu"), {})
    if not isinstance(native, NativeKernels):
        print("the C extension shardline.layers._kernels is not built: nothing to compare")
        return 1
    records, table = [], []
    for rows in (1, 16):
        for name, run in operations(rows).items():
            torch_us = median_us(lambda run=run: run(TORCH_KERNELS))
            native_us = median_us(lambda run=run: run(native))
            difference = float((run(TORCH_KERNELS) - run(native)).abs().max())
            records.append(
                {"operation": name, "rows": rows, "torch_us": torch_us, "c_us": native_us,
                 "max_abs_difference": difference}
            )  # fmt: skip
            table.append(
                [name, rows, f"{torch_us:.1f}", f"{native_us:.1f}",
                 f"{torch_us / native_us:.2f}", f"{difference:.1e}"]
            )  # fmt: skip
    print("one torch thread, us per call (median of 2000)")
    print(render(["operation", "rows", "torch", "C", "speed-up", "max |difference|"], table))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(records, handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
