"""Rank layout (pure), group coordinators and a rank's ParallelState."""

from shardline.distributed.group import GroupCoordinator
from shardline.distributed.layout import ParallelLayout, RankCoordinates
from shardline.distributed.parallel_state import ParallelState

__all__ = ["GroupCoordinator", "ParallelLayout", "ParallelState", "RankCoordinates"]
