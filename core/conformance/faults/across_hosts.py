"""Host faults: a world of one rank per simulated host (:mod:`shardline.launch.hosts`), and
the second host killed, taken down, cut off or stopped while its rank pauses in a step, or
its rank never joining (:data:`~.scenarios.HOST_SCENARIOS`).

How the world starts depends on the executor: a launched one (``external_launcher``) under
torchrun, one agent per host; a driver-owned one whose ranks span hosts (``ray``) from a
driver in the first host, over what the executor's ``prepare_hosts`` brings up on the hosts
(Ray: a head node in h1, a worker node in h2), with ``parallel.nnodes`` = 2.

Pass: the survivor (rank 0, on the first host, or the driver there) raises a typed error of
an expected kind within the deadline + 1 s, naming the victim's rank and host; its executor
shuts down cleanly; and once the run ends (and what ``prepare_hosts`` brought up is
stopped) no process is left on any host, nor anything in any host's ``/dev/shm``. Start-up
faults are timed from when the last rank began joining. Each scenario gets fresh hosts,
which are taken down afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardline.conformance.faults.matrix import (
    Result,
    Settings,
    judge_process,
    write_injection_distribution,
)
from shardline.conformance.faults.scenarios import PLAN_VARIABLE, Scenario
from shardline.errors import HostsError
from shardline.interfaces import Executor
from shardline.launch import hosts as simulated
from shardline.launch.launchers import launcher_environment
from shardline.launch.tether import tethered

#: How long the processes of a finished scenario may take to end on their own, on every host.
SETTLE_S = 30.0
#: Ranks (and hosts) of a host scenario's world; the victim is the last.
RANKS = 2


def unavailable_reason() -> str | None:
    """Why host scenarios cannot run here, or None."""
    return simulated.unavailable_reason()


def combination_label(name: str, executor: type[Executor], communicator: str) -> str:
    """The report's name for ``executor`` (registered as ``name``) x ``communicator``."""
    via = "torchrun, " if executor.launched else ""
    return f"{name} ({via}{RANKS} hosts) x {communicator}"


def executor_unfit_reason(name: str, executor: type[Executor]) -> str | None:
    """Why the host scenarios cannot run executor ``name``, or None."""
    if executor.launched or executor.spans_hosts:
        return None
    return f"executor {name} runs every rank on the driver's host (spans_hosts is false)"


def run_host_scenario(
    name: str, executor: type[Executor], communicator: str, scenario: Scenario, settings: Settings
) -> Result:
    """Run ``scenario`` on fresh hosts with executor ``executor`` (registered as ``name``)
    and ``communicator`` on both planes, and judge it."""
    result = Result(scenario.name, combination_label(name, executor, communicator), "unsupported")
    reason = unavailable_reason() or executor_unfit_reason(name, executor)
    if reason is not None:
        result.reason = reason
        return result
    survivor_role = "rank-0" if executor.launched else "driver"
    began = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="shardline-host-faults-") as scratch,
        simulated.SimulatedHosts.up(RANKS) as made,
    ):
        folders = {part: Path(scratch, part) for part in ("reports", "markers", "logs")}
        for folder in folders.values():
            folder.mkdir()
        environ = _environment(scenario, Path(scratch), folders["markers"])
        program = _program(name, communicator, scenario, settings, folders["reports"])
        if executor.launched:
            started = _start(
                made.torchrun(RANKS, 1, [*program, "--launched"]), environ, folders["logs"]
            )
            problems = _act(made, scenario, settings, folders, survivor_role)
        else:
            started, problems = _drive(
                made, executor, program, environ, scenario, settings, folders
            )
        outputs, left = _settle(made, started)
        segments = {host.name: _shm_entries(host) for host in made.hosts}
        processes = [json.loads(p.read_text()) for p in sorted(folders["reports"].glob("*.json"))]
        joined_at = [float(path.read_text()) for path in folders["markers"].glob("joining-*")]
    result.seconds = round(time.monotonic() - began, 1)
    result.processes = processes
    survivor = next((p for p in processes if p["role"] == survivor_role), None)
    if survivor is None:
        problems.append(f"{survivor_role} wrote no report")
    else:
        deadline = settings.timeout_s
        if scenario.deadline == "startup":
            deadline = settings.startup_timeout_s
            if "failed_at" in survivor and joined_at:
                survivor["elapsed_s"] = round(survivor["failed_at"] - max(joined_at), 3)
        problems += judge_process(scenario, survivor_role, deadline, RANKS - 1, survivor)
        for word in scenario.words:
            if word not in survivor.get("message", ""):
                problems.append(f"{survivor_role}'s message does not mention {word!r}")
    if left:
        problems.append(f"processes left on the hosts {SETTLE_S:g} s after the run: {left}")
    if any(segments.values()):
        problems.append(f"/dev/shm entries left on the hosts: {segments}")
    result.outcome = "failed" if problems else "passed"
    if problems:
        tail = "\n".join(output[-1500:] for output in outputs)
        result.reason = "; ".join(problems) + f"\n--- output ---\n{tail}"
    return result


def _environment(scenario: Scenario, scratch: Path, markers: Path) -> dict[str, str]:
    """The world's environment: the fault plan, a temporary folder inside ``scratch`` (what
    torchrun leaves there goes with it), and for a start-up fault the injection plugin on
    the import path (:mod:`.injection`)."""
    environ = launcher_environment()
    environ["TMPDIR"] = str(scratch / "tmp")
    (scratch / "tmp").mkdir()
    if not scenario.step_fault:
        write_injection_distribution(scratch / "dist")
        environ["PYTHONPATH"] = os.pathsep.join([str(scratch / "dist"), environ["PYTHONPATH"]])
    environ[PLAN_VARIABLE] = json.dumps(
        {"scenario": scenario.name, "victim": RANKS - 1, "markers": str(markers)}
    )
    return environ


