"""The trust boundary: signed control-plane objects, parsers that survive fuzzing with clear
errors only, private shared memory, the job secret of launched worlds."""

import os
import re
import stat
import time
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


@FUZZ
@given(raw=st.binary(max_size=300), suffix=st.sampled_from([".yaml", ".toml", ".json"]))
def test_config_file_bytes_load_or_fail_with_one_clear_error(tmp_path_factory, raw, suffix):
    path = tmp_path_factory.mktemp("config") / f"shardline{suffix}"
    path.write_bytes(raw)
    try:
        load_config(path, environ={})
    except ConfigError as error:
        assert str(path) in str(error) or "invalid configuration" in str(error)


def _laughs(levels: int) -> str:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, levels):
        lines.append(f"l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("where", ["file", "--set"])
def test_yaml_aliases_that_expand_past_the_bound_are_refused_at_once(tmp_path, where):
    """The "billion laughs" shape (9^9 strings from 1 KB) is refused before anything is
    built, in a message of bounded size; a few aliases are fine."""
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"aliases expand to more than 10000 nodes") as error:
        if where == "file":
            path = tmp_path / "laughs.yaml"
            path.write_text("parallel:\n  tensor_parallel_size: 1\n" + _laughs(9))
            load_config(path, environ={})
        else:
            flow = "{" + _laughs(9).strip().replace("\n", ", ") + "}"
            load_config(overrides=["plugins.allow=" + flow], environ={})
    assert time.monotonic() - start < 2.0
    assert len(str(error.value)) < 1000
    path = tmp_path / "anchors.yaml"
    path.write_text("defaults: &d {timeout_s: 7}\nparallel: *d\n".replace("defaults", "parallel"))
    with pytest.raises(ConfigError, match="duplicate key 'parallel'"):
        load_config(path, environ={})
    path.write_text("plugins:\n  allow: &names [gloo]\n  strict: false\n")
    assert load_config(path, environ={}).config.plugins.allow == ["gloo"]


@pytest.mark.parametrize(
    ("suffix", "text", "fragment"),
    [
        (".yaml", "parallel:\n  timeout_s: 3\nparallel:\n  timeout_s: 4\n", "(lines 1 and 3)"),
        (".yaml", "parallel:\n  timeout_s: 3\n  timeout_s: 4\n", "(lines 2 and 3)"),
        (".json", '{"parallel": {"timeout_s": 3, "timeout_s": 4}}', ""),
    ],
)
def test_duplicate_keys_in_a_file_are_refused(tmp_path, suffix, text, fragment):
    path = tmp_path / f"dup{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"duplicate key '(parallel|timeout_s)'") as error:
        load_config(path, environ={})
    assert fragment in str(error.value)


@pytest.mark.parametrize(
    ("suffix", "text"),
    [(".json", "[" * 100_000), (".yaml", "a: " + "[" * 100_000), (".toml", "a = " + "[" * 100_000)],
)
def test_deeply_nested_files_are_refused(tmp_path, suffix, text):
    path = tmp_path / f"deep{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"not valid (json|yaml|toml)"):
        load_config(path, environ={})


def test_binary_and_oversized_files_are_refused_with_the_limit(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xd9\x00\xff")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xd9 at offset 0\)"):
        load_config(binary, environ={})
    huge = tmp_path / "huge.yaml"
    huge.write_text("# " + "x" * (1 << 20))
    with pytest.raises(ConfigError, match=r"larger than 1048576 bytes"):
        load_config(huge, environ={})


def test_values_echoed_in_errors_are_cut():
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["parallel.device=" + "x" * 100_000], environ={})
    assert len(str(error.value)) < 600
    assert "(100002 characters)" in str(error.value)  # the repr, quotes included


@pytest.mark.parametrize(
    ("assignment", "fragment"),
    [
        ("parallel.tensor_parallel_size=true", "Input should be a valid integer"),
        ("parallel.tensor_parallel_size=" + "1" + "0" * 30, "less than or equal to 1024"),
        ("parallel.timeout_s=.inf", "finite number"),
        ("parallel.startup_timeout_s=1000000000000.0", "less than or equal to 86400"),
        ("cache.num_blocks=1000000000000", "less than or equal to 2147483647"),
        ("sampling.seed=-1", "greater than or equal to 0"),
        ("parallel.watchdog=1", "valid boolean"),
    ],
)
def test_values_that_would_overflow_later_are_refused_with_the_bound(assignment, fragment):
    with pytest.raises(ConfigError, match=rf"--set {re.escape(assignment)}: .*{fragment}"):
        load_config(overrides=[assignment], environ={})


def test_a_world_too_large_for_any_host_is_refused():
    sizes = ["parallel.tensor_parallel_size=1024", "parallel.pipeline_parallel_size=1024"]
    with pytest.raises(ConfigError, match=r"1048576 ranks .* at most 65536"):
        load_config(overrides=sizes, environ={})


def test_a_bad_nested_set_or_environment_key_names_its_source():
    with pytest.raises(ConfigError, match=r"^invalid configuration: --set parallel.timeout_s.x=3"):
        load_config(overrides=["parallel.timeout_s.x=3"], environ={})
    environ = {"SHARDLINE_PARALLEL__TIMEOUT_S__X": "3"}
    with pytest.raises(ConfigError, match=r"env SHARDLINE_PARALLEL__TIMEOUT_S__X: "):
        load_config(environ=environ)


def test_a_shardline_variable_without_the_section_separator_is_warned_about():
    loaded = load_config(environ={"SHARDLINE_PARALLEL_TIMEOUT_S": "3", "SHARDLINE_DEBUG": "1"})
    assert loaded.config.parallel.timeout_s == 300.0
    (warning,) = loaded.warnings
    assert "SHARDLINE_PARALLEL_TIMEOUT_S is ignored" in warning
    assert "did you mean SHARDLINE_PARALLEL__TIMEOUT_S?" in warning


def test_shared_memory_rings_are_private_to_the_user():
    ring = ShmRing.create(f"shardline-test-{os.getpid()}", readers=1, slots=2, slot_bytes=4096)
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
    from shardline.distributed.control_plane import ControlPlane
    from shardline_gloo.communicator import GlooBackend

    _store, rendezvous = serve_store()
    comm = GlooBackend().init_world(0, 1, rendezvous, 10.0)
    try:
        with pytest.raises(ProtocolError, match="announces -1 bytes"):
            ControlPlane(comm, rendezvous.secret)._buffer(torch.tensor([-1]), src=0)
    finally:
        comm.close()
