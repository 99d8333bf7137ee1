"""What prefix caching saves when requests begin alike (a long system prompt, say): the same
engine layout with ``cache.prefix_caching`` off and on, in one run. Every request is a
shared beginning of ``--shared`` random token ids, then ``--suffix`` ids of its own (new ones
for every request, so only the beginning can be found), greedy.

Two cases, each the median of ``--repeats`` after one warm-up (which, with caching on, leaves
the shared beginning cached, as steady traffic would):

- one request, one new token: its time to first token;
- ``--batch`` requests at once, ``--new`` tokens each: the time of the whole batch.

    python benchmarks/prefix_cache.py [--model smollm2-135m] [--shared 1024] [--suffix 32]
        [--batch 8] [--new 16] [--repeats 3] [--set K=V ...] [--json FILE]

``--set`` applies to both engines (the default layout is TP=2, ``mp``, custom_ar). Prints a
table (and JSON with ``--json``), with the share of prompt tokens found in the cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from shardline.catalog import resolve_model_path
from shardline.cli.table import render
from shardline.engine import LLM, SamplingParams
from shardline.errors import ShardlineError

LAYOUT = [
    "parallel.tensor_parallel_size=2",
    "parallel.distributed_executor_backend=mp",
    "parallel.communicator=custom_ar",
]


class Prompts:
    """The shared beginning, then ``suffix`` fresh random ids for each prompt asked for."""

    def __init__(self, shared: int, suffix: int) -> None:
        self._generator = torch.Generator().manual_seed(0)
        self.shared = self._ids(shared)
        self.suffix = suffix

    def _ids(self, count: int) -> list[int]:
        return [int(i) for i in torch.randint(100, 30000, (count,), generator=self._generator)]

    def take(self, count: int) -> list[list[int]]:
        return [self.shared + self._ids(self.suffix) for _ in range(count)]


def measure(model: str, caching: bool, args) -> dict:
    """Seconds of each repeat of both cases, and the scheduler's prefix-cache counts."""
    overrides = [f"model.path={model}", *LAYOUT, *args.overrides]
    overrides.append(f"cache.prefix_caching={str(caching).lower()}")
    prompts = Prompts(args.shared, args.suffix)  # the same ids for both engines
    first = SamplingParams(max_tokens=1)
    batch = SamplingParams(max_tokens=args.new, ignore_eos=True)
    single, whole = [], []
    with LLM(overrides=overrides) as llm:
        llm.generate(prompts.take(1), first)
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.generate(prompts.take(1), first)
            single.append(time.perf_counter() - start)
            start = time.perf_counter()
            llm.generate(prompts.take(args.batch), batch)
            whole.append(time.perf_counter() - start)
        load = llm.engine.load()  # over every replica
        counts = {"queried": load.prefix_cache_queries, "found": load.prefix_cache_hits}
    return {"one request": single, "batch": whole, "tokens": counts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="catalog name, GGUF or HF dir")
    parser.add_argument("--shared", type=int, default=1024)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if not (
        16 <= args.shared <= 8192
        and 1 <= args.suffix <= 1024
        and 1 <= args.batch <= 64
        and 1 <= args.new <= 256
        and 1 <= args.repeats <= 100
    ):
        parser.error(
            "allowed: --shared 16..8192, --suffix 1..1024, --batch 1..64, --new 1..256, "
            "--repeats 1..100"
        )
    try:
        model = resolve_model_path(args.model)
        results = {
            "off": measure(model, False, args),
            "on": measure(model, True, args),
        }
    except ShardlineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = []
    for case in ("one request", "batch"):
        off, on = (statistics.median(results[k][case]) for k in ("off", "on"))
        rows.append((case, f"{off:.3f}", f"{on:.3f}", f"{on / off:.2f}"))
    tokens = results["on"]["tokens"]
    print(
        f"{args.shared} shared + {args.suffix} own tokens a prompt; one request: 1 new token; "
        f"batch: {args.batch} requests x {args.new} new tokens; median of {args.repeats}"
    )
    print(render(["case", "caching off (s)", "caching on (s)", "on / off"], rows))
    print(
        f"caching on: {tokens['found']} of {tokens['queried']} prompt tokens found in the cache "
        f"({tokens['found'] / max(1, tokens['queried']):.0%})"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"arguments": vars(args), "results": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
