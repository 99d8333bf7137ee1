"""What the Ray executor asks of Ray: one world's ranks as actors in a placement group on the
cluster, their tasks, and their ends. The only module of the executor that imports ``ray``
(an optional dependency: :mod:`shardline_ray.executor` imports this one when it starts)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shardline.errors import CommTimeoutError, PeerLostError, cut
from shardline.interfaces import Rendezvous
from shardline.sdk import EngineConfig, loaded_reply
from shardline_ray import placement, session
from shardline_ray.actor import CONTROL_GROUP, CONTROL_THREADS, RankActor
from shardline_ray.placement import Node, RankPlace
from shardline_ray.protocol import Died, Failure

#: Arguments larger than this are put in Ray's object store once for every rank (Ray inlines
#: smaller ones in each task).
_INLINE_BYTES = 100 * 1024
#: How long shutdown waits for the ranks' processes to be killed (an actor on a node that died
#: never answers; Ray takes longer to tell).
_GONE_S = 5.0


@dataclass(frozen=True)
class Lost:
    """A rank's actor is gone (its process or node died, or it was killed): Ray's reason."""

    reason: str


class RayRanks:
    """The actors of one world's ranks: placed (:meth:`place`), started (:meth:`start`),
    called (:meth:`broadcast`, :meth:`receive`, :meth:`wait`, :meth:`message`), watched
    (:attr:`watches`) and stopped (:meth:`stop`, idempotent, also after a failed start)."""

    def __init__(self, environ: Mapping[str, str], world_size: int) -> None:
        self.connection = session.connect(environ, world_size)
        self.world_size = world_size
        self.places: list[RankPlace] = []
        self.actors: list[Any] = []
        #: One task per rank that ends when the rank's process ends (or its actor dies).
        self.watches: list[Any] = []
        self._group = None
        self._stopped = False

    # ---- start -------------------------------------------------------------------------------

    def place(self, nnodes: int, timeout_s: float) -> None:
        """Reserve one bundle per node and number the ranks (:mod:`.placement`). Raises
        CommTimeoutError when Ray cannot place the bundles within ``timeout_s``."""
        specs, strategy = placement.bundles(self.world_size, nnodes)
        self._group = placement_group(specs, strategy=strategy)
        ready, _ = ray.wait([self._group.ready()], timeout=timeout_s)
        if not ready:
            raise CommTimeoutError(
                f"start-up: Ray did not place {nnodes} bundle(s) of {specs[0]['CPU']:g} CPU "
                f"({strategy}: one per node, for {self.world_size // nnodes} rank(s) each) "
                f"within {timeout_s:g} s (parallel.startup_timeout_s); the cluster's live nodes "
                f"and free CPUs: {_free_cpus()}. Give parallel.nnodes the nodes there are, or "
                "add nodes (ray start --address ...)",
                op="placement",
            )
        nodes = {node.node_id: node for node in _live_nodes()}
        table = placement_group_table(self._group)["bundles_to_node_id"]
        bundle_nodes = [nodes[table[bundle]] for bundle in range(len(specs))]
        self.places = placement.place_ranks(bundle_nodes, self.driver_node, self.world_size)

    @property
    def driver_node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def rendezvous_host(self) -> str:
        """Where the driver serves the store: loopback when every rank is on its node, else
        the address Ray knows the driver's node by (which the other nodes reach)."""
        driver = self.driver_node
        if placement.all_on(self.places, driver):
            return "127.0.0.1"
        return next(node.address for node in _live_nodes() if node.node_id == driver)

    def start(self, config: EngineConfig, rendezvous: Rendezvous) -> None:
        """Create one actor per rank in its node's bundle, given its place (rank, local rank,
        ranks on its node); each starts its rank's process. The rendezvous (with the job's
        secret) travels as the actors' creation argument."""
        actor_class = ray.remote(
            num_cpus=placement.RANK_CPUS,
            concurrency_groups={CONTROL_GROUP: CONTROL_THREADS},
            max_restarts=0,
        )(RankActor)
        for place in self.places:
            actor = actor_class.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=place.bundle
                )
            ).remote(place, self.world_size, config, rendezvous)
            self.actors.append(actor)
            self.watches.append(actor.watch.options(concurrency_group=CONTROL_GROUP).remote())

    # ---- tasks -------------------------------------------------------------------------------

    def broadcast(self, message: bytes) -> list[Any]:
        """One ``call`` task per rank carrying ``message``: the tasks' references, by rank."""
        argument = ray.put(message) if len(message) > _INLINE_BYTES else message
        return [actor.call.remote(argument) for actor in self.actors]

    def receive(self) -> list[Any]:
        """One ``receive`` task per rank (the rank's next start-up message)."""
        return [actor.receive.remote() for actor in self.actors]

    @staticmethod
    def wait(refs: Sequence[Any], timeout_s: float) -> list[Any]:
        """Those of ``refs`` done within ``timeout_s`` (at least one, unless none is)."""
        if not refs:
            return []
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=max(0.0, timeout_s))
        return ready

    @staticmethod
    def message(ref: Any) -> Any:
        """What a done task says: the rank's message (a reply this process cannot load: the
        ``Failure`` of its call), ``Died``, or ``Lost`` when the actor itself is gone."""
        try:
            data = ray.get(ref)
        except ray.exceptions.RayActorError as error:
            return Lost(_reason(error))
        except ray.exceptions.RayError as error:
            return Lost(f"{type(error).__name__}: {_reason(error)}")
        return loaded_reply(data, failed=lambda failure: Failure("call", failure))

    def where(self, ranks: Sequence[int]) -> str:
        """`` on host h2`` (``on hosts h1, h2``) for ``ranks`` when the world spans hosts, else
        ``""``."""
        if len({place.node.hostname for place in self.places}) < 2:
            return ""
        hosts = sorted({self.places[rank].node.hostname for rank in ranks})
        return f" on host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)}"

    def lost_error(self, rank: int, message: Died | Lost, op: str) -> PeerLostError:
        """The error of a rank whose process ended or whose actor is gone."""
        where = f"host {self.places[rank].node.hostname}" if self.places else "its host"
        if isinstance(message, Died):
            text = (
                f"worker rank {rank} (pid {message.pid} on {where}) died with exit code "
                f"{message.exitcode}"
            )
        else:
            text = f"worker rank {rank} on {where}: its Ray actor is gone: {message.reason}"
        return PeerLostError(text, op=op, rank=rank)

    # ---- stop --------------------------------------------------------------------------------

    def stop(self, grace_s: float) -> None:
        """Ask the ranks to leave (after the calls before them; ``grace_s`` 0: not at all),
        then kill every rank process still running and wait for it (at most :data:`_GONE_S`),
        kill the actors (Ray ends their processes soon after), remove the placement group and
        release the Ray connection. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if grace_s > 0 and self.actors:
                _wait_all([actor.stop.remote(grace_s) for actor in self.actors], grace_s + 1.0)
            control = {"concurrency_group": CONTROL_GROUP}
            _wait_all([actor.kill.options(**control).remote() for actor in self.actors], _GONE_S)
            for actor in self.actors:
                ray.kill(actor)
            if self._group is not None:
                remove_placement_group(self._group)
        finally:
            self.actors.clear()
            self.watches.clear()
            self.connection.release()


def _wait_all(refs: list[Any], timeout_s: float) -> None:
    """Wait until every task of ``refs`` is done, at most ``timeout_s``."""
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)


def _live_nodes() -> list[Node]:
    return [
        Node(node["NodeID"], node["NodeManagerAddress"], node["NodeManagerHostname"])
        for node in ray.nodes()
        if node["Alive"]
    ]


def _free_cpus() -> str:
    free = ray.available_resources()
    nodes = ", ".join(f"{node.hostname} ({node.address})" for node in _live_nodes())
    return f"{nodes or 'none'}; {free.get('CPU', 0):g} CPU free in all"


def _reason(error: Exception) -> str:
    """Ray's explanation, in one line: the sentence that says why, where there is one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    why = next((line for line in lines if "because" in line), lines[0] if lines else "")
    return cut(why, 300)
