"""One rank of a launched world running the executor checks.

Started in every process by torchrun or mpiexec (the suite does this for executors whose
``launched`` is True)::

    python -m shardline.conformance.executors.launched NAME --timeout 20 --reports DIR

Every rank runs the applicable checks in the same order and writes one JSON line per check,
``{"rank": r, "check": ..., "outcome": passed|failed|unsupported, ...}``, to its own file
``DIR/rank-R.jsonl`` (ranks share the launcher's stdout, where lines could interleave).
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

from shardline.conformance.executors.checks import CHECKS, Subject, not_applicable, probe_config
from shardline.interfaces import Executor
from shardline.launch.launcher_env import LaunchedRank
from shardline.launch.process_exit import skip_final_collection
from shardline.registry import Registry


def main(argv: list[str] | None = None) -> int:
    skip_final_collection()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("executor", help="executor name or package.module:Class")
    parser.add_argument("--timeout", type=float, default=20.0, help="parallel.timeout_s")
    parser.add_argument("--checks", default=",".join(CHECKS), help="comma-separated checks")
    parser.add_argument("--reports", required=True, type=Path, help="folder for the reports")
    args = parser.parse_args(argv)
    launched = LaunchedRank.from_environ(os.environ)
    allow = os.environ.get("SHARDLINE_PLUGINS")
    plugins = tuple(p.strip() for p in allow.split(",") if p.strip()) if allow else None
    executor_class = Registry.load(allow=plugins).get("executor", args.executor).load_available()
    config = probe_config(args.executor, launched.world_size, args.timeout, plugins)
    shared: list[Executor] = []

    def shared_executor() -> Executor:
        if not shared:
            shared.append(executor_class(config))
        return shared[0]

    subject = Subject(
        executor_class,
        launched.world_size,
        shared_executor,
        lambda: executor_class(config),
        process_rank=launched.rank,
    )
    failed = False
    reports = (args.reports / f"rank-{launched.rank}.jsonl").open("w")
    for name in args.checks.split(","):
        report = {"rank": launched.rank, "check": name, "world_size": launched.world_size}
        reason = not_applicable(executor_class, name, launched.world_size)
        if reason is not None:
            report |= {"outcome": "unsupported", "message": reason}
        else:
            try:
                CHECKS[name][0](subject)
                report["outcome"] = "passed"
            except Exception as error:
                failed = True
                report |= {
                    "outcome": "failed",
                    "message": f"{type(error).__name__}: {error}",
                    "traceback": traceback.format_exc(),
                }
        reports.write(json.dumps(report) + "\n")
        reports.flush()
    for executor in shared:
        executor.shutdown()
    reports.close()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
