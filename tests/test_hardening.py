"""The trust boundary: signed control-plane objects, parsers that survive fuzzing with clear
errors only, private shared memory, the job secret of launched worlds."""

import os
import stat
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardline.comm import objects, tensor_dict
from shardline.comm.tensor_dict import TensorMeta
from shardline.config import load_config
from shardline.config.loader import read_config_file
from shardline.errors import ConfigError, ProtocolError
from shardline.launch.launcher_env import LaunchedRank
from shardline_executors.shm_ring import ShmRing

SECRET = b"s" * 32
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_sealed_objects_round_trip_and_anything_else_is_refused_unread():
    sealed = objects.seal({"tokens": [1, 2]}, SECRET)
    assert objects.unseal(sealed, SECRET) == {"tokens": [1, 2]}
    tampered = bytearray(sealed)
    tampered[-2] ^= 1
    for raw, secret in ((bytes(tampered), SECRET), (sealed, b"t" * 32), (sealed[:10], SECRET)):
        with pytest.raises(ProtocolError, match=r"from rank 3 .* fails the job-secret check"):
            objects.unseal(raw, secret, "rank 3")
    with pytest.raises(ProtocolError, match="no job secret"):
        objects.seal(1, b"")


@FUZZ
@given(st.binary(max_size=512))
def test_unsigned_bytes_never_reach_pickle(raw):
    with pytest.raises(ProtocolError):
        objects.unseal(raw, SECRET)


_shapes = st.one_of(
    st.tuples(*[st.integers(-2, 8)] * 2),
    st.lists(st.one_of(st.integers(-2, 64), st.just(1 << 40), st.text(max_size=2)), max_size=4),
    st.integers(),
    st.none(),
)
_meta = st.builds(
    TensorMeta,
    dtype=st.one_of(st.sampled_from(["float32", "bfloat16", "int64", "float99"]), st.integers()),
    shape=_shapes,
    device=st.sampled_from(["cpu", "gpu", "", "cuda:0"]),
)
_entries = st.one_of(
    st.tuples(st.text(max_size=4), st.one_of(_meta, st.integers(), st.text(max_size=4))),
    st.tuples(st.integers(), _meta),
    st.lists(st.text(max_size=2), max_size=3),
    st.none(),
)


@FUZZ
@given(
    st.one_of(st.lists(_entries, max_size=4), st.dictionaries(st.text(), st.integers()), st.text())
)
def test_tensor_dict_metadata_is_allocated_or_refused_clearly(metadata):
    try:
        result, buffers = tensor_dict.allocate(metadata, sender="rank 1")
    except ProtocolError as error:
        assert str(error).startswith("tensor dict from rank 1: ")
        return
    assert all(isinstance(key, str) for key in result)
    assert all(b.numel() > 0 for b in buffers)


_FIELDS = [
    "model.path",
    "model.dtype",
    "model.runner",
    "model.pooling",
    "cache.block_size",
    "scheduler.max_num_seqs",
    "sampling.temperature",
    "sampling.top_p",
    "parallel.tensor_parallel_size",
    "parallel.timeout_s",
    "parallel.watchdog",
    "parallel.device",
    "plugins.allow",
    "plugins.strict",
    "nonsense.field",
    "parallel",
    "",
]
_VALUES = st.one_of(
    st.text(max_size=12),
    st.integers(-5, 1 << 70).map(str),
    st.floats(allow_nan=True).map(str),
    st.sampled_from(["[gloo,mpi]", "[", "true", "null", "{a: 1}", "-0", "1e400", "inf"]),
)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(_FIELDS), _VALUES), max_size=4))
def test_config_overrides_load_or_fail_with_one_clear_error(assignments):
    try:
        load_config(overrides=[f"{key}={value}" for key, value in assignments], environ={})
    except ConfigError as error:
        assert str(error).strip()


@FUZZ
@given(text=st.text(max_size=200), suffix=st.sampled_from([".yaml", ".toml", ".json"]))
def test_config_files_load_or_fail_with_one_clear_error(tmp_path_factory, text, suffix):
    path = tmp_path_factory.mktemp("config") / f"shardline{suffix}"
    path.write_text(text, encoding="utf-8")
    try:
        mapping = read_config_file(path)
        load_config(path, environ={})
    except ConfigError as error:
        assert str(path) in str(error) or "invalid configuration" in str(error)
        return
    assert isinstance(mapping, dict)


def test_shared_memory_rings_are_private_to_the_user():
    ring = ShmRing.create(readers=1, slots=2, slot_bytes=4096)
    try:
        mode = os.stat(Path("/dev/shm") / ring.handle.name).st_mode
        assert stat.S_IMODE(mode) == 0o600, oct(mode)
    finally:
        ring.close()


def test_launched_ranks_take_the_job_secret_from_the_environment():
    environ = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    assert LaunchedRank.from_environ(environ).job_secret is None
    secret = LaunchedRank.from_environ({**environ, "SHARDLINE_JOB_SECRET": "x" * 32}).job_secret
    assert isinstance(secret, bytes) and len(secret) == 32
    with pytest.raises(ConfigError, match="SHARDLINE_JOB_SECRET has 5 characters"):
        LaunchedRank.from_environ({**environ, "SHARDLINE_JOB_SECRET": "short"})


def test_object_messages_announcing_absurd_sizes_are_refused():
    from shardline.comm.store import serve_store
    from shardline_gloo.communicator import GlooBackend

    _store, rendezvous = serve_store()
    comm = GlooBackend().init_world(0, 1, rendezvous, 10.0)
    comm.object_key = rendezvous.secret
    try:
        with pytest.raises(ProtocolError, match="announces -1 bytes"):
            comm._object_buffer(torch.tensor([-1]), src=0)
    finally:
        comm.close()
