"""The usual LocalWorld setup: each rank joins one communicator backend's world."""

from __future__ import annotations

from dataclasses import dataclass

from shardline.interfaces import Communicator
from shardline.interfaces.communicator_backend import Rendezvous
from shardline.registry import Registry


@dataclass
class RankContext:
    """What a rank of a communicator world holds: its rank, the world communicator, and the
    registry it was resolved from."""

    rank: int
    world_size: int
    comm: Communicator
    registry: Registry
    rendezvous: Rendezvous
    timeout_s: float

    def close(self) -> None:
        self.comm.close()


@dataclass(frozen=True)
class CommunicatorSetup:
    """Join the world of communicator ``backend`` (a registered name or
    ``package.module:Class``) with deadline ``timeout_s``. ``allow_plugins`` is the plugin
    allow-list, honoured in the rank process as in the parent."""

    backend: str
    timeout_s: float
    allow_plugins: tuple[str, ...] | None = None

    def __call__(self, rank: int, world_size: int, rendezvous: Rendezvous) -> RankContext:
        registry = Registry.load(allow=self.allow_plugins)
        backend = registry.get("communicator", self.backend).load()()
        comm = backend.init_world(rank, world_size, rendezvous, self.timeout_s)
        return RankContext(rank, world_size, comm, registry, rendezvous, self.timeout_s)
