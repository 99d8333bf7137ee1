"""On a host with CUDA devices: the NCCL communicator's conformance suite, then all-reduce
bandwidth against gloo, as tables (and JSON with --json).

    python benchmarks/nccl_check.py [--ranks 2] [--json out.json]

Needs a CUDA build of torch and one device per rank; on a machine without them it prints why
and exits 2.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from shardline.registry import Registry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    reason = Registry.load().get("communicator", "nccl").unavailable_reason()
    if reason is not None:
        print(f"nccl unavailable here: {reason}")
        return 2
    sizes = ",".join(str(n) for n in range(1, args.ranks + 1))
    suite = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardline.cli.main",
            "conformance",
            "nccl",
            "--world-sizes",
            sizes,
            "--report",
            "nccl-conformance.json",
        ],
        check=False,
    )
    bench = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardline.cli.main",
            "bench",
            "comm",
            "-c",
            "gloo,nccl",
            "-n",
            str(args.ranks),
            "--ops",
            "all_reduce,all_gather,broadcast",
            "-b",
            "1K",
            "-e",
            "64M",
            "-f",
            "8",
            "--json",
            "nccl-bench.json",
        ],
        check=False,
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {"conformance_exit": suite.returncode, "bench_exit": bench.returncode}, handle
            )
    return suite.returncode or bench.returncode


if __name__ == "__main__":
    raise SystemExit(main())
