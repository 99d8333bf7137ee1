"""Simulated hosts on this machine, for tests and by hand (``shardline hosts up 2`` /
``shardline hosts down``).

Each host has what a real host has of its own: its share of the machine's CPUs (an
affinity mask), a network namespace with one interface
(``eth0``) and an address on a bridge between the hosts (a private /24 that exists only
inside this machine), its own hostname (a UTS namespace) and its own ``/dev/shm`` (a mount
namespace with a tmpfs there, an ``/etc/hosts`` naming every host and an ``/etc/resolv.conf``
that sends no query off the host). A small process
holds the namespaces; :meth:`Host.command` runs a command inside them (``nsenter``). Taking
the hosts down kills every process in them and removes their namespaces, interfaces and the
bridge. Traffic stays on the bridge: the hosts have no route anywhere else.

Needs root and the ``ip``, ``unshare`` and ``nsenter`` commands (:func:`unavailable_reason`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from shardline.errors import HostsError

#: Where ``shardline hosts`` keeps what it made, so that ``down`` can find it.
STATE_DIR = Path("/run/shardline-hosts")
#: The port of torchrun's static rendezvous on the first host (in that host's own network).
TORCHRUN_PORT = 29500
#: The most hosts one cluster may have (one /24, a process and a veth pair each).
MAX_HOSTS = 64
_COMMANDS = ("ip", "unshare", "nsenter", "taskset")


def clusters() -> list[str]:
    """The clusters ``SimulatedHosts.up`` made that are not down yet (by their saved state)."""
    if not STATE_DIR.is_dir():
        return []
    return sorted(path.stem for path in STATE_DIR.glob("*.json"))


def unavailable_reason() -> str | None:
    """Why simulated hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, a bridge, mounts)"
    missing = [command for command in _COMMANDS if shutil.which(command) is None]
    if missing:
        return f"simulated hosts need the commands {', '.join(missing)} (iproute2, util-linux)"
    return None


@dataclass(frozen=True)
class Host:
    """One simulated host: its hostname, network namespace, address on the bridge, and the
    pids of the processes that keep it (``holder`` holds its UTS and mount namespaces)."""

    name: str
    netns: str
    address: str
    holder: int
    keepers: tuple[int, ...] = ()
    cpus: tuple[int, ...] = ()
    link: str = ""

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (its network, hostname and mounts, on its CPUs)."""
        enter = ["nsenter", f"--target={self.holder}", "--net", "--uts", "--mount", "--", *argv]
        if not self.cpus:
            return enter
        return ["taskset", "--cpu-list", ",".join(map(str, self.cpus)), *enter]

    def processes(self) -> list[int]:
        """Every process whose network is this host's, its keepers included."""
        listed = subprocess.run(
            ["ip", "netns", "pids", self.netns], capture_output=True, text=True, check=False
        )
        return [int(pid) for pid in listed.stdout.split()]

    def started(self) -> list[int]:
        """The processes started in this host (all but its keepers)."""
        return [pid for pid in self.processes() if pid not in self.keepers]


