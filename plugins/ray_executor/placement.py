"""Where the ranks of a Ray world run: which node each rank is on, and its rank number there.

Pure functions over what Ray reports, so the rules can be tested without a cluster. The
placement group has one bundle per node (``parallel.nnodes`` bundles, strictly spread over
distinct nodes), and each bundle holds the ``world_size / nnodes`` ranks of its node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Logical CPUs each rank's actor reserves in its bundle. Ray only accounts for them: a rank
#: uses its share of its host's cores (``share_cores``), and a small reservation keeps a node's
#: declared CPU count from capping how many ranks it can hold.
RANK_CPUS = 0.1


@dataclass(frozen=True)
class Node:
    """A Ray node as the placement group reports it: its id, address and host name."""

    node_id: str
    address: str
    hostname: str


@dataclass(frozen=True)
class RankPlace:
    """Where rank ``rank`` runs: the placement-group ``bundle`` on ``node``, ``local_rank``
    among the ``ranks_on_node`` ranks there."""

    rank: int
    bundle: int
    node: Node
    local_rank: int
    ranks_on_node: int


def bundles(world_size: int, nnodes: int) -> tuple[list[dict[str, float]], str]:
    """The placement group's bundles (one per node, with the CPUs of that node's ranks) and
    its strategy. Raises ValueError when ``nnodes`` does not divide ``world_size``."""
    if nnodes < 1 or world_size % nnodes:
        raise ValueError(
            f"parallel.nnodes = {nnodes} must divide the world's {world_size} ranks "
            "(every node holds as many ranks)"
        )
    ranks_per_node = world_size // nnodes
    strategy = "STRICT_SPREAD" if nnodes > 1 else "PACK"
    return [{"CPU": RANK_CPUS * ranks_per_node}] * nnodes, strategy


def place_ranks(bundle_nodes: Sequence[Node], driver_node: str, world_size: int) -> list[RankPlace]:
    """Number the ranks node by node: the driver's node first (when a bundle is there), the
    others by address. Consecutive ranks share a node, so tensor-parallel groups (consecutive
    ranks) stay inside a node whenever the tensor-parallel size divides the ranks per node;
    pipeline stages then cross nodes. ``bundle_nodes[b]`` is the node bundle ``b`` was placed
    on."""
    per_node, left = divmod(world_size, len(bundle_nodes))
    if left:
        raise ValueError(f"{len(bundle_nodes)} bundles cannot hold {world_size} ranks evenly")
    order = sorted(
        range(len(bundle_nodes)),
        key=lambda b: (bundle_nodes[b].node_id != driver_node, bundle_nodes[b].address, b),
    )
    return [
        RankPlace(rank, bundle, bundle_nodes[bundle], rank % per_node, per_node)
        for rank, bundle in enumerate(b for b in order for _ in range(per_node))
    ]


def all_on(places: Sequence[RankPlace], node_id: str) -> bool:
    """Whether every rank runs on node ``node_id`` (the rendezvous can then stay on loopback)."""
    return all(place.node.node_id == node_id for place in places)
