"""Subgroups: TP=2 x PP=2 in a world of 4, both TP groups busy at once."""

import pytest

from shardline.conformance import checks


@pytest.mark.shardline_op("subgroups tp2 x pp2")
@pytest.mark.shardline_world_sizes(4)
def test_subgroups_do_not_interfere(conformance, world_size):
    conformance.run(world_size, checks.subgroups, 20)