@dataclass(frozen=True)
class SimulatedHosts:
    """``hosts`` on the bridge ``bridge`` of subnet ``subnet``; ``cluster`` names them all
    (it prefixes every namespace and interface). Make them with :meth:`up`; :meth:`down`
    removes everything (idempotent); also a context manager."""

    cluster: str
    bridge: str
    subnet: str
    hosts: tuple[Host, ...]
    folder: str

    @classmethod
    def up(cls, count: int, cluster: str | None = None, share_cpus: bool = False) -> SimulatedHosts:
        """Make ``count`` hosts ``h1 .. hN``, each with its own share of this machine's CPUs
        (as a real host has its own cores: what runs in it sees only those; hosts share CPUs
        only when there are more hosts than CPUs), or, with ``share_cpus``, all of them.
        Raises HostsError where it cannot."""
        reason = unavailable_reason()
        if reason is not None:
            raise HostsError(reason)
        if not 1 <= count <= MAX_HOSTS:
            raise ValueError(f"hosts: {count}; allowed: 1..{MAX_HOSTS}")
        cluster = cluster or secrets.token_hex(2)
        subnet = _free_subnet()
        prefix = f"sl{cluster}"
        folder = tempfile.mkdtemp(prefix=f"shardline-hosts-{cluster}-")
        made = cls(cluster, f"{prefix}br", str(subnet), (), folder)
        try:
            _run("ip", "link", "add", made.bridge, "type", "bridge")
            _run("ip", "link", "set", made.bridge, "up")
            addresses = [str(subnet.network_address + 10 + i) for i in range(1, count + 1)]
            names = [f"h{i}" for i in range(1, count + 1)]
            _write_name_files(folder, zip(addresses, names, strict=True))
            shares = _cpu_shares(count) if not share_cpus else [()] * count
            hosts = []
            for index, (name, address) in enumerate(zip(names, addresses, strict=True), 1):
                netns = f"{prefix}{name}"
                made = _replace_hosts(made, hosts)  # so that a failure removes what exists
                _add_interface(made.bridge, netns, f"{prefix}v{index}", address, subnet)
                holder = _hold(netns, name, folder)
                keepers = (holder, *[pid for pid in Host(name, netns, address, holder).processes()])
                keeping = tuple(sorted(set(keepers)))
                link = f"{prefix}v{index}"
                hosts.append(Host(name, netns, address, holder, keeping, shares[index - 1], link))
            made = _replace_hosts(made, hosts)
            made.save()
            return made
        except BaseException:
            made.down()
            raise

    def host(self, name: str) -> Host:
        return next(host for host in self.hosts if host.name == name)

    def set_link(self, name: str, up: bool) -> None:
        """Plug host ``name``'s cable into the bridge, or pull it (its interface stays up
        inside the host: packets are simply lost, as when a switch port dies)."""
        _run("ip", "link", "set", self.host(name).link, "up" if up else "down")

    def signal_host(self, name: str, signum: int) -> list[int]:
        """Send ``signum`` to every process started in host ``name``; their pids."""
        pids = self.host(name).started()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        return pids

    def torchrun(self, hosts: int, per_host: int, program: Sequence[str]) -> list[list[str]]:
        """One command per host for a world of ``per_host`` ranks on each of the first
        ``hosts`` hosts: a torchrun agent inside the host (static rendezvous on the first
        host's address, so host ``i`` holds ranks ``i * per_host ...``) running ``program``
        (a script or ``-m module`` and its arguments). Start them all at once."""
        first = self.hosts[0].address
        return [
            host.command(
                [
                    sys.executable, "-m", "torch.distributed.run",
                    f"--nnodes={hosts}", f"--nproc-per-node={per_host}", f"--node-rank={node}",
                    f"--master-addr={first}", f"--master-port={TORCHRUN_PORT}",
                    f"--local-addr={host.address}", *program,
                ]
            )
            for node, host in enumerate(self.hosts[:hosts])
        ]  # fmt: skip

    def mpiexec(self, hosts: int, per_host: int, argv: Sequence[str]) -> list[str]:
        """The command (started from the first host) of an OpenMPI job of ``per_host``
        ranks on each of the first ``hosts`` hosts, each running ``argv``."""
        placement = ",".join(f"{host.name}:{per_host}" for host in self.hosts[:hosts])
        mpiexec = str(Path(sys.executable).with_name("mpiexec"))
        command = [mpiexec, "--host", placement, "-n", str(hosts * per_host)]
        return self.hosts[0].command([*command, *self.mpiexec_options(), *argv])

    def mpiexec_options(self) -> list[str]:
        """OpenMPI ``mpiexec`` options for a job over these hosts, started in one of them:
        daemons reach the other hosts through ``shardline hosts agent`` (no ssh), and MPI's
        and the daemons' TCP stays on the bridge's subnet."""
        agent = f"{sys.executable} -m shardline.cli.main hosts agent {self.cluster}"
        return [
            "--mca", "plm_rsh_agent", agent,
            "--mca", "btl_tcp_if_include", self.subnet,
            "--mca", "oob_tcp_if_include", self.subnet,
            # Simulated hosts share one kernel: a packet between them is delivered by the
            # sender CPU's softirq thread, which a rank busy-polling for its reply starves
            # until the next scheduler tick (4 ms here, per message). Idle ranks yield.
            "--mca", "mpi_yield_when_idle", "1",
        ]  # fmt: skip

    def save(self) -> Path:
        """Write the state ``shardline hosts down`` reads."""
        STATE_DIR.mkdir(mode=0o700, exist_ok=True)
        path = STATE_DIR / f"{self.cluster}.json"
        path.write_text(json.dumps(asdict(self)))
        return path

    @classmethod
    def load(cls, cluster: str) -> SimulatedHosts:
        data = json.loads((STATE_DIR / f"{cluster}.json").read_text())
        return cls(
            data["cluster"],
            data["bridge"],
            data["subnet"],
            tuple(
                Host(
                    **{
                        **host,
                        "keepers": tuple(host["keepers"]),
                        "cpus": tuple(host.get("cpus", ())),
                    }
                )
                for host in data["hosts"]
            ),
            data["folder"],
        )

    def down(self) -> None:
        """Kill every process in the hosts, remove their namespaces, interfaces, the bridge
        and the state. Idempotent."""
        for host in self.hosts:
            for pid in {*host.processes(), host.holder}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for host in self.hosts:
            _wait_dead([*host.processes(), host.holder])
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, check=False)
        prefix = f"sl{self.cluster}"
        for name in _links(prefix):
            subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)
        for netns in _namespaces(prefix):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
        shutil.rmtree(self.folder, ignore_errors=True)
        (STATE_DIR / f"{self.cluster}.json").unlink(missing_ok=True)

    def take_down(self, name: str) -> SimulatedHosts:
        """Take host ``name`` down as a machine fails: kill every process in it, remove its
        namespaces and its cable; the others stay up. Returns (and saves) the hosts left."""
        host = self.host(name)
        for pid in {*host.processes(), host.holder}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait_dead([*host.processes(), host.holder])
        subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", host.link], capture_output=True, check=False)
        left = _replace_hosts(self, [other for other in self.hosts if other.name != name])
        left.save()
        return left

    def __enter__(self) -> SimulatedHosts:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.down()


