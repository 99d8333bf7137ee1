"""Objects and tensor dicts (metadata + tensors, empty tensors and plain values), through the
control plane Shardline builds on the backend's tensor operations, and unsigned bytes that
must never reach pickle."""

import pytest

from shardline.conformance import checks


@pytest.mark.shardline_op("objects")
def test_objects(conformance, world_size):
    conformance.run(world_size, checks.objects)


@pytest.mark.shardline_op("tensor_dict")
@pytest.mark.shardline_world_sizes(2, 3, 4)
def test_tensor_dicts(conformance, world_size):
    conformance.run(world_size, checks.tensor_dicts, False)


@pytest.mark.shardline_op("tensor_dict async")
@pytest.mark.shardline_world_sizes(2, 3, 4)
def test_async_tensor_dicts(conformance, world_size):
    conformance.require(needs_async_p2p=True)
    conformance.run(world_size, checks.tensor_dicts, True)


@pytest.mark.shardline_op("unsigned objects")
@pytest.mark.shardline_world_sizes(2, 3, 4)
def test_unsigned_bytes_never_reach_pickle(conformance, world_size, tmp_path):
    conformance.run(world_size, checks.unsigned_objects, str(tmp_path / "unpickled"))
