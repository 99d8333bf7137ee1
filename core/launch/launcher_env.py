"""A rank's place in a world a launcher started (torchrun, mpiexec), read from the
launcher's environment variables."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from shardline.errors import ConfigError


@dataclass(frozen=True)
class _Launcher:
    """A launcher's variables: ``marker`` shows it started this process; the others give the
    rank, world size, local rank and ranks on this host."""

    name: str
    marker: str
    rank: str
    size: str
    local_rank: str
    local_size: str


#: Known launchers, tried in order.
_LAUNCHERS = (
    _Launcher(
        "torchrun", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"
    ),
    _Launcher(
        "mpiexec (OpenMPI)",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    _Launcher(
        "mpiexec (MPICH/PMI)",
        "PMI_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
    ),
)


def detect_launcher(environ: Mapping[str, str]) -> str | None:
    """The launcher that started this process (``"torchrun"``, ``"mpiexec (OpenMPI)"``, ...)."""
    for launcher in _LAUNCHERS:
        if launcher.marker in environ:
            return launcher.name
    return None


@dataclass(frozen=True)
class LaunchedRank:
    """This process's rank as its launcher assigned it.

    ``master_addr``/``master_port`` name the rendezvous store (torchrun always sets them;
    under mpiexec they are optional, see :func:`meet`). ``agent_store`` is True when the
    launcher already serves the store there (torchrun's c10d agent), so no rank serves one.
    ``job_secret`` is derived from ``SHARDLINE_JOB_SECRET`` when set (every rank must have
    the same value); None lets the ranks agree on a random one (see :func:`meet`).
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
    job_secret: bytes | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> LaunchedRank:
        """Parse the launcher variables; ``ConfigError`` names the variable and its value."""
        for candidate in _LAUNCHERS:
            if candidate.rank not in environ or candidate.size not in environ:
                continue
            launcher, size_var = candidate.name, candidate.size
            world_size = _integer(environ, size_var, minimum=1)
            rank = _integer(environ, candidate.rank, minimum=0, below=world_size, limit=size_var)
            local_rank = _integer(environ, candidate.local_rank, minimum=0, default=rank)
            local_world_size = _integer(
                environ, candidate.local_size, minimum=1, default=world_size
            )
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
                job_secret=_job_secret(environ),
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


def _job_secret(environ: Mapping[str, str]) -> bytes | None:
    value = environ.get("SHARDLINE_JOB_SECRET")
    if value is None:
        return None
    if len(value) < 16:
        raise ConfigError(
            f"environment SHARDLINE_JOB_SECRET has {len(value)} characters; allowed: at least "
            "16 (e.g. `export SHARDLINE_JOB_SECRET=$(openssl rand -hex 32)`)",
            field="SHARDLINE_JOB_SECRET",
        )
    return hashlib.sha256(value.encode()).digest()


def local_rank(rank: int, environ: Mapping[str, str] = os.environ) -> int:
    """This process's rank on its host: the launcher's local rank (torchrun, mpiexec), or,
    with no launcher, ``rank`` itself (every rank of the world on this host)."""
    try:
        return LaunchedRank.from_environ(environ).local_rank
    except ConfigError:
        return rank