def _cpu_shares(count: int) -> list[tuple[int, ...]]:
    """``count`` disjoint runs of this process's CPUs, as even as they can be; with more
    hosts than CPUs, one CPU each, round robin."""
    cpus = sorted(os.sched_getaffinity(0))
    if count > len(cpus):
        return [(cpus[index % len(cpus)],) for index in range(count)]
    size, extra = divmod(len(cpus), count)
    shares, start = [], 0
    for index in range(count):
        end = start + size + (1 if index < extra else 0)
        shares.append(tuple(cpus[start:end]))
        start = end
    return shares


def _replace_hosts(made: SimulatedHosts, hosts: list[Host]) -> SimulatedHosts:
    return SimulatedHosts(made.cluster, made.bridge, made.subnet, tuple(hosts), made.folder)


def _add_interface(
    bridge: str, netns: str, veth: str, address: str, subnet: ipaddress.IPv4Network
) -> None:
    _run("ip", "netns", "add", netns)
    _run("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
    _run("ip", "link", "set", veth, "master", bridge)
    _run("ip", "link", "set", veth, "up")
    _run("ip", "link", "set", f"{veth}p", "netns", netns)
    _run("ip", "-n", netns, "link", "set", f"{veth}p", "name", "eth0")
    _run("ip", "-n", netns, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", "eth0")
    _run("ip", "-n", netns, "link", "set", "eth0", "up")
    _run("ip", "-n", netns, "link", "set", "lo", "up")


def _write_name_files(folder: str, hosts: Iterable[tuple[str, str]]) -> None:
    """The hosts' /etc/hosts (every host's name, also for IPv4-mapped IPv6 addresses, which
    dual-stack sockets report) and /etc/resolv.conf (a name server on loopback only, where
    none listens: a name not in /etc/hosts fails at once and no query leaves the host)."""
    lines = ["127.0.0.1 localhost", "::1 localhost", "::ffff:127.0.0.1 localhost"]
    for address, name in hosts:
        lines += [f"{address} {name}", f"::ffff:{address} {name}"]
    Path(folder, "hosts").write_text("\n".join(lines) + "\n")
    Path(folder, "resolv.conf").write_text("nameserver 127.0.0.1\n")


def _hold(netns: str, hostname: str, folder: str) -> int:
    """Start the process that holds the host's UTS and mount namespaces (hostname, its own
    /dev/shm, /etc/hosts and /etc/resolv.conf); its pid."""
    script = (
        f"hostname {hostname} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "
        f"mount --bind {folder}/hosts /etc/hosts && "
        f"mount --bind {folder}/resolv.conf /etc/resolv.conf && echo $$ && exec sleep infinity"
    )
    holder = subprocess.Popen(
        [
            "ip", "netns", "exec", netns,
            "unshare", "--uts", "--mount", "--propagation", "private", "--fork",
            "sh", "-c", script,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )  # fmt: skip
    line = holder.stdout.readline().strip()
    if not line.isdigit():
        holder.kill()
        raise HostsError(
            f"host {hostname}: its namespaces could not be made: {holder.stderr.read()}"
        )
    return int(line)


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 no route or address of this machine touches."""
    used = subprocess.run(
        ["ip", "-o", "-4", "route", "show", "table", "all"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    taken = []
    for line in used.splitlines():
        with contextlib.suppress(ValueError):
            taken.append(ipaddress.ip_network(line.split()[0].replace("local", ""), strict=False))
    for _ in range(100):
        candidate = ipaddress.ip_network(
            f"10.{random.randint(200, 250)}.{random.randint(0, 255)}.0/24"
        )
        if not any(candidate.overlaps(network) for network in taken if network.prefixlen):
            return candidate
    raise HostsError("no free 10.x.y.0/24 for the simulated hosts")


def _links(prefix: str) -> list[str]:
    listed = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = [line.split(": ")[1].split("@")[0] for line in listed.splitlines() if ": " in line]
    return [name for name in names if name.startswith(prefix)]


def _namespaces(prefix: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]


def _wait_dead(pids: list[int], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and not _zombie(pid)]
        if not alive:
            return
        time.sleep(0.02)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise HostsError(f"{' '.join(argv)}: {done.stderr.strip()}")
