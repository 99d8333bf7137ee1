"""Point-to-point: blocking and asynchronous tensors, message order, idempotent waits."""

import pytest

from shardline.conformance import checks
from shardline.conformance.cases import DTYPES, SHAPES

pytestmark = pytest.mark.shardline_world_sizes(2, 3, 4)


@pytest.mark.shardline_op("send/recv")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_send_recv(conformance, world_size, shape, dtype):
    conformance.require(dtype=dtype)
    conformance.run(world_size, checks.send_recv, shape, dtype)


@pytest.mark.shardline_op("isend/irecv")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_isend_irecv(conformance, world_size, shape, dtype):
    conformance.require(dtype=dtype, needs_async_p2p=True)
    conformance.run(world_size, checks.isend_irecv, shape, dtype)


@pytest.mark.shardline_op("p2p order")
def test_message_order(conformance, world_size):
    conformance.require(needs_async_p2p=True)
    conformance.run(world_size, checks.p2p_order)
