"""A rank's groups, built once from the layout and handed to whoever needs them."""

from __future__ import annotations

from dataclasses import dataclass

from shardline.comm.watchdog import WatchedCommunicator
from shardline.distributed.group import GroupCoordinator
from shardline.distributed.layout import ParallelLayout
from shardline.interfaces import Communicator


@dataclass
class ParallelState:
    """This rank's world, tensor-, pipeline- and data-parallel groups.

    An explicit object: layers take ``state.tp`` in their constructor, the Worker uses
    ``state.pp``. Nothing here is global; a test may hold several ranks' states at once.
    """

    layout: ParallelLayout
    rank: int
    world: GroupCoordinator
    tp: GroupCoordinator
    pp: GroupCoordinator
    dp: GroupCoordinator

    @classmethod
    def create(
        cls,
        layout: ParallelLayout,
        data_world: Communicator,
        control_world: Communicator,
        secret: bytes,
    ) -> ParallelState:
        """Build every group from the world communicators. Every rank of the world calls this
        (group creation is collective over the world): all TP groups, then PP, then DP.
        ``secret`` is the job's: every group's control plane signs objects with it."""
        if data_world.world_size != layout.world_size:
            raise ValueError(
                f"the layout needs {layout.world_size} ranks "
                f"(tp={layout.tensor_parallel_size} x pp={layout.pipeline_parallel_size} x "
                f"dp={layout.data_parallel_size} x "
                f"external dp={layout.external_data_parallel_size}) "
                f"but the world has {data_world.world_size}"
            )
        rank = data_world.rank
        world = GroupCoordinator(
            "world", list(range(layout.world_size)), data_world, control_world, secret
        )
        mine: dict[str, GroupCoordinator] = {}
        for axis, groups in (
            ("tp", layout.tp_groups()),
            ("pp", layout.pp_groups()),
            ("dp", layout.dp_groups()),
        ):
            for ranks in groups:
                data = data_world.new_group(ranks)
                control = control_world.new_group(ranks)
                if rank in ranks:
                    if isinstance(data, WatchedCommunicator):
                        data.label = f"{axis} {data.label}"  # "tp ranks [0, 1]" in diagnoses
                    mine[axis] = GroupCoordinator(axis, ranks, data, control, secret)
        return cls(layout, rank, world, mine["tp"], mine["pp"], mine["dp"])

    @property
    def is_output_rank(self) -> bool:
        """True on the rank whose ``execute_model`` result goes back to the executor."""
        return self.rank == self.layout.output_rank

    @property
    def is_driver(self) -> bool:
        """True on the first rank of each tensor-parallel group."""
        return self.tp.is_first_rank

    def close(self) -> None:
        """Close the groups this state created; the world communicators stay with whoever
        passed them to :meth:`create`."""
        for group in (self.tp, self.pp, self.dp):
            group.close()
