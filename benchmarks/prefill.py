"""Time to first token of one long prompt: Shardline's prefill (chunked by the scheduler's
token budget) under TP=1 (``uni``) and TP=2 (``mp``, custom_ar) beside transformers'
``generate`` with 2 threads, the same random prompt of ``--tokens`` ids, greedy, one new
token, in one run. Each figure is the median of ``--repeats`` requests after one short
warm-up request; Shardline's engine is started once per layout, so start-up is not counted.

    python benchmarks/prefill.py [--model smollm2-135m] [--tokens 2000] [--repeats 3]
        [--set K=V ...] [--json FILE]

``--set`` applies to every Shardline case (``scheduler.max_num_batched_tokens=2048``: larger
chunks). ``OMP_WAIT_POLICY=PASSIVE`` in the environment is worth trying for TP=1 (see the
README's decode benchmark notes). Prints a table (and JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from shardline.catalog import resolve_model_path
from shardline.cli.bench_decode import load_transformers
from shardline.cli.table import render
from shardline.engine import LLM, SamplingParams
from shardline.errors import ShardlineError

LAYOUTS = {
    "tp1 uni": ["parallel.tensor_parallel_size=1", "parallel.distributed_executor_backend=uni"],
    "tp2 mp custom_ar": [
        "parallel.tensor_parallel_size=2",
        "parallel.distributed_executor_backend=mp",
        "parallel.communicator=custom_ar",
    ],
}


def shardline_seconds(model: str, layout: list[str], extra: list[str], prompt, repeats: int):
    """Seconds of each of ``repeats`` requests of ``prompt`` (ids) for one new token."""
    overrides = [f"model.path={model}", *layout, *extra]
    overrides.append(f"scheduler.max_model_len={len(prompt) + 8}")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    seconds = []
    with LLM(overrides=overrides) as llm:
        llm.generate([prompt[:64]], params)
        for _ in range(repeats):
            start = time.perf_counter()
            llm.generate([prompt], params)
            seconds.append(time.perf_counter() - start)
    return seconds


def transformers_seconds(model: str, prompt, repeats: int, threads: int = 2):
    torch.set_num_threads(threads)
    hf = load_transformers(model, torch.float32)
    ids = torch.tensor([prompt])
    seconds = []
    with torch.inference_mode():
        hf.generate(ids[:, :64], max_new_tokens=1, do_sample=False)
        for _ in range(repeats):
            start = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, do_sample=False)
            seconds.append(time.perf_counter() - start)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="catalog name, GGUF or HF dir")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if not 64 <= args.tokens <= 32768 or not 1 <= args.repeats <= 100:
        parser.error("--tokens must be 64 to 32768 and --repeats 1 to 100")
    generator = torch.Generator().manual_seed(0)
    prompt = [int(i) for i in torch.randint(100, 30000, (args.tokens,), generator=generator)]
    try:
        model = resolve_model_path(args.model)
        results = {
            name: shardline_seconds(model, layout, args.overrides, prompt, args.repeats)
            for name, layout in LAYOUTS.items()
        }
    except ShardlineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    results["transformers, 2 threads"] = transformers_seconds(model, prompt, args.repeats)
    reference = statistics.median(results["transformers, 2 threads"])
    rows = []
    for name, seconds in results.items():
        median = statistics.median(seconds)
        speed, ratio = args.tokens / median, median / reference
        rows.append((name, f"{median:.2f}", f"{speed:.0f}", f"{ratio:.2f}"))
    print(f"{args.tokens}-token prompt, one new token; median of {args.repeats} (float32)")
    print(render(["engine", "seconds", "prompt tok/s", "x transformers' time"], rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"tokens": args.tokens, "seconds": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
