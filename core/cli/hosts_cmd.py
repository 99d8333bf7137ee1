"""``shardline hosts``: simulated hosts on this machine (network, hostname and ``/dev/shm``
of their own) to run ranks on as if on several machines."""

from __future__ import annotations

import os
import sys

from shardline.cli.table import render
from shardline.errors import ConfigError
from shardline.launch import hosts as simulated


def up(count: int, cluster: str | None, share_cpus: bool = False) -> int:
    """Makes ``count`` hosts (each on its own CPUs unless ``share_cpus``) and prints them,
    with how to run a command in each."""
    if cluster is not None and not (cluster.isalnum() and cluster.isascii() and len(cluster) <= 6):
        raise ConfigError(f"--name = {cluster!r}: 1 to 6 ASCII letters or digits")
    if cluster is not None and cluster in simulated.clusters():
        raise ConfigError(f"--name = {cluster!r}: hosts of that name are up already")
    if not 1 <= count <= simulated.MAX_HOSTS:
        raise ConfigError(f"hosts up {count}: allowed 1..{simulated.MAX_HOSTS}")
    reason = simulated.unavailable_reason()
    if reason is not None:
        raise ConfigError(reason)
    made = simulated.SimulatedHosts.up(count, cluster, share_cpus)
    _print(made)
    print(f"\nrun a command in a host:  shardline hosts exec {made.cluster} h1 -- COMMAND")
    print(f"take them down:           shardline hosts down {made.cluster}")
    return 0


def list_clusters() -> int:
    """Prints every cluster of hosts ``shardline hosts up`` made and that is still up."""
    names = simulated.clusters()
    if not names:
        print("no simulated hosts are up")
    for index, name in enumerate(names):
        if index:
            print()
        _print(simulated.SimulatedHosts.load(name))
    return 0


def down(names: list[str], every: bool) -> int:
    """Takes cluster ``names[0]`` down, or only its hosts ``names[1:]``, or, with ``every``,
    every cluster ``hosts up`` made."""
    if every == bool(names):
        raise ConfigError(
            "hosts down: name a cluster (`shardline hosts list`), optionally some of its "
            "hosts, or give --all"
        )
    known = simulated.clusters()
    if every:
        for cluster in known:
            simulated.SimulatedHosts.load(cluster).down()
            print(f"cluster {cluster}: down")
        return 0
    cluster, hosts = names[0], names[1:]
    if cluster not in known:
        raise ConfigError(f"hosts down {cluster!r}: no such cluster; up: {known or 'none'}")
    made = simulated.SimulatedHosts.load(cluster)
    present = [host.name for host in made.hosts]
    for host in hosts:
        if host not in present:
            raise ConfigError(f"hosts down {cluster} {host!r}: no such host; up: {present}")
    if not hosts:
        made.down()
        print(f"cluster {cluster}: down")
        return 0
    for host in hosts:
        made = made.take_down(host)
        print(f"host {host} of cluster {cluster}: down")
    return 0


def exec_in(cluster: str, host: str, argv: list[str]) -> int:
    """Replaces this process with ``argv`` run inside ``host`` of ``cluster``."""
    if not argv:
        raise ConfigError("hosts exec: give the command after --")
    if cluster not in simulated.clusters():
        raise ConfigError(f"hosts exec {cluster!r}: no such cluster; up: {simulated.clusters()}")
    made = simulated.SimulatedHosts.load(cluster)
    names = [h.name for h in made.hosts]
    if host not in names:
        raise ConfigError(f"hosts exec {cluster} {host!r}: no such host; allowed: {names}")
    command = made.host(host).command(argv)
    sys.stdout.flush()
    os.execvp(command[0], command)


def agent(cluster: str, words: list[str]) -> int:
    """A remote-shell agent for launchers that start daemons with ssh (OpenMPI's
    ``plm_rsh_agent``): ``[OPTIONS] HOST COMMAND...`` runs the command words, as a shell line
    the way ssh does, inside ``HOST`` of ``cluster``; options before the host are ignored."""
    while words and words[0].startswith("-"):
        words = words[1:]
    if len(words) < 2:
        raise ConfigError("hosts agent: expected HOST COMMAND... (as a launcher calls ssh)")
    return exec_in(cluster, words[0], ["sh", "-c", " ".join(words[1:])])


def _print(made: simulated.SimulatedHosts) -> None:
    print(f"cluster {made.cluster}: bridge {made.bridge}, subnet {made.subnet}")
    rows = [(h.name, h.address, _cpus(h), h.netns, h.holder, len(h.started())) for h in made.hosts]
    print(render(("HOST", "ADDRESS", "CPUS", "NETNS", "HOLDER PID", "PROCESSES"), rows))


def _cpus(host: simulated.Host) -> str:
    return ",".join(map(str, host.cpus)) or "all"
