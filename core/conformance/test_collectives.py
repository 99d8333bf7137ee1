"""Collectives: every operation x dtype x shape x world size."""

import pytest

from shardline.conformance import checks
from shardline.conformance.cases import DTYPES, SHAPES

REDUCE_OPS = ["sum", "max", "min"]


@pytest.mark.shardline_op("all_reduce")
@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_all_reduce(conformance, world_size, shape, dtype, op):
    conformance.require(dtype=dtype, reduce_op=op)
    conformance.run(world_size, checks.all_reduce, shape, dtype, op)


@pytest.mark.shardline_op("all_gather")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_all_gather(conformance, world_size, shape, dtype):
    conformance.require(dtype=dtype)
    conformance.run(world_size, checks.all_gather, shape, dtype, 0)


@pytest.mark.shardline_op("all_gather(dim=-1)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["odd", "noncontig"])
def test_all_gather_last_dim(conformance, world_size, shape, dtype):
    conformance.require(dtype=dtype)
    conformance.run(world_size, checks.all_gather, shape, dtype, -1)


@pytest.mark.shardline_op("reduce_scatter")
@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_reduce_scatter(conformance, world_size, shape, dtype, op):
    conformance.require(dtype=dtype, reduce_op=op)
    conformance.run(world_size, checks.reduce_scatter, shape, dtype, op)


@pytest.mark.shardline_op("reduce_scatter(indivisible)")
@pytest.mark.shardline_world_sizes(2, 3, 4)
def test_reduce_scatter_rejects_indivisible(conformance, world_size):
    conformance.run(world_size, checks.reduce_scatter_indivisible)


@pytest.mark.shardline_op("gather")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gather(conformance, world_size, shape, dtype):
    conformance.require(dtype=dtype)
    conformance.run(world_size, checks.gather, shape, dtype)


@pytest.mark.shardline_op("broadcast")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_broadcast(conformance, world_size, shape, dtype):
    conformance.require(dtype=dtype)
    conformance.run(world_size, checks.broadcast, shape, dtype)


@pytest.mark.shardline_op("barrier")
def test_barrier(conformance, world_size):
    conformance.run(world_size, checks.barrier)
