"""What ``torch.compile`` gives a batch-1 float32 decode here, beside Shardline's C layers, in
one run: the issue's candidate "torch.compile (compile time reported and paid once)", kept only
if it pays.

Rows (greedy, ``--tokens`` tokens after the chat question of ``shardline bench decode``, batch
1; the time between the first and the last streamed token, median of 3 requests):
  transformers eager        - ``generate`` as ``shardline bench decode`` runs it;
  transformers compiled     - the same model with a static KV cache (fixed shapes: no
                              recompiles) and ``model.forward = torch.compile(model.forward)``
                              (inductor's C++ code for this CPU); the compile time is the
                              first short ``generate``'s, cold (a fresh inductor cache);
  shardline tp1 / tp2       - ``shardline bench decode``'s cases (fresh processes; tp1 under
                              ``uni``, tp2 ``custom_ar`` under ``mp``), which run every layer of
                              a step in one C call.
transformers runs in this process on ``--threads`` torch threads. Prints a table (tok/s, each
over transformers eager's) and, with ``--json``, the same figures.

    python benchmarks/torch_compile.py [--model smollm2-135m] [--tokens 64] [--threads 2]
        [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from shardline.catalog import resolve_model_path
from shardline.cli.bench_decode import (
    Case,
    load_transformers,
    prompt_ids,
    run_case,
    transformers_batch1_runs,
)
from shardline.cli.table import render
from shardline.weights import load_tokenizer, open_checkpoint


def transformers_rows(path: str, tokens: int) -> list[dict]:
    """transformers eager, then compiled (cold inductor cache), on this process's threads."""
    prompt = prompt_ids(load_tokenizer(open_checkpoint(path)), 0)
    model = load_transformers(path, torch.float32)
    ids = torch.tensor([prompt])
    model.generate(ids, max_new_tokens=4, do_sample=False)
    rows = [{"engine": "transformers", "mode": "eager",
             "tok_s": statistics.median(transformers_batch1_runs(model, ids, tokens))}]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="shardline-inductor-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, dynamic=False)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=4, do_sample=False)
        compile_s = time.perf_counter() - start
        model.generate(ids, max_new_tokens=tokens, do_sample=False)  # any later recompile
        rate = statistics.median(transformers_batch1_runs(model, ids, tokens))
    rows.append({"engine": "transformers", "mode": "torch.compile, static cache",
                 "tok_s": rate, "compile_s": compile_s})  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    path = str(resolve_model_path(args.model))
    rows = []
    for layout, communicator in (("tp1", "-"), ("tp2", "custom_ar")):
        case = Case("shardline", path, args.tokens, 2, layout, communicator, timeout_s=600)
        result = run_case(case)
        if "error" in result:
            print(f"shardline {layout}: {result['error']}")
            return 1
        rows.append({"engine": "shardline", "mode": f"{layout} {communicator} (C layers)",
                     "tok_s": result["batch1_tok_s"]})  # fmt: skip
    torch.set_num_threads(args.threads)
    rows += transformers_rows(path, args.tokens)
    eager = next(row["tok_s"] for row in rows if row["mode"] == "eager")
    table = [
        [row["engine"], row["mode"], f"{row['tok_s']:.1f}", f"{row['tok_s'] / eager:.2f}",
         f"{row['compile_s']:.1f}" if "compile_s" in row else "-"]
        for row in rows
    ]  # fmt: skip
    print(f"float32 batch-1 greedy decode, {args.tokens} tokens, transformers on "
          f"{args.threads} threads; one run")  # fmt: skip
    print(render(["engine", "mode", "tok/s", "x transformers eager", "compile s"], table))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"tokens": args.tokens, "threads": args.threads, "rows": rows}, handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
