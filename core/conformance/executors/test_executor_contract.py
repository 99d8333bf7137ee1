"""The executor contract, one test per check and world size (see ``checks.py``)."""

import pytest

from shardline.conformance.executors.checks import CHECKS

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("check", list(CHECKS))
def test_executor_contract(executor_conformance, check, world_size):
    executor_conformance.check(check, world_size)
