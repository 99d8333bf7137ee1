"""Deadlines: a rank that never joins makes the others raise the typed timeout error; one
that joins a group late (past the group's deadline, within the world's join deadline) joins."""

import pytest

from shardline.conformance import checks

DEADLINE_S = 1.5

pytestmark = pytest.mark.shardline_world_sizes(2, 3, 4)


@pytest.mark.shardline_op("deadline: rank never joins")
def test_rank_never_joins(conformance, world_size):
    try:
        waited = conformance.run(world_size, checks.never_joins, DEADLINE_S)[:-1]
    finally:
        conformance.run(world_size, checks.close_held)
    assert all(result is not None for result in waited)
    # Some rank saw the silence as a timeout; others may have lost the group it closed.
    assert "CommTimeoutError" in [kind for _, kind in waited], waited


@pytest.mark.shardline_op("deadline: wait(timeout)")
def test_wait_timeout(conformance, world_size):
    try:
        elapsed = conformance.run(world_size, checks.recv_deadline, DEADLINE_S)
    finally:
        conformance.run(world_size, checks.close_held)
    assert elapsed[0] is not None


@pytest.mark.shardline_op("deadline: late member joins")
@pytest.mark.shardline_world_sizes(2)
def test_late_member_joins(conformance, world_size):
    conformance.run(world_size, checks.late_member, DEADLINE_S)
