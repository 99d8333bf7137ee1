"""The fault matrix: every scenario on every valid (executor, communicator) combination.

Each scenario runs in processes of its own, started in a session of their own: the driver
(``uni``, ``mp`` and other driver-owned executors) or the ranks under a launcher (torchrun;
mpiexec for communicators that need it). The suite plants faults with the fault model
runner and, for start-up faults, with a temporary plugin distribution on ``PYTHONPATH``
(:mod:`.injection`); nothing is injected into the process running the matrix.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardline.conformance.faults.scenarios import (
    DEADLINE_SLACK_S,
    INJECTION_ENTRY_POINT,
    PLAN_VARIABLE,
    SHUTDOWN_LIMIT_S,
    TENSOR_PARALLEL,
    UNFINISHED,
    Scenario,
)
from shardline.launch import launchers, private_shm
from shardline.registry import Registry


@dataclass(frozen=True)
class Settings:
    """Deadlines of the scenario worlds, how many ranks a multi-rank world has and their
    layout (:data:`~.scenarios.LAYOUTS`: tensor-parallel, or pipeline stages)."""

    ranks: int = 2
    timeout_s: float = 3.0
    startup_timeout_s: float = 20.0
    layout: str = TENSOR_PARALLEL


@dataclass(frozen=True)
class Combination:
    """An executor and a communicator, how the ranks start (``launcher``: None when the
    executor starts them), or why the pair cannot run here (``unsupported``)."""

    executor: str
    communicator: str
    launcher: str | None = None
    max_ranks: int | None = None
    unsupported: str | None = None

    @property
    def label(self) -> str:
        via = f" ({self.launcher})" if self.launcher else ""
        return f"{self.executor}{via} x {self.communicator}"


@dataclass
class Result:
    scenario: str
    combination: str
    outcome: str  # passed | failed | unsupported
    reason: str = ""
    seconds: float = 0.0
    processes: list[dict[str, Any]] = field(default_factory=list)


def combinations(
    registry: Registry, executors: Sequence[str], communicators: Sequence[str]
) -> list[Combination]:
    """Every (executor, communicator) pair, with its launcher or why it cannot run."""
    found = []
    for executor_name in executors:
        executor = registry.get("executor", executor_name)
        executor_class = executor.load() if executor.unavailable_reason() is None else None
        for communicator_name in communicators:
            communicator = registry.get("communicator", communicator_name)
            needs = communicator.capabilities.launcher if communicator.capabilities else None
            unsupported = None
            launcher = None
            if executor_class is None:
                unsupported = (
                    f"executor {executor_name} unavailable: {executor.unavailable_reason()}"
                )
            elif communicator.unavailable_reason() is not None:
                unsupported = (
                    f"communicator {communicator_name} unavailable: "
                    f"{communicator.unavailable_reason()}"
                )
            elif executor_class.launched:
                launcher = needs or "torchrun"
            elif needs is not None:
                unsupported = (
                    f"{communicator_name} needs ranks started by {needs}; {executor_name} "
                    "starts its own"
                )
            found.append(
                Combination(
                    executor_name,
                    communicator_name,
                    launcher,
                    getattr(executor_class, "max_world_size", None),
                    unsupported,
                )
            )
    return found


def run_scenario(
    combination: Combination,
    scenario: Scenario,
    settings: Settings,
    sessions: launchers.Sessions | None = None,
) -> Result:
    """Run ``scenario`` on ``combination`` and judge it (see :mod:`.scenarios`); its run
    joins ``sessions`` while it goes."""
    result = Result(scenario.name, combination.label, "unsupported")
    if combination.unsupported:
        result.reason = combination.unsupported
        return result
    ranks = settings.ranks if scenario.min_ranks > 1 else 1
    if combination.max_ranks is not None and ranks > combination.max_ranks:
        result.reason = (
            f"needs {scenario.min_ranks} ranks; {combination.executor} runs at most "
            f"{combination.max_ranks}"
        )
        return result
    if scenario.in_tp_group and settings.layout != TENSOR_PARALLEL:
        result.reason = (
            f"its fault is in the tensor-parallel group; the {settings.layout} layout has none"
        )
        return result
    startup = settings.startup_timeout_s
    deadline = startup if scenario.deadline == "startup" else settings.timeout_s
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shardline-faults-") as scratch, _own_shm() as shm:
        reports, markers, dist = (Path(scratch, name) for name in ("reports", "markers", "dist"))
        for folder in (reports, markers):
            folder.mkdir()
        write_injection_distribution(dist)
        environ = launchers.launcher_environment()
        environ["PYTHONPATH"] = os.pathsep.join([str(dist), environ["PYTHONPATH"]])
        environ[PLAN_VARIABLE] = json.dumps(
            {"scenario": scenario.name, "victim": ranks - 1, "markers": str(markers)}
        )
        program = [
            "-m",
            "shardline.conformance.faults.rank_main",
            scenario.name,
            f"--executor={combination.executor}",
            f"--communicator={combination.communicator}",
            f"--ranks={ranks}",
            f"--layout={settings.layout}",
            f"--timeout={settings.timeout_s}",
            f"--startup-timeout={startup}",
            f"--reports={reports}",
        ]
        if combination.launcher:
            command = [*launchers.launcher_command(combination.launcher, ranks), *program]
            command.append("--launched")
        else:
            command = [sys.executable, *program]
        if shm is not None:
            command = shm.wrap(command)
        run = launchers.run_session(command, environ, startup + deadline + 90, sessions)
        processes = [json.loads(path.read_text()) for path in sorted(reports.glob("*.json"))]
        imported_by = sorted(markers.glob("imported-by-*"))
        joined_at = {
            int(path.name.removeprefix("joining-")): float(path.read_text())
            for path in markers.glob("joining-*")
        }
        left = shm.entries() if shm is not None else []
    result.seconds = round(time.monotonic() - began, 1)
    result.processes = processes
    problems = _judge(scenario, combination, ranks, deadline, processes, run, joined_at)
    if scenario.name == "plugin left out by allow-list" and imported_by:
        problems.append(f"{len(imported_by)} process(es) imported the left-out plugin")
    if scenario.name == "plugin raises on import" and not imported_by:
        problems.append("no process imported the plugin: the injection did not happen")
    if left:
        problems.append(f"/dev/shm entries left: {left}")
    if run.leftovers:
        problems.append(f"processes left after the run: {run.leftovers}")
    if run.timed_out:
        problems.append(f"the run did not end within {startup + deadline + 90:g} s")
    result.outcome = "failed" if problems else "passed"
    if problems:
        tail = (run.stdout[-1500:] + run.stderr[-2500:]).strip()
        result.reason = "; ".join(problems) + (f"\n--- output ---\n{tail}" if tail else "")
    return result


@contextlib.contextmanager
def _own_shm():
    """A private /dev/shm for one scenario (None where it cannot be made: see
    :func:`leak_check_unavailable`): what the run leaves there is its own leak, another
    job's segments are never seen, and everything is removed afterwards."""
    if private_shm.unavailable_reason() is not None:
        yield None
        return
    with private_shm.PrivateShm() as shm:
        yield shm


