"""Rank layout as pure functions: the seeds' examples and properties over many sizes."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.distributed.layout import ParallelLayout, RankCoordinates


def test_seed_example_eight_ranks_tp2_pp4():
    layout = ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=4)
    assert layout.world_size == 8
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.output_rank == 6


def test_seed_example_output_rank_tp8_pp4():
    layout = ParallelLayout(tensor_parallel_size=8, pipeline_parallel_size=4)
    assert layout.output_rank == 24
    assert layout.coordinates(24) == RankCoordinates(external_dp=0, dp=0, pp=3, tp=0)


def test_data_parallel_groups_stride_by_pp_times_tp():
    layout = ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    assert layout.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups_of(5) == {"tp": [4, 5], "pp": [5, 7], "dp": [1, 5]}


@pytest.mark.parametrize(
    "field", ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"]
)
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_rejects_non_positive_sizes(field, value):
    with pytest.raises(ValueError, match=field):
        ParallelLayout(**{field: value})


def test_rejects_ranks_outside_the_world():
    with pytest.raises(ValueError, match="rank 4 outside a world of 4"):
        ParallelLayout(tensor_parallel_size=4).coordinates(4)


sizes = st.integers(min_value=1, max_value=4)


@settings(deadline=None)  # pure functions: a loaded host only makes an example slower
@given(tp=sizes, pp=sizes, dp=sizes, edp=st.integers(min_value=1, max_value=2))
def test_layout_properties(tp, pp, dp, edp):
    layout = ParallelLayout(tp, pp, dp, edp)
    world = list(range(layout.world_size))
    for groups, size in (
        (layout.tp_groups(), tp),
        (layout.pp_groups(), pp),
        (layout.dp_groups(), dp),
    ):
        # Each axis partitions the world into groups of its size.
        assert sorted(r for g in groups for r in g) == world
        assert all(len(g) == size for g in groups)
    for group in layout.tp_groups():
        assert group == list(range(group[0], group[0] + tp))  # consecutive
    for group in layout.pp_groups():
        assert all(b - a == tp for a, b in itertools.pairwise(group))  # stride tp
    for rank in world:
        coordinates = layout.coordinates(rank)
        assert layout.rank_of(coordinates) == rank
        groups = layout.groups_of(rank)
        assert groups["tp"].index(rank) == coordinates.tp
        assert groups["pp"].index(rank) == coordinates.pp
    last = layout.coordinates(layout.output_rank)
    assert (last.pp, last.tp, last.dp, last.external_dp) == (pp - 1, 0, dp - 1, edp - 1)
