"""One process of a fault scenario: the driver of a driver-owned executor, or one rank of a
launched world (the suite starts it; see :mod:`.matrix`)::

    python -m shardline.conformance.faults.rank_main SCENARIO --executor E --communicator C
        --ranks N [--layout tp|pp] [--nnodes H] --timeout T --startup-timeout S --reports DIR

It builds the world, arms the fault, runs one step, and writes what happened to
``DIR/ROLE.json`` (ROLE: ``driver`` or ``rank-R``): the outcome, the error's kind and
message, the seconds from the fault's start to the error, and how shutdown went (written
first with shutdown "unfinished" just before the shutdown, then again after it). Exit code
0 when the step completed, 1 otherwise (so a launcher ends the rest of the world).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardline.config import load_config
from shardline.config.schema import EngineConfig
from shardline.conformance.faults.plan import FAULT_RUNNER, Plan, arm
from shardline.conformance.faults.scenarios import (
    HOST_SCENARIOS,
    INJECTION_ENTRY_POINT,
    LAYOUTS,
    PIPELINE,
    PLAN_VARIABLE,
    SCENARIOS,
    TENSOR_PARALLEL,
    UNFINISHED,
    Scenario,
)
from shardline.errors import ShardlineError, WorkerError
from shardline.interfaces.step import NewRequest, SamplingParams, SchedulerOutput
from shardline.launch.launcher_env import LaunchedRank
from shardline.launch.process_exit import skip_final_collection
from shardline.registry import Registry, installed_plugins


def fault_config(
    scenario: Scenario,
    executor: str,
    communicator: str,
    ranks: int,
    timeout_s: float,
    startup_timeout_s: float,
    nnodes: int = 1,
    layout: str = TENSOR_PARALLEL,
) -> EngineConfig:
    """The scenario world's config: ``ranks`` ranks over ``nnodes`` hosts, tensor-parallel
    or (``layout`` "pp") pipeline stages, ``communicator`` on both planes, the fault
    runner."""
    size = "pipeline_parallel_size" if layout == PIPELINE else "tensor_parallel_size"
    overrides = [
        f"model.runner={FAULT_RUNNER}",
        f"parallel.{size}={ranks}",
        f"parallel.nnodes={nnodes}",
        f"parallel.distributed_executor_backend={executor}",
        f"parallel.communicator={communicator}",
        f"parallel.control_communicator={communicator}",
        f"parallel.timeout_s={timeout_s}",
        f"parallel.startup_timeout_s={startup_timeout_s}",
        *scenario.overrides,
    ]
    if scenario.name == "plugin left out by allow-list":
        names = [name for name in installed_plugins() if name != INJECTION_ENTRY_POINT]
        overrides.append(f"plugins.allow=[{','.join(names)}]")
    return load_config(overrides=overrides, environ={}).config


def error_kind(error: BaseException) -> str:
    """The error's class name; a WorkerError also names the kind it carries."""
    if isinstance(error, WorkerError):
        return f"WorkerError({error.exc_type})"
    return type(error).__name__


def _step() -> SchedulerOutput:
    return SchedulerOutput(
        new_requests=[NewRequest("fault", [1, 2, 3], SamplingParams(temperature=0.0), [0])],
        num_scheduled_tokens={"fault": 3},
    )


def run(
    args: argparse.Namespace, role: str, save: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """The scenario in this process; its report. ``save`` is given the report before the
    executor's shutdown, marked ``"shutdown": "unfinished"``: a launcher that ends
    the world while this process shuts down (mpiexec does, when another rank's job abort comes
    first) leaves what the step raised on record."""
    scenario = {**SCENARIOS, **HOST_SCENARIOS}[args.scenario]
    report: dict[str, Any] = {"role": role, "pid": os.getpid(), "phase": "plugins"}
    executor = None
    started = time.monotonic()
    try:
        config = fault_config(
            scenario,
            args.executor,
            args.communicator,
            args.ranks,
            args.timeout,
            args.startup_timeout,
            args.nnodes,
            args.layout,
        )
        registry = Registry.for_plugins(config.plugins)
        component = registry.get("executor", args.executor)
        component.head_start(config)  # as a run gives it, before torch is imported here
        executor_class = component.load_available()
        report["phase"] = "start-up"
        started = time.monotonic()
        executor = executor_class(config)
        report["phase"] = "arm"
        fault = scenario.name if scenario.step_fault else None
        markers = json.loads(os.environ.get(PLAN_VARIABLE) or "{}").get("markers", "")
        plan = Plan(fault, args.ranks - 1, markers)
        # Planting the fault is set-up, not the step under test: under load a rank may come
        # out of start-up seconds after another, so the call waits the start-up deadline.
        report["rank_pids"] = executor.collective_rpc(arm, (plan,), timeout=args.startup_timeout)
        report["phase"] = "step"
        started = time.monotonic()
        output = executor.execute_model(_step()).result(timeout=args.timeout + 30)
        report |= {"outcome": "completed", "output": output}
    except ShardlineError as error:
        report["failed_at"] = time.time()
        report |= {"outcome": "error", "error": error_kind(error), "message": str(error)[:4000]}
    except Exception as error:
        report |= {
            "outcome": "untyped error",
            "error": error_kind(error),
            "message": str(error)[:4000],
            "traceback": traceback.format_exc()[-4000:],
        }
    report["elapsed_s"] = round(time.monotonic() - started, 3)
    if executor is not None:
        save(report | {"shutdown": UNFINISHED})
        began = time.monotonic()
        try:
            executor.shutdown()
            report["shutdown"] = "clean"
        except Exception as error:
            report["shutdown"] = f"{error_kind(error)}: {error}"
        report["shutdown_s"] = round(time.monotonic() - began, 3)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=[*SCENARIOS, *HOST_SCENARIOS])
    parser.add_argument("--executor", required=True)
    parser.add_argument("--communicator", required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--layout", choices=LAYOUTS, default=TENSOR_PARALLEL)
    parser.add_argument("--nnodes", type=int, default=1, help="hosts the ranks span")
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--startup-timeout", type=float, required=True)
    parser.add_argument("--launched", action="store_true", help="one rank of a launched world")
    parser.add_argument("--reports", type=Path, required=True)
    args = parser.parse_args(argv)
    skip_final_collection()
    role = f"rank-{LaunchedRank.from_environ(os.environ).rank}" if args.launched else "driver"

    def save(report: dict[str, Any]) -> None:
        partial = args.reports / f".{role}.json"
        partial.write_text(json.dumps(report, default=repr))
        partial.rename(args.reports / f"{role}.json")

    report = run(args, role, save)
    save(report)
    return 0 if report.get("outcome") == "completed" else 1


if __name__ == "__main__":
    raise SystemExit(main())