def leak_check_unavailable() -> str | None:
    """Why the matrix cannot judge /dev/shm leaks here (it judges none then), or None."""
    reason = private_shm.unavailable_reason()
    return None if reason is None else f"/dev/shm leaks are not judged: {reason}"


def _judge(
    scenario: Scenario,
    combination: Combination,
    ranks: int,
    deadline: float,
    processes: list[dict[str, Any]],
    run: launchers.LaunchedRun,
    joined_at: dict[int, float],
) -> list[str]:
    """What is wrong with a run (nothing: passed). A launched survivor may have no report,
    or one from before its shutdown, when its launcher ended the world after another rank
    failed (torchrun and mpiexec do); one must report unless the victim's death was that
    failure. Start-up faults are timed from when the last rank (the victim included) reached
    the point of joining (``joined_at``: rank -> wall-clock time)."""
    victim = ranks - 1
    by_role = {process["role"]: process for process in processes}
    if combination.launcher:
        survivors = [
            f"rank-{rank}" for rank in range(ranks) if scenario.victim_survives or rank != victim
        ]
    else:
        survivors = ["driver"]
    problems = []
    messages = []
    reported = [role for role in survivors if role in by_role]

    def ended_by_launcher(role: str) -> bool:
        """Whether the launcher may have ended ``role``'s process because another rank failed
        first (torchrun and mpiexec end the world then)."""
        others = [other for other in reported if other != role]
        first_failure = others or scenario.name == "killed mid-step"
        return bool(combination.launcher and first_failure and run.returncode != 0)

    for role in survivors:
        process = by_role.get(role)
        if process is None:
            if ended_by_launcher(role):
                continue  # the launcher ended the world when another rank failed first
            problems.append(f"{role} wrote no report (exit code {run.returncode})")
            continue
        if process.get("shutdown") == UNFINISHED and ended_by_launcher(role):
            process = {key: value for key, value in process.items() if key != "shutdown"}
        messages.append(process.get("message", ""))
        if scenario.deadline == "startup" and "failed_at" in process and joined_at:
            process["elapsed_s"] = round(process["failed_at"] - max(joined_at.values()), 3)
        problems += judge_process(scenario, role, deadline, victim, process)
    missing = [word for word in scenario.words if not any(word in m for m in messages)]
    if messages and missing:
        problems.append(
            f"no survivor's message mentions {', '.join(map(repr, missing))}: "
            + " | ".join(message[:300] for message in messages)
        )
    if scenario.step_fault:
        problems += [
            f"{process['role']} failed in its {process['phase']} phase, before the fault: "
            f"{process.get('error')}: {process.get('message', '')[:300]}"
            for process in processes
            if process.get("phase") != "step"
        ]
    return problems


