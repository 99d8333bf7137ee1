"""LocalWorld setups: each rank joins one communicator world, or a data-plane and a
control-plane world with its ParallelState on top."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shardline.comm.host_directory import HostDirectory
from shardline.comm.watchdog import SideChannel, WatchedCommunicator
from shardline.config.schema import EngineConfig
from shardline.distributed import ParallelState
from shardline.distributed.control_plane import ControlPlane
from shardline.interfaces import Communicator
from shardline.interfaces.communicator_backend import Rendezvous
from shardline.registry import Registry


@dataclass
class RankContext:
    """What a rank of a communicator world holds: its rank, the world communicator and a
    control plane over it (objects and tensor dicts signed with the job secret). ``held``:
    groups a call leaves open for a later call to close (a rank that stays silent in a group
    while its peers time out); closed with the context at the latest."""

    rank: int
    world_size: int
    comm: Communicator
    control: ControlPlane
    secret: bytes
    held: list[Communicator] = field(default_factory=list)

    def close_held(self) -> None:
        while self.held:
            self.held.pop().close()

    def close(self) -> None:
        self.close_held()
        self.comm.close()


@dataclass(frozen=True)
class CommunicatorSetup:
    """Join the world of communicator ``backend`` (a registered name or
    ``package.module:Class``) with deadline ``timeout_s``; joins wait ``join_timeout_s``
    (None: ``timeout_s``). ``allow_plugins`` is the plugin allow-list, honoured in the rank
    process as in the parent."""

    backend: str
    timeout_s: float
    allow_plugins: tuple[str, ...] | None = None
    join_timeout_s: float | None = None

    def __call__(self, rank: int, world_size: int, rendezvous: Rendezvous) -> RankContext:
        registry = Registry.load(allow=self.allow_plugins)
        backend = registry.get("communicator", self.backend).load_available()()
        rendezvous = replace(rendezvous, join_timeout_s=self.join_timeout_s)
        comm = backend.init_world(rank, world_size, rendezvous, self.timeout_s)
        # Object bytes travel on the CPU unless the backend moves device tensors only.
        device = "cpu" if "cpu" in comm.capabilities.devices else "cuda"
        control = ControlPlane(comm, rendezvous.secret, device)
        return RankContext(rank, world_size, comm, control, rendezvous.secret)


@dataclass
class ParallelRankContext:
    """A rank of a parallel world: its :class:`ParallelState` over a data-plane and a
    control-plane world communicator."""

    state: ParallelState
    data_world: Communicator
    control_world: Communicator

    def close(self) -> None:
        self.state.close()
        self.data_world.close()
        self.control_world.close()


@dataclass(frozen=True)
class ParallelSetup:
    """Join the data-plane and control-plane worlds named by ``config`` and build the rank's
    :class:`ParallelState` with the configured layout."""

    config: EngineConfig

    def __call__(self, rank: int, world_size: int, rendezvous: Rendezvous) -> ParallelRankContext:
        registry = Registry.for_plugins(self.config.plugins)
        return join_parallel_worlds(self.config, registry, rank, world_size, rendezvous)


def join_parallel_worlds(
    config: EngineConfig,
    registry: Registry,
    rank: int,
    world_size: int,
    rendezvous: Rendezvous,
    join_timeout_s: float | None = None,
) -> ParallelRankContext:
    """Join the configured data-plane and control-plane worlds as ``rank`` and build the
    rank's :class:`ParallelState`. Joining a world or group waits ``join_timeout_s`` for its
    ranks (None: ``parallel.timeout_s``); their operations end by ``parallel.timeout_s``."""
    parallel = config.parallel
    rendezvous = replace(rendezvous, join_timeout_s=join_timeout_s)
    data_backend = registry.get(
        "communicator", parallel.communicator, "parallel.communicator"
    ).load_available()()
    control_backend = registry.get(
        "communicator", parallel.control_communicator, "parallel.control_communicator"
    ).load_available()()
    data = data_backend.init_world(
        rank, world_size, rendezvous.with_prefix("data"), parallel.timeout_s
    )
    if parallel.watchdog:
        channel = SideChannel(rendezvous.with_prefix("watchdog"))
        # Every rank announced its host before joining (WorkerSetup): read it once, now.
        hosts = HostDirectory.read(rendezvous, world_size, parallel.timeout_s)
        data = WatchedCommunicator(data, channel, parallel.watchdog_check_every, hosts=hosts)
    control = control_backend.init_world(
        rank, world_size, rendezvous.with_prefix("control"), parallel.timeout_s
    )
    state = ParallelState.create(parallel.layout, data, control, rendezvous.secret)
    return ParallelRankContext(state, data, control)
