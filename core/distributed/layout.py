"""Where each rank sits: ExternalDP x DP x PP x TP, as pure functions of the sizes.

Rank ``r`` has coordinates ``(edp, dp, pp, tp)`` with
``r = ((edp * DP + dp) * PP + pp) * TP + tp``: tensor-parallel groups are consecutive ranks
(so they land on one host), pipeline groups stride by TP, data-parallel groups by PP * TP.
Example, 8 ranks, TP=2, PP=4: TP groups [0,1] [2,3] [4,5] [6,7]; PP groups [0,2,4,6]
[1,3,5,7]; the output rank is 8 - 2 = 6.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankCoordinates:
    """A rank's position on each parallel axis."""

    external_dp: int
    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class ParallelLayout:
    """The four parallel sizes; validated once, every group derived from them."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    external_data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
            "external_data_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return (
            self.external_data_parallel_size
            * self.data_parallel_size
            * self.pipeline_parallel_size
            * self.tensor_parallel_size
        )

    @property
    def output_rank(self) -> int:
        """The rank that returns results to the executor: the first TP rank of the last
        pipeline stage of the last data-parallel replica (``world_size - tp``)."""
        return self.world_size - self.tensor_parallel_size

    def coordinates(self, rank: int) -> RankCoordinates:
        """The ``(edp, dp, pp, tp)`` position of ``rank``."""
        self._check_rank(rank)
        rank, tp = divmod(rank, self.tensor_parallel_size)
        rank, pp = divmod(rank, self.pipeline_parallel_size)
        external_dp, dp = divmod(rank, self.data_parallel_size)
        return RankCoordinates(external_dp, dp, pp, tp)

    def rank_of(self, coordinates: RankCoordinates) -> int:
        """Inverse of :meth:`coordinates`."""
        c = coordinates
        return (
            (c.external_dp * self.data_parallel_size + c.dp) * self.pipeline_parallel_size + c.pp
        ) * self.tensor_parallel_size + c.tp

    def tp_groups(self) -> list[list[int]]:
        """Consecutive runs of ``tensor_parallel_size`` ranks."""
        tp = self.tensor_parallel_size
        return [list(range(start, start + tp)) for start in range(0, self.world_size, tp)]

    def pp_groups(self) -> list[list[int]]:
        """Ranks that differ only in pipeline stage, ordered by stage."""
        return self._groups_along("pp")

    def dp_groups(self) -> list[list[int]]:
        """Ranks that differ only in data-parallel index (within one external replica)."""
        return self._groups_along("dp")

    def groups_of(self, rank: int) -> dict[str, list[int]]:
        """The TP, PP and DP group containing ``rank``."""
        self._check_rank(rank)
        return {
            axis: next(g for g in groups if rank in g)
            for axis, groups in (
                ("tp", self.tp_groups()),
                ("pp", self.pp_groups()),
                ("dp", self.dp_groups()),
            )
        }

    def _groups_along(self, axis: str) -> list[list[int]]:
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            key = (c.external_dp, c.dp, c.pp, c.tp)
            position = {"dp": 1, "pp": 2}[axis]
            groups.setdefault(key[:position] + key[position + 1 :], []).append(rank)
        return list(groups.values())

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