def judge_process(
    scenario: Scenario, role: str, deadline: float, victim: int, process: dict[str, Any]
) -> list[str]:
    problems = []
    outcome = process.get("outcome")
    if scenario.completes:
        if outcome != "completed":
            problems.append(f"{role}: {outcome}: {process.get('error')}: {process.get('message')}")
    elif outcome != "error":
        problems.append(
            f"{role}: expected a typed error, got {outcome} {process.get('error', '')}: "
            f"{process.get('message', process.get('output'))}"
        )
    else:
        kind = process["error"]
        inner = kind.removeprefix("WorkerError(").removesuffix(")")
        if inner not in scenario.errors:
            problems.append(
                f"{role}: raised {kind}, expected one of {', '.join(scenario.errors)}: "
                f"{process['message'][:300]}"
            )
        limit = deadline + DEADLINE_SLACK_S
        if process["elapsed_s"] > limit:
            problems.append(
                f"{role}: raised {kind} after {process['elapsed_s']:.2f} s (limit {limit:g} s): "
                f"{process['message'][:300]}"
            )
        names = re.search(rf"\branks? \[?(\d+, )*{victim}\b", process["message"])
        if scenario.names_victim and role in ("driver", "rank-0") and not names:
            problems.append(
                f"{role}: the error does not name rank {victim}: {process['message'][:300]}"
            )
    shutdown = process.get("shutdown")
    if shutdown == UNFINISHED:
        problems.append(f"{role}: its shutdown did not finish")
    elif shutdown is not None and shutdown != "clean":
        problems.append(f"{role}: shutdown raised {shutdown}")
    if process.get("shutdown_s", 0.0) > SHUTDOWN_LIMIT_S:
        problems.append(f"{role}: shutdown took {process['shutdown_s']:.1f} s")
    return problems


def write_injection_distribution(folder: Path) -> None:
    """A distribution with only an entry point: ``fault_injection`` -> :mod:`.injection`."""
    info = folder / "shardline_fault_injection-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: shardline-fault-injection\nVersion: 0\n"
    )
    (info / "entry_points.txt").write_text(
        f"[shardline.plugins]\n{INJECTION_ENTRY_POINT} = shardline.conformance.faults.injection\n"
    )


def run_matrix(
    combos: Sequence[Combination],
    scenarios: Sequence[Scenario],
    settings: Settings,
    progress: Callable[[Result], None],
    jobs: int = 1,
) -> list[Result]:
    """Every scenario on every combination, ``jobs`` at a time (each in processes, a private
    /dev/shm and a scratch folder of its own); ``progress(result)`` as each ends. The
    results are in combination, then scenario order. Interrupted (Ctrl-C, SIGTERM), it
    kills the scenarios running and starts no other."""
    cells = [(combination, scenario) for combination in combos for scenario in scenarios]
    sessions = launchers.Sessions()

    def run_one(cell: tuple[Combination, Scenario]) -> Result:
        result = run_scenario(*cell, settings, sessions)
        if not sessions.ended:  # else it was stopped, not judged
            progress(result)
        return result

    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="fault-scenario") as pool:
        try:
            return list(pool.map(run_one, cells))
        except BaseException:
            sessions.end_all()  # pool.map has cancelled the scenarios not yet started
            raise


def report(results: Sequence[Result], settings: Settings) -> dict[str, Any]:
    """The JSON report: settings, whether leaks were judged, pass counts per combination,
    every result."""
    counts: dict[str, dict[str, int]] = {}
    for result in results:
        row = counts.setdefault(result.combination, {})
        row[result.outcome] = row.get(result.outcome, 0) + 1
    return {
        "settings": asdict(settings),
        "leak_check": leak_check_unavailable() or "each scenario in a private /dev/shm",
        "counts": counts,
        "results": [asdict(r) for r in results],
    }
