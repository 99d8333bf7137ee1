"""Per-rank memory of loading a model: each rank should hold about its shard, not the model.

For each tensor-parallel size, starts that many ranks (gloo, this host), lets every rank join
its worlds and build its model runner, then loads the weights and reports, per rank, its peak
resident memory (``ru_maxrss``) after the load, the growth of that peak during the load, and
the bytes of its parameters. Prints a table and writes JSON.

    python benchmarks/load_memory.py --model PATH.gguf --tp 1 2 [--set K=V ...] [--json out.json]

``--set`` applies to every case (``model.weight_dtype=gguf``: the file's blocks held).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import sys

from shardline.config import load_config
from shardline.launch.local_world import LocalWorld
from shardline.worker.setup import WorkerSetup


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure_load(context) -> dict:
    """In a rank: load the model; report peak RSS, its growth, and parameter bytes."""
    before = _peak_rss_bytes()
    context.worker.load_model()
    after = _peak_rss_bytes()
    model = context.worker.model_runner.model
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "rank": context.worker.rank,
        "peak_rss": after,
        "peak_growth": after - before,
        "parameters": parameter_bytes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="GGUF file or HF directory")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--set", action="append", default=[], help="config override (repeatable)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    # The ranks unpickle the measuring function by module name: this script as the module
    # load_memory, importable by them from this folder.
    folder = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (folder, os.environ.get("PYTHONPATH")) if p
    )
    measure = importlib.import_module("load_memory").measure_load
    results = []
    for tp in args.tp:
        config = load_config(
            overrides=[
                f"model.path={args.model}",
                f"parallel.tensor_parallel_size={tp}",
                "cache.num_blocks=1",
                *args.set,
            ],
            environ={},
        ).config
        with LocalWorld(
            tp, WorkerSetup(config, load_model=False), start_timeout_s=300, call_timeout_s=600
        ) as world:
            for row in world.run(measure):
                results.append({"tp": tp, **row})
    mib = 1024 * 1024
    single = [r for r in results if r["tp"] == 1]
    base = single[0]["peak_growth"] if single else None
    print(
        f"{'tp':>3} {'rank':>4} {'params MiB':>11} {'peak RSS MiB':>13} "
        f"{'peak RSS growth MiB':>20} {'growth vs tp=1':>15}"
    )
    for r in results:
        ratio = f"{r['peak_growth'] / base:.2f}" if base else "-"
        print(
            f"{r['tp']:>3} {r['rank']:>4} {r['parameters'] / mib:>11.1f} "
            f"{r['peak_rss'] / mib:>13.1f} {r['peak_growth'] / mib:>20.1f} {ratio:>15}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