def _program(
    executor: str, communicator: str, scenario: Scenario, settings: Settings, reports: Path
) -> list[str]:
    """What each launched rank, or the driver, runs: one process of the scenario
    (:mod:`.rank_main`)."""
    return [
        "-m", "shardline.conformance.faults.rank_main", scenario.name,
        f"--executor={executor}", f"--communicator={communicator}", f"--ranks={RANKS}",
        f"--nnodes={RANKS}", f"--timeout={settings.timeout_s}",
        f"--startup-timeout={settings.startup_timeout_s}", f"--reports={reports}",
    ]  # fmt: skip


def _start(
    commands: list[list[str]], environ: dict[str, str], logs: Path
) -> list[tuple[subprocess.Popen, Path]]:
    """Start ``commands`` at once, each tethered to this process, in a session of its own,
    writing to a log file of its own; the processes and their logs."""
    started = []
    for index, command in enumerate(commands):
        log = logs / f"{index}.log"
        with log.open("w") as output:
            process = subprocess.Popen(
                tethered(command),
                env=environ,
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        started.append((process, log))
    return started


def _drive(
    made: simulated.SimulatedHosts,
    executor: type[Executor],
    program: list[str],
    environ: dict[str, str],
    scenario: Scenario,
    settings: Settings,
    folders: dict[str, Path],
) -> tuple[list[tuple[subprocess.Popen, Path]], list[str]]:
    """Bring up what ``executor`` needs on the hosts, run the driver in the first one, act on
    the second, and wait (at most :data:`SETTLE_S`) for the driver to end before what was
    brought up is stopped. The driver process and its log, and what went wrong."""
    first = made.hosts[0]
    started: list[tuple[subprocess.Popen, Path]] = []
    try:
        with executor.prepare_hosts(made.hosts, environ) as driver_environ:
            started = _start(
                [first.command([sys.executable, *program])], driver_environ, folders["logs"]
            )
            problems = _act(made, scenario, settings, folders, "driver")
            (driver, _), *_ = started
            try:
                driver.wait(SETTLE_S)
            except subprocess.TimeoutExpired:
                problems.append(f"the driver did not end within {SETTLE_S:g} s of its report")
                driver.kill()
                driver.wait()
    except HostsError as error:
        problems = [f"the executor's prepare_hosts failed: {error}"]
    return started, problems


def _act(
    made: simulated.SimulatedHosts,
    scenario: Scenario,
    settings: Settings,
    folders: dict[str, Path],
    survivor_role: str,
) -> list[str]:
    """Wait for the victim to pause in the step, do the scenario's action to its host, and
    (for a cut link or stopped processes) undo it once the survivor has reported."""
    victim = made.hosts[-1].name
    report = folders["reports"] / f"{survivor_role}.json"
    if not scenario.step_fault:
        limit = settings.startup_timeout_s + 60
        return [] if _wait_for(report, limit) else [f"{survivor_role} did not report"]
    if not _wait_for(folders["markers"] / "in-step", settings.startup_timeout_s + 60):
        return ["the victim never reached the step"]
    action = scenario.host_action
    if action == "kill":
        _kill_all(made, victim)
    elif action == "take down":
        made = made.take_down(victim)
    elif action == "link":
        made.set_link(victim, up=False)
    elif action == "stop":
        made.signal_host(victim, signal.SIGSTOP)
    reported = _wait_for(report, settings.timeout_s + 30)
    if action == "link":
        made.set_link(victim, up=True)
    elif action == "stop":
        made.signal_host(victim, signal.SIGCONT)
    return [] if reported else [f"{survivor_role} did not report within the deadline + 30 s"]


def _kill_all(made: simulated.SimulatedHosts, name: str) -> None:
    """SIGKILL every process started in host ``name`` until none is left (a process may
    start another meanwhile)."""
    deadline = time.monotonic() + 5.0
    while made.signal_host(name, signal.SIGKILL) and time.monotonic() < deadline:
        time.sleep(0.02)


def _settle(
    made: simulated.SimulatedHosts, started: list[tuple[subprocess.Popen, Path]]
) -> tuple[list[str], dict[str, list[str]]]:
    """Give every process on the hosts :data:`SETTLE_S` to end; the outputs of ``started``,
    and what was still running then (host -> commands; killed since)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and any(host.started() for host in made.hosts):
        time.sleep(0.1)
    left = {
        host.name: [_command_of(pid) for pid in host.started()]
        for host in made.hosts
        if host.started()
    }
    for host in made.hosts:
        _kill_all(made, host.name)
    outputs = []
    for process, log in started:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        outputs.append(log.read_text(errors="replace"))
    return outputs, left


def _shm_entries(host: simulated.Host) -> list[str]:
    """What is in the host's own /dev/shm (the run made it empty)."""
    listed = subprocess.run(
        host.command(["ls", "-A", "/dev/shm"]), capture_output=True, text=True, timeout=10
    )
    return listed.stdout.split()


def _command_of(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return f"pid {pid}"
    command = raw.replace(b"\0", b" ").decode(errors="replace")
    return f"pid {pid}: {command[:160]}"


def _wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.02)
    return False
