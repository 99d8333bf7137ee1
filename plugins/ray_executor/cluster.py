"""A Ray cluster on given hosts (:meth:`RayExecutor.prepare_hosts
<shardline_ray.executor.RayExecutor.prepare_hosts>`): the head node in the first host, a
worker node in each other one. For harnesses that make hosts (tests, benchmarks, the fault
suite on simulated hosts): each host's ``command(argv)`` runs ``argv`` inside it.

Each node is ``ray start --block`` inside its host, bound to the host's address, declaring
:data:`NODE_CPUS` CPUs, with token authentication under a token made for this cluster (in
every node's environment and the driver's), without the dashboard; the head keeps its files
in a temporary folder of its own. Leaving stops the worker nodes first, then the head (as
``ray stop`` would be run: a worker's agents report to the head before they leave), waits
until each host has no process left, and removes the folder. Needs only the ``ray``
command beside this Python, not the ``ray`` module.
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from shardline.errors import HostsError
from shardline.interfaces import Host
from shardline_ray.temp_folder import ray_temp_folder

#: The head's port (in the head host's own network).
HEAD_PORT = 6379
#: Logical CPUs each node declares: Ray only accounts for them (a rank uses its host's cores).
NODE_CPUS = 2
#: How long a node may take to start, and to end once asked.
START_S = 90.0
STOP_S = 30.0


@contextlib.contextmanager
def cluster_on(hosts: Sequence[Host], environ: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """Start the nodes (see the module docstring) with ``environ`` (less ``RAY_ADDRESS``)
    and yield the environment of a driver inside ``hosts[0]``: ``environ`` with the token
    and ``RAY_ADDRESS`` naming the head. Raises HostsError naming the host and Ray's last
    words when a node does not start within :data:`START_S` (the nodes started are stopped)."""
    if not hosts:
        raise ValueError("hosts: none given; a Ray cluster needs at least one (its head)")
    head, *others = hosts
    node_environ = {**environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    node_environ.pop("RAY_ADDRESS", None)
    address = f"{head.address}:{HEAD_PORT}"
    folder = ray_temp_folder("shardline-ray-cluster-")
    try:
        with contextlib.ExitStack() as nodes:  # stopped last started first: the head last
            head_options = [
                "--head", f"--port={HEAD_PORT}", f"--temp-dir={folder}",
                "--include-dashboard=false",
            ]  # fmt: skip
            nodes.callback(_stop, _start(head, head_options, node_environ), head)
            for host in others:
                nodes.callback(_stop, _start(host, [f"--address={address}"], node_environ), host)
            yield node_environ | {"RAY_ADDRESS": address}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _start(host: Host, options: list[str], environ: Mapping[str, str]) -> subprocess.Popen:
    """``ray start --block OPTIONS`` inside ``host``, once Ray says it runs (SIGTERM ends it
    and every process it started)."""
    ray = str(Path(sys.executable).with_name("ray"))
    argv = [
        ray, "start", "--block", "--disable-usage-stats", f"--num-cpus={NODE_CPUS}",
        f"--node-ip-address={host.address}", *options,
    ]  # fmt: skip
    process = subprocess.Popen(
        host.command(argv),
        env=dict(environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()

    def drain() -> None:  # all along, so that the node never blocks on a full pipe
        for line in process.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=drain, name=f"ray-node-{host.name}", daemon=True).start()
    said: list[str] = []
    deadline = time.monotonic() + START_S
    while not said or "Ray runtime started" not in said[-1]:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = f"(not started within {START_S:g} s)\n"
        said.append(line)
        if line == "" or line.startswith("(not started"):
            _stop(process, host)
            raise HostsError(
                f"ray start in host {host.name} ({host.address}) failed:\n" + "".join(said)[-3000:]
            )
    return process


def _stop(process: subprocess.Popen, host: Host) -> None:
    """End a node (SIGTERM, SIGKILL after :data:`STOP_S`) and wait, at most :data:`STOP_S`,
    until no process is left in its host (what is left is the caller's to judge)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    deadline = time.monotonic() + STOP_S
    while host.started() and time.monotonic() < deadline:
        time.sleep(0.1)
