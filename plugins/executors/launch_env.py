"""Meeting the other ranks of a launched world at a rendezvous store."""

from __future__ import annotations

import datetime
import itertools
import secrets
import socket
from dataclasses import dataclass
from typing import Any

from shardline.errors import CommTimeoutError, ConfigError
from shardline.interfaces import Rendezvous
from shardline.sdk import LaunchedRank, connect_store, serve_store


@dataclass
class Meeting:
    """Where the ranks met: the rendezvous for their worlds, and the store this process
    serves (rank 0 when no launcher serves one), kept alive until :meth:`close`."""

    rendezvous: Rendezvous
    served_store: Any = None

    def close(self) -> None:
        self.served_store = None


#: Worlds this process has joined through its launcher. Every rank creates its executors in
#: the same order, so the count names the same world in every process and keeps the store keys
#: of a later world (say, after a shutdown) apart from an earlier one's.
_joined_worlds = itertools.count()


def meet(launched: LaunchedRank, timeout_s: float) -> Meeting:
    """Agree on a rendezvous store with the other ranks.

    torchrun: its agent serves the store at MASTER_ADDR:MASTER_PORT, or (static rendezvous
    without an agent store) rank 0 serves it there. mpiexec: MASTER_ADDR/MASTER_PORT when
    given (``mpiexec -x MASTER_ADDR=... -x MASTER_PORT=...``); otherwise rank 0 serves a
    store on a port the OS chooses and MPI (mpi4py) tells every rank where it is.

    The job secret (which signs control-plane objects) is ``SHARDLINE_JOB_SECRET``'s when
    set; otherwise rank 0 makes one and shares it through MPI (mpiexec) or the store
    (torchrun), so whoever can read that store can read the secret.
    """
    prefix = f"shardline/{launched.restart}/{next(_joined_worlds)}/"
    if launched.master_addr is not None and launched.master_port is not None:
        served = None
        if launched.rank == 0 and not launched.agent_store:
            served = _serve_at(launched.master_addr, launched.master_port, timeout_s)
        rendezvous = Rendezvous(launched.master_addr, launched.master_port, prefix)
        secret = launched.job_secret or _share_through_store(launched, rendezvous, timeout_s)
        return Meeting(Rendezvous(rendezvous.host, rendezvous.port, prefix, secret), served)
    return _meet_through_mpi(launched, timeout_s, prefix)


def describe_meeting(launched: LaunchedRank) -> str:
    """Where :func:`meet` will have the ranks meet, and who can reach it (for ``explain``)."""
    if launched.master_addr is not None and launched.master_port is not None:
        where = f"{launched.master_addr}:{launched.master_port}"
        if launched.agent_store:
            return f"served by {launched.launcher}'s agent at {where}, as the launcher binds it"
        return (
            f"served by rank 0 at {where} (MASTER_ADDR / MASTER_PORT), listening on that "
            "address only"
        )
    if launched.local_world_size == launched.world_size:
        return "served by rank 0 on 127.0.0.1 (one host: loopback only)"
    return (
        "served by rank 0 on every interface of its host (ranks on several hosts and no "
        "MASTER_ADDR: reachable from other hosts; set MASTER_ADDR / MASTER_PORT to listen on "
        "one address)"
    )


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
    served, address, secret = None, None, launched.job_secret
    if launched.rank == 0:
        # One host: loopback only. Several: every interface (no address was configured),
        # reached at this host's name; `shardline explain` says so.
        single_host = launched.local_world_size == launched.world_size
        bind, advertised = ("127.0.0.1", None) if single_host else ("0.0.0.0", socket.gethostname())
        try:
            served, rendezvous = serve_store(bind, timeout_s, advertised_host=advertised)
            address = (rendezvous.host, rendezvous.port, secret or rendezvous.secret)
        except (RuntimeError, OSError) as error:
            address = error
    address = world.bcast(address, root=0)
    if isinstance(address, BaseException):
        raise CommTimeoutError(f"rank 0 could not serve the rendezvous store: {address}")
    host, port, shared_secret = address
    return Meeting(Rendezvous(host, port, prefix, secret or shared_secret), served)


def _share_through_store(launched: LaunchedRank, rendezvous: Rendezvous, timeout_s: float) -> bytes:
    """A random job secret made by rank 0 and read by the others from the store."""
    store = connect_store(rendezvous, timeout_s)
    if launched.rank == 0:
        store.set("job-secret", secrets.token_bytes(32))
    try:
        store.wait(["job-secret"], datetime.timedelta(seconds=timeout_s))
    except RuntimeError as error:
        raise CommTimeoutError(
            f"rank {launched.rank}: rank 0 did not publish the job secret within {timeout_s:g} s",
            op="rendezvous",
        ) from error
    return bytes(store.get("job-secret"))
