"""How fast a greedy step finds its token through an LM head's screen (``GreedyScreen``),
against the head's own logits, at 1 to 16 rows, one thread, in one run.

The head is a tensor-parallel rank's share of a model's (``--model``, SmolLM2-135M by
default: its second half of the vocabulary at ``--tp 2``), held blocked in float32 as the C
kernels hold it; the rows are that model's final hidden states, from transformers' greedy
decoding of a few prompts (a real row's largest logits are what decides how many outputs the
screen has to sum exactly). Three ways per row count: the head's logits (the blocked kernel)
and their argmax; the screen in Q8_0 blocks (its codes multiply each row in float32); the
screen in Q8_CODES_F16 blocks (each row quantized twice to int8, multiplied in integers:
AVX-512 VNNI, where this CPU has it). Head and screens are copied until the copies pass
``--megabytes`` and used in turn, so each call reads them from memory, as a decode step does.
A cell is the median over ``--rounds`` (the ways interleaved) of the mean time a call; every
call's token is checked against the logits' argmax.

    python benchmarks/greedy_screen.py [--model smollm2-135m] [--tp 2] [--rounds 5]
        [--calls 20] [--megabytes 400] [--json F]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from shardline.catalog import resolve_model_path
from shardline.cli.table import render
from shardline.layers.kernels import SCREENED_ROWS_MAX, NativeKernels

ROWS = (1, 4, 8, 16)
PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain gravity to a child.",
    "def fibonacci(n):",
)


def hidden_rows(model_path: str, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head's float32 table and the final hidden states of transformers' greedy
    decoding of :data:`PROMPTS` (``tokens`` each), one row per generated token."""
    from shardline.cli.bench_decode import load_transformers
    from shardline.weights import load_tokenizer, open_checkpoint

    model = load_transformers(model_path, torch.float32)
    tokenizer = load_tokenizer(open_checkpoint(model_path))
    rows = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(
            ids,
            max_new_tokens=tokens,
            do_sample=False,
            output_hidden_states=True,
            return_dict_in_generate=True,
        )
        rows += [step[-1][0, -1] for step in out.hidden_states]
    return model.lm_head.weight.detach().clone(), torch.stack(rows).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tp", type=int, default=2, help="the head's share of one rank of this")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="calls a round, per way and rows")
    parser.add_argument("--megabytes", type=float, default=400.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from shardline.layers import _kernels as native

    table, states = hidden_rows(str(resolve_model_path(args.model)), 24)
    share = -(-table.shape[0] // args.tp)
    table = table[-share:].contiguous()  # the last rank's rows
    kinds = ["Q8_0"] + (["Q8_CODES_F16"] if native.int8_dot_available() else [])
    ways: dict[str, list] = {"head logits (float32)": []}
    for kind in kinds:
        ways[f"screen, {kind}"] = []
    copies = 0
    while copies < 2 or copies * table.numel() * 4 * 1.5 < args.megabytes * 2**20:
        held = None
        for kind in kinds:
            kernels = NativeKernels(native, screen_kind=kind)
            held = held if held is not None else kernels.pack_linear(table)
            ways[f"screen, {kind}"].append((kernels, held, kernels.greedy_screen(table, held)))
        ways["head logits (float32)"].append((kernels, held, None))
        copies += 1
    results: dict[str, dict[int, list[float]]] = {way: {r: [] for r in ROWS} for way in ways}
    for _ in range(args.rounds):
        for rows in ROWS:
            x = states[:rows]
            expected = None
            for way, items in ways.items():
                start = time.perf_counter()
                for call in range(args.calls):
                    kernels, held, screen = items[call % len(items)]
                    if screen is None:
                        chosen = kernels.linear(x, held, None).max(dim=-1).indices
                    else:
                        found = screen.argmax(x, held, table.shape[0])
                        chosen = None if found is None else found[1]
                results[way][rows].append((time.perf_counter() - start) / args.calls)
                if chosen is None:
                    results[way][rows][-1] = float("nan")  # not settled: the logits decide
                elif expected is None:
                    expected = chosen
                elif not torch.equal(chosen, expected):
                    raise SystemExit(f"{way}, {rows} rows: tokens differ from the logits'")
    medians = {
        way: {rows: statistics.median(times) for rows, times in by_rows.items()}
        for way, by_rows in results.items()
    }
    logits = medians["head logits (float32)"]

    def cell(way: str, rows: int) -> str:
        ms = medians[way][rows]
        return "-" if math.isnan(ms) else f"{ms * 1e3:.2f} ({logits[rows] / ms:.2f}x)"

    print(
        f"{args.model}, a rank's head of {args.tp}: {table.shape[0]} x {table.shape[1]}, "
        f"one thread, {copies} copies; ms a call (x the logits' speed)"
    )
    print(
        render(
            ["way"] + [f"{r} rows" for r in ROWS], [[w] + [cell(w, r) for r in ROWS] for w in ways]
        )
    )
    print(
        f"-: not screened (more than {SCREENED_ROWS_MAX} rows, or not settled): the logits decide"
    )
    if args.json:
        with open(args.json, "w") as handle:
            seconds = {
                way: {rows: None if math.isnan(t) else t for rows, t in by_rows.items()}
                for way, by_rows in medians.items()
            }
            json.dump({"shape": list(table.shape), "seconds": seconds}, handle, indent=2)


if __name__ == "__main__":
    main()
