"""How a plugin hands Shardline a communicator: the CommunicatorBackend contract."""

from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass, field, replace

from shardline.interfaces.capabilities import Capabilities
from shardline.interfaces.communicator import Communicator


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one world meet: a TCP key-value store (torch ``TCPStore``) served at
    ``host:port``. ``prefix`` separates worlds or backends sharing one store.

    Backends that bring their own rendezvous (MPI under ``mpiexec``) may ignore it.
    ``secret`` is the job's shared secret: control-plane objects are signed with it, and
    bytes that fail the check are never unpickled (by :class:`shardline.sdk.ControlPlane`).
    ``join_timeout_s``: how long joining the world, and every group later made from it, waits
    for all its ranks to arrive (see :meth:`join_timeout`); operations keep the world's
    deadline. Ranks reach a join at different times while they start, so the framework sets
    what its start-up phase (``parallel.startup_timeout_s``) leaves here.
    """

    host: str
    port: int
    prefix: str = ""
    secret: bytes = field(default=b"", repr=False)
    join_timeout_s: float | None = None

    @property
    def job(self) -> str:
        """A short name of the job, the same in every rank and revealing nothing of the
        secret it is derived from. Host-wide resources a job creates carry it (shared-memory
        segments are named ``shardline-<job>-...``), so that leak checks and clean-up can
        tell the job's own from another job's."""
        return hashlib.sha256(b"shardline job " + self.secret).hexdigest()[:12]

    def with_prefix(self, prefix: str) -> Rendezvous:
        """The same store, secret and join deadline, with ``prefix`` appended to this one's."""
        return replace(self, prefix=f"{self.prefix}{prefix}/")

    def join_timeout(self, timeout_s: float) -> float:
        """How long a join waits for every rank: ``join_timeout_s``, or the world's deadline
        ``timeout_s`` where it is unset."""
        return timeout_s if self.join_timeout_s is None else self.join_timeout_s


class CommunicatorBackend(abc.ABC):
    """A communicator implementation, as registered by a plugin.

    ``name`` and ``capabilities`` are class attributes: they are read at config validation,
    without starting anything.
    """

    name: str
    capabilities: Capabilities

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run in this environment (missing library, device), or None.
        Must be cheap and must not start any process or communication."""
        return None

    @classmethod
    def all_reduce_route(cls, hosts: int) -> str:
        """What carries an all-reduce of a group whose ranks are on ``hosts`` hosts, in a few
        words (``shardline explain`` shows it per group). A backend that serves some groups
        itself and hands others to another backend says which. Nothing is started."""
        return cls.name

    @abc.abstractmethod
    def init_world(
        self, rank: int, world_size: int, rendezvous: Rendezvous, timeout_s: float
    ) -> Communicator:
        """Join the world of ``world_size`` ranks as ``rank`` and return its communicator.

        Called by every rank, once per world it joins: a process joins two worlds (data and
        control plane), so a backend selected for both planes is called twice, with two
        rendezvous of different ``prefix``; keep worlds apart by it. Joining, and joining each
        group later made with ``new_group``, ends by ``rendezvous.join_timeout(timeout_s)``
        with :class:`~shardline.errors.CommTimeoutError` naming the ranks that never arrived
        (``shardline.sdk.announce_arrival`` / ``never_arrived``); operations end by
        ``timeout_s``.
        """
