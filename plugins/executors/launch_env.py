"""Reading a rank's place in the world from its launcher's environment (torchrun, mpiexec),
and meeting the other ranks at a rendezvous store."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardline.comm.store import serve_store
from shardline.errors import CommTimeoutError, ConfigError
from shardline.interfaces.communicator_backend import Rendezvous

#: (launcher, rank, world size, local rank, ranks on this host) variables, tried in order.
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    (
        "mpiexec (OpenMPI)",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("mpiexec (MPICH/PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


@dataclass(frozen=True)
class LaunchedRank:
    """This process's rank as its launcher assigned it.

    ``master_addr``/``master_port`` name the rendezvous store (torchrun always sets them;
    under mpiexec they are optional, see :func:`meet`). ``agent_store`` is True when the
    launcher already serves the store there (torchrun's c10d agent), so no rank serves one.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    agent_store: bool = False
    restart: int = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> LaunchedRank:
        """Parse the launcher variables; ``ConfigError`` names the variable and its value."""
        for launcher, rank_var, size_var, local_var, local_size_var in _LAUNCHERS:
            if rank_var not in environ or size_var not in environ:
                continue
            world_size = _integer(environ, size_var, minimum=1)
            rank = _integer(environ, rank_var, minimum=0, below=world_size, limit=size_var)
            local_rank = _integer(environ, local_var, minimum=0, default=rank)
            local_world_size = _integer(environ, local_size_var, minimum=1, default=world_size)
            port = environ.get("MASTER_PORT")
            master_port = _integer(environ, "MASTER_PORT", minimum=1) if port else None
            if launcher == "torchrun" and (master_port is None or not environ.get("MASTER_ADDR")):
                raise ConfigError(
                    "started by torchrun but MASTER_ADDR / MASTER_PORT are not both set "
                    f"(MASTER_ADDR = {environ.get('MASTER_ADDR')!r}, MASTER_PORT = {port!r}); "
                    "torchrun sets them: start the ranks with torchrun"
                )
            return cls(
                launcher=launcher,
                rank=rank,
                world_size=world_size,
                local_rank=local_rank,
                local_world_size=local_world_size,
                master_addr=environ.get("MASTER_ADDR") or None,
                master_port=master_port,
                agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
                restart=_integer(environ, "TORCHELASTIC_RESTART_COUNT", minimum=0, default=0),
            )
        raise ConfigError(
            "parallel.distributed_executor_backend = 'external_launcher' needs a process "
            "started by a launcher, but none of RANK/WORLD_SIZE (torchrun), "
            "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE (OpenMPI mpiexec) or PMI_RANK/PMI_SIZE "
            "(MPICH mpiexec) is set; allowed: start with torchrun or mpiexec, or use mp"
        )


def _integer(
    environ: Mapping[str, str],
    name: str,
    *,
    minimum: int,
    below: int | None = None,
    limit: str = "",
    default: int | None = None,
) -> int:
    raw = environ.get(name)
    if raw is None and default is not None:
        return default
    try:
        value = int(raw or "")
    except ValueError:
        value = None
    if value is None or value < minimum or (below is not None and value >= below):
        allowed = f"an integer >= {minimum}" + (
            f" and < {limit} ({below})" if below is not None else ""
        )
        raise ConfigError(f"environment {name} = {raw!r}: expected {allowed}", field=name)
    return value


@dataclass
class Meeting:
    """Where the ranks met: the rendezvous for their worlds, and the store this process
    serves (rank 0 when no launcher serves one), kept alive until :meth:`close`."""

    rendezvous: Rendezvous
    served_store: Any = None

    def close(self) -> None:
        self.served_store = None


def meet(launched: LaunchedRank, timeout_s: float) -> Meeting:
    """Agree on a rendezvous store with the other ranks.

    torchrun: its agent serves the store at MASTER_ADDR:MASTER_PORT, or (static rendezvous
    without an agent store) rank 0 serves it there. mpiexec: MASTER_ADDR/MASTER_PORT when
    given (``mpiexec -x MASTER_ADDR=... -x MASTER_PORT=...``); otherwise rank 0 serves a
    store on a port the OS chooses and MPI (mpi4py) tells every rank where it is.
    """
    prefix = f"shardline/{launched.restart}/"
    if launched.master_addr is not None and launched.master_port is not None:
        served = None
        if launched.rank == 0 and not launched.agent_store:
            served = _serve_at(launched.master_addr, launched.master_port, timeout_s)
        rendezvous = Rendezvous(launched.master_addr, launched.master_port, prefix)
        return Meeting(rendezvous, served)
    return _meet_through_mpi(launched, timeout_s, prefix)


def _serve_at(host: str, port: int, timeout_s: float) -> Any:
    try:
        store, _ = serve_store(host, timeout_s, port=port)
    except (RuntimeError, OSError) as error:
        raise ConfigError(
            f"environment MASTER_PORT = {port}: rank 0 cannot serve the rendezvous store at "
            f"{host}:{port} ({error}); allowed: a free port on this host",
            field="MASTER_PORT",
        ) from error
    return store


def _meet_through_mpi(launched: LaunchedRank, timeout_s: float, prefix: str) -> Meeting:
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise ConfigError(
            f"started by {launched.launcher} without MASTER_ADDR and MASTER_PORT, and mpi4py "
            f"is not installed ({error}); allowed: pass them (mpiexec -x MASTER_ADDR=host "
            "-x MASTER_PORT=port), or `pip install mpi4py` so rank 0 can share its address"
        ) from error
    world = MPI.COMM_WORLD
    if world.Get_size() != launched.world_size:
        raise ConfigError(
            f"MPI reports {world.Get_size()} ranks but the environment says "
            f"{launched.world_size}; allowed: one mpiexec job per Shardline world"
        )
    served, address = None, None
    if launched.rank == 0:
        single_host = launched.local_world_size == launched.world_size
        host = "127.0.0.1" if single_host else socket.gethostname()
        try:
            served, rendezvous = serve_store(host, timeout_s)
            address = (rendezvous.host, rendezvous.port)
        except (RuntimeError, OSError) as error:
            address = error
    address = world.bcast(address, root=0)
    if isinstance(address, BaseException):
        raise CommTimeoutError(f"rank 0 could not serve the rendezvous store: {address}")
    return Meeting(Rendezvous(address[0], address[1], prefix), served)
