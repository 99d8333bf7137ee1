"""Which CPU kernel multiplies a decode step's weights fastest: the shapes of one rank of
SmolLM2-135M (TP=1 and TP=2) at 1, 4 and 16 rows, one torch thread (a TP=2 rank's share of
this machine), in one run:

- ``F.linear``, weight ``[out, in]`` contiguous (as checkpoints store it; torch's GEMM);
- ``F.linear``, weight stored column by column (``[in, out]`` contiguous);
- oneDNN's linear on the weight packed in its blocked layout (what Shardline's layers use,
  ``shardline.layers.linear.packed``).

Each weight set is larger than the caches (several copies, used in turn), so every call reads
its weight from memory; GB/s is the weight's bytes over the median time.

    python benchmarks/linear_kernels.py [--dtype float32|bfloat16] [--threads 1] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from shardline.cli.table import render
from shardline.layers.linear import PACKED_FOR_ROWS, linear, packed

#: (name, out, in) per rank: SmolLM2-135M's qkv, o, gate+up, down and LM head.
SHAPES = {
    1: [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
        ("lm_head", 49152, 576)],
    2: [("qkv", 480, 576), ("o", 576, 288), ("gate_up", 1536, 576), ("down", 576, 768),
        ("lm_head", 24576, 576)],
}  # fmt: skip
ROWS = (1, 4, 16)
SET_BYTES = 128 << 20  # per kernel and shape: past the last-level cache


def median_s(call, repeats: int) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(out_features: int, in_features: int, rows: int, dtype: torch.dtype) -> dict:
    size = out_features * in_features * torch.empty(0, dtype=dtype).element_size()
    copies = max(2, SET_BYTES // size)
    plain = [torch.randn(out_features, in_features).to(dtype) for _ in range(copies)]
    layouts = {
        "[out, in]": plain,
        "[in, out]": [w.t().contiguous().t() for w in plain],
        "oneDNN packed": [packed(w) for w in plain],
    }
    x = torch.randn(rows, in_features).to(dtype)
    result = {}
    for name, weights in layouts.items():
        turn = iter(range(1 << 60))
        seconds = median_s(lambda ws=weights, t=turn: linear(x, ws[next(t) % len(ws)], None), 200)
        result[name] = {"us": seconds * 1e6, "gb_s": size / seconds / 1e9}
    reference = F.linear(x, plain[0])
    result["oneDNN max abs difference"] = float(
        (linear(x, layouts["oneDNN packed"][0], None) - reference).abs().max()
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    records, table = [], []
    for tp, shapes in SHAPES.items():
        for name, out_features, in_features in shapes:
            for rows in ROWS:
                found = measure(out_features, in_features, rows, dtype)
                records.append({"tp": tp, "weight": name, "rows": rows, **found})
                plain, packed_ = found["[out, in]"], found["oneDNN packed"]
                table.append(
                    [f"tp{tp} {name} [{out_features}x{in_features}]", rows,
                     *(f"{found[k]['us']:.0f} ({found[k]['gb_s']:.1f})" for k in
                       ("[out, in]", "[in, out]", "oneDNN packed")),
                     f"{plain['us'] / packed_['us']:.2f}"]
                )  # fmt: skip
    print(
        f"{args.dtype}, {args.threads} thread(s), oneDNN packed for {PACKED_FOR_ROWS} rows: "
        "us per call (GB/s of weights)"
    )
    headers = ["weight", "rows", "[out, in]", "[in, out]", "oneDNN packed", "speed-up"]
    print(render(headers, table))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"dtype": args.dtype, "threads": args.threads, "rows": records}, handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
