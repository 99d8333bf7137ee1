"""Host faults: a world of one rank per simulated host (:mod:`shardline.launch.hosts`),
started by torchrun with one agent per host, and the second host killed, cut off or stopped
while its rank pauses in a step (:data:`~.scenarios.HOST_SCENARIOS`).

Pass: rank 0 (on the first host) raises a typed error of an expected kind within the
deadline + 1 s, naming the victim's rank and host; its executor shuts down cleanly; and once
the run ends no process is left on any host, nor anything in any host's ``/dev/shm``.
Each scenario gets fresh hosts, which are taken down afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
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


def run_host_scenario(communicator: str, scenario: Scenario, settings: Settings) -> Result:
    """Run ``scenario`` on fresh hosts with ``communicator`` on both planes, and judge it."""
    label = f"external_launcher (torchrun, {RANKS} hosts) x {communicator}"
    result = Result(scenario.name, label, "unsupported")
    reason = unavailable_reason()
    if reason is not None:
        result.reason = reason
        return result
    began = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="shardline-host-faults-") as scratch,
        simulated.SimulatedHosts.up(RANKS) as made,
    ):
        reports, markers = Path(scratch, "reports"), Path(scratch, "markers")
        reports.mkdir()
        markers.mkdir()
        environ = launcher_environment()
        if not scenario.step_fault:  # a start-up fault: the injection plugin plants it
            write_injection_distribution(Path(scratch, "dist"))
            environ["PYTHONPATH"] = os.pathsep.join(
                [str(Path(scratch, "dist")), environ["PYTHONPATH"]]
            )
        environ[PLAN_VARIABLE] = json.dumps(
            {"scenario": scenario.name, "victim": RANKS - 1, "markers": str(markers)}
        )
        agents = [
            subprocess.Popen(
                tethered(command),
                env=environ,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
            for command in made.torchrun(
                RANKS, 1, _program(communicator, scenario, settings, reports)
            )
        ]
        problems = _act(made, scenario, settings, markers, reports)
        outputs, left = _settle(made, agents)
        segments = {host.name: _shm_entries(host) for host in made.hosts}
        processes = [json.loads(path.read_text()) for path in sorted(reports.glob("*.json"))]
    result.seconds = round(time.monotonic() - began, 1)
    result.processes = processes
    survivor = next((p for p in processes if p["role"] == "rank-0"), None)
    if survivor is None:
        problems.append("rank 0 wrote no report")
    else:
        deadline = (
            settings.startup_timeout_s if scenario.deadline == "startup" else settings.timeout_s
        )
        problems += judge_process(scenario, "rank-0", deadline, RANKS - 1, survivor)
        for word in scenario.words:
            if word not in survivor.get("message", ""):
                problems.append(f"rank 0's message does not mention {word!r}")
    if left:
        problems.append(f"processes left on the hosts {SETTLE_S:g} s after the run: {left}")
    if any(segments.values()):
        problems.append(f"/dev/shm entries left on the hosts: {segments}")
    result.outcome = "failed" if problems else "passed"
    if problems:
        tail = "\n".join(output[-1500:] for output in outputs)
        result.reason = "; ".join(problems) + f"\n--- output ---\n{tail}"
    return result


def _program(communicator: str, scenario: Scenario, settings: Settings, reports: Path) -> list[str]:
    """What each rank runs: one process of the scenario (:mod:`.rank_main`)."""
    return [
        "-m", "shardline.conformance.faults.rank_main", scenario.name,
        "--executor=external_launcher", f"--communicator={communicator}", f"--ranks={RANKS}",
        f"--timeout={settings.timeout_s}", f"--startup-timeout={settings.startup_timeout_s}",
        f"--reports={reports}", "--launched",
    ]  # fmt: skip


def _act(
    made: simulated.SimulatedHosts,
    scenario: Scenario,
    settings: Settings,
    markers: Path,
    reports: Path,
) -> list[str]:
    """Wait for the victim to pause in the step, do the scenario's action to its host, and
    (for a cut link or stopped processes) undo it once rank 0 has reported."""
    victim = made.hosts[-1].name
    if not scenario.step_fault:
        limit = settings.startup_timeout_s + 30
        return [] if _wait_for(reports / "rank-0.json", limit) else ["rank 0 did not report"]
    if not _wait_for(markers / "in-step", settings.startup_timeout_s + 30):
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
    reported = _wait_for(reports / "rank-0.json", settings.timeout_s + 30)
    if action == "link":
        made.set_link(victim, up=True)
    elif action == "stop":
        made.signal_host(victim, signal.SIGCONT)
    return [] if reported else ["rank 0 did not report within the deadline + 30 s"]


def _kill_all(made: simulated.SimulatedHosts, name: str) -> None:
    """SIGKILL every process started in host ``name`` until none is left (a process may
    start another meanwhile)."""
    deadline = time.monotonic() + 5.0
    while made.signal_host(name, signal.SIGKILL) and time.monotonic() < deadline:
        time.sleep(0.02)


def _settle(
    made: simulated.SimulatedHosts, agents: list[subprocess.Popen]
) -> tuple[list[str], dict[str, list[str]]]:
    """Give every process on the hosts :data:`SETTLE_S` to end; the agents' output, and what
    was still running then (host -> commands; killed since)."""
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
    for agent in agents:
        try:
            outputs.append(agent.communicate(timeout=10)[0] or "")
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            outputs.append(agent.communicate()[0] or "")
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
