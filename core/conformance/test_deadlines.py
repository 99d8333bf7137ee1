"""Deadlines: a rank that never joins makes the others raise the typed timeout error."""

import pytest

from shardline.conformance import checks

DEADLINE_S = 1.5

pytestmark = pytest.mark.shardline_world_sizes(2, 3, 4)


@pytest.mark.shardline_op("deadline: rank never joins")
def test_rank_never_joins(conformance, world_size):
    elapsed = conformance.run(world_size, checks.never_joins, DEADLINE_S)
    assert all(e is not None for e in elapsed[:-1])


@pytest.mark.shardline_op("deadline: wait(timeout)")
def test_wait_timeout(conformance, world_size):
    elapsed = conformance.run(world_size, checks.recv_deadline, DEADLINE_S)
    assert elapsed[0] is not None
