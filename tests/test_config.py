"""Config loading: formats, layering and sources, clear errors, cross-field checks."""

import json
import re

import pytest
import torch

from shardline.config import load_config
from shardline.config.schema import EngineConfig
from shardline.config.selection import check_config, choose_executor
from shardline.errors import ConfigError
from shardline.registry import Registry

CONTENT = {
    ".yaml": "parallel:\n  tensor_parallel_size: 2\n  timeout_s: 9\n",
    ".yml": "parallel:\n  tensor_parallel_size: 2\n  timeout_s: 9\n",
    ".toml": "[parallel]\ntensor_parallel_size = 2\ntimeout_s = 9\n",
    ".json": json.dumps({"parallel": {"tensor_parallel_size": 2, "timeout_s": 9}}),
}


@pytest.mark.parametrize("suffix", sorted(CONTENT))
def test_every_format_loads_by_extension(tmp_path, suffix):
    path = tmp_path / f"c{suffix}"
    path.write_text(CONTENT[suffix])
    loaded = load_config(path, environ={})
    assert loaded.config.parallel.tensor_parallel_size == 2
    assert loaded.config.parallel.timeout_s == 9
    assert loaded.source_of("parallel.tensor_parallel_size") == str(path)
    assert loaded.source_of("parallel.communicator") == "default"


def test_environment_overrides_file_and_set_overrides_both(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CONTENT[".yaml"])
    environ = {
        "SHARDLINE_PARALLEL__TENSOR_PARALLEL_SIZE": "4",
        "SHARDLINE_PARALLEL__TIMEOUT_S": "5",
    }
    loaded = load_config(path, ["parallel.timeout_s=7"], environ)
    assert loaded.config.parallel.tensor_parallel_size == 4
    assert (
        loaded.source_of("parallel.tensor_parallel_size")
        == "env SHARDLINE_PARALLEL__TENSOR_PARALLEL_SIZE"
    )
    assert loaded.config.parallel.timeout_s == 7
    assert loaded.source_of("parallel.timeout_s") == "--set parallel.timeout_s=7"


def test_plugin_shorthands_from_the_environment():
    loaded = load_config(
        environ={"SHARDLINE_PLUGINS": "gloo, mine", "SHARDLINE_STRICT_PLUGINS": "1"}
    )
    assert loaded.config.plugins.allow == ["gloo", "mine"]
    assert loaded.config.plugins.strict is True


def test_unknown_key_names_file_field_value_and_suggestion(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("parallel:\n  tensor_paralel_size: 2\n")
    with pytest.raises(ConfigError) as error:
        load_config(path, environ={})
    message = str(error.value)
    assert str(path) in message
    assert "parallel.tensor_paralel_size = 2" in message
    assert "Did you mean 'parallel.tensor_parallel_size'?" in message
    assert "Allowed in [parallel]:" in message


def test_a_section_key_at_the_top_level_suggests_its_section(tmp_path):
    path = tmp_path / "flat.yaml"
    path.write_text("distributed_executor_backend: mp\n")
    with pytest.raises(ConfigError) as error:
        load_config(path, ["timeout_s=3"], environ={})
    message = str(error.value)
    assert f"{path}: distributed_executor_backend = 'mp': unknown key." in message
    assert "Did you mean 'parallel.distributed_executor_backend'?" in message
    assert "--set timeout_s=3: timeout_s = 3: unknown key. Did you mean 'parallel.timeout_s'?" in (
        message
    )


def test_a_key_in_the_wrong_section_suggests_the_right_one():
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["parallel.seed=3"], environ={})
    assert "parallel.seed = 3: unknown key. Did you mean 'sampling.seed'?" in str(error.value)


def test_bad_value_names_what_is_allowed():
    with pytest.raises(
        ConfigError,
        match=r"--set parallel.device=tpu: parallel.device = 'tpu': Input should be 'cpu' or 'cuda",
    ):
        load_config(overrides=["parallel.device=tpu"], environ={})


@pytest.mark.parametrize(
    ("dtype", "weight_dtype", "allowed"),
    [("bfloat16", "float32", "null, 'bfloat16'"),
     ("bfloat16", "gguf", "null, 'bfloat16'"),
     ("float32", "float16", "null, 'float32', 'bfloat16', 'gguf'")],
)  # fmt: skip
def test_a_weight_dtype_the_model_dtype_cannot_take_names_what_it_can(dtype, weight_dtype, allowed):
    with pytest.raises(ConfigError) as error:
        load_config(
            overrides=[f"model.dtype={dtype}", f"model.weight_dtype={weight_dtype}"], environ={}
        )
    assert f"weight_dtype = '{weight_dtype}' with dtype = '{dtype}': allowed: {allowed}" in str(
        error.value
    )
    config = load_config(overrides=["model.weight_dtype=bfloat16"], environ={}).config
    assert config.model.weight_precision == "bfloat16" and not config.model.holds_gguf_blocks
    config = load_config(overrides=["model.weight_dtype=gguf"], environ={}).config
    assert config.model.weight_precision == "float32" and config.model.holds_gguf_blocks


def test_floats_in_exponent_form_are_numbers_everywhere(tmp_path):
    # YAML 1.1 reads 1e3 (no dot, unsigned exponent) as text; JSON, TOML and users do not.
    path = tmp_path / "c.yaml"
    path.write_text("parallel:\n  timeout_s: 1e3\n  startup_timeout_s: 2.5E+1\n")
    loaded = load_config(
        path, ["cache.memory_fraction=5e-1"], {"SHARDLINE_SAMPLING__TOP_P": ".5e0"}
    )
    assert loaded.config.parallel.timeout_s == 1000.0
    assert loaded.config.parallel.startup_timeout_s == 25.0
    assert loaded.config.cache.memory_fraction == 0.5
    assert loaded.config.sampling.top_p == 0.5
    # Only numbers: text that merely looks close stays text.
    loaded = load_config(overrides=["model.path=1e", "parallel.communicator=e3"], environ={})
    assert (loaded.config.model.path, loaded.config.parallel.communicator) == ("1e", "e3")


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        (
            "cache.num_blocks=abc",
            "cache.num_blocks = 'abc': Input should be a valid integer or 'auto'",
        ),
        (
            "cache.num_blocks=0",
            "cache.num_blocks = 0: Input should be greater than or equal to 1 or 'auto'",
        ),
    ],
)
def test_a_value_that_fits_no_member_of_a_union_is_one_problem(item, expected):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=[item], environ={})
    assert str(error.value) == f"invalid configuration: --set {item}: {expected}"


def test_several_problems_are_listed_in_one_error():
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["parallel.timeout_s=0", "model.dtyp=float16"], environ={})
    lines = str(error.value).splitlines()
    assert lines[0] == "invalid configuration:"
    assert len(lines) == 3


@pytest.mark.parametrize(
    ("item", "fragment"),
    [
        ("parallel.tensor_parallel_size", "expected section.key=value"),
        ("=3", "expected section.key=value"),
    ],
)
def test_malformed_set_is_refused(item, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(overrides=[item], environ={})


def test_unsupported_extension_and_malformed_file(tmp_path):
    ini = tmp_path / "c.ini"
    ini.write_text("x")
    with pytest.raises(
        ConfigError,
        match=r"unsupported config file type '.ini'; allowed: .yaml, .yml, .toml, .json",
    ):
        load_config(ini, environ={})
    broken = tmp_path / "c.json"
    broken.write_text("{ nope")
    with pytest.raises(ConfigError, match=r"c.json: not valid json"):
        load_config(broken, environ={})
    listing = tmp_path / "c.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listing, environ={})


def test_capability_mismatch_is_refused_with_the_alternatives():
    registry = Registry.load()
    loaded = load_config(overrides=["parallel.device=cuda"], environ={})
    with pytest.raises(ConfigError) as error:
        check_config(loaded, registry, {})
    # Both problems in one message: the device refusal and the communicator's capability.
    message = str(error.value)
    assert "--set parallel.device=cuda: parallel.device = 'cuda':" in message
    assert (
        "default: parallel.communicator = 'gloo': device cuda not supported (supported: cpu)"
        in (message)
    )


def test_a_replicas_config_describes_its_own_world():
    overrides = ["parallel.data_parallel_size=3", "parallel.tensor_parallel_size=2"]
    parallel = load_config(overrides=overrides, environ={}).config.parallel
    assert (parallel.world_size, parallel.worlds_side_by_side) == (6, 1)
    replica = parallel.replica(2)
    assert (replica.world_size, replica.worlds_side_by_side) == (2, 3)
    assert replica.layout.data_parallel_size == 1
    with pytest.raises(ValueError, match=r"data_parallel_rank = 3: allowed: 0..2"):
        parallel.replica(3)
    with pytest.raises(ConfigError, match="the engine sets it in each replica's config"):
        check_config(
            load_config(overrides=["parallel.data_parallel_rank=0"], environ={}),
            Registry.load(),
            {},
        )


def test_data_parallel_replicas_are_refused_only_under_a_launcher():
    torchrun = {
        "TORCHELASTIC_RUN_ID": "x",
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    dp2 = ["parallel.data_parallel_size=2"]
    checked = check_config(load_config(overrides=dp2, environ={}), Registry.load(), {})
    decisions = {d.field: d for d in checked.decisions}
    assert decisions["parallel.data_parallel_size"].problem is None
    # Two replicas of one rank each: two rank processes (mp), both counted on this host.
    assert decisions["parallel.distributed_executor_backend"].chosen == "mp"
    assert len(checked.capacity.placement.ranks) == 2
    with pytest.raises(ConfigError) as error:
        check_config(load_config(overrides=dp2, environ=torchrun), Registry.load(), torchrun)
    assert (
        "--set parallel.data_parallel_size=2: parallel.data_parallel_size = 2: the executor "
        "'external_launcher' runs the ranks a launcher started, one engine per process, and "
        "cannot start replicas; allowed: 1 here"
    ) in str(error.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA devices")
def test_cuda_is_refused_on_a_host_without_cuda_naming_why():
    loaded = load_config(
        overrides=["parallel.device=cuda", "parallel.communicator=auto"], environ={}
    )
    with pytest.raises(ConfigError) as error:
        check_config(loaded, Registry.load(), {})
    message = str(error.value)
    assert (
        "--set parallel.device=cuda: parallel.device = 'cuda': this host has no CUDA device "
        "(torch.cuda.is_available() is False"
    ) in message
    assert message.rstrip().endswith("allowed: cpu") or "allowed: cpu\n" in message


def test_the_settings_that_run_are_accepted():
    checked = check_config(load_config(environ={}), Registry.load(), {})
    decisions = {d.field: d for d in checked.decisions}
    assert decisions["parallel.device"].chosen == "cpu"
    assert decisions["parallel.data_parallel_size"].chosen == "1"
    assert decisions["parallel.device"].problem is None
    assert decisions["parallel.data_parallel_size"].problem is None


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], True),
        (["cache.prefix_caching=false"], False),
        # A runner that does not start requests from cached blocks: off, and explained.
        (["model.runner=support.slow_runner:SlowCollectiveRunner"], False),
    ],
    ids=["default", "configured-off", "runner-without-it"],
)
def test_prefix_caching_runs_only_with_a_runner_that_declares_it(overrides, expected):
    checked = check_config(load_config(overrides=overrides, environ={}), Registry.load(), {})
    decision = {d.field: d for d in checked.decisions}["cache.prefix_caching"]
    assert checked.config.cache.prefix_caching is expected
    assert decision.chosen == str(expected).lower() and decision.problem is None
    if "model.runner" in " ".join(overrides):
        assert "does not start requests from cached blocks" in decision.reason


def test_speculative_decoding_needs_a_runner_that_verifies_drafts():
    loaded = load_config(overrides=["speculative.method=ngram"], environ={})
    chosen = check_config(loaded, Registry.load(), {})
    assert chosen.config.speculative.method == "ngram"
    loaded = load_config(
        overrides=[
            "speculative.method=ngram",
            "model.runner=support.slow_runner:SlowCollectiveRunner",
        ],
        environ={},
    )
    with pytest.raises(ConfigError) as refused:
        check_config(loaded, Registry.load(), {})
    message = str(refused.value)
    assert "speculative.method = 'ngram'" in message
    assert "does not verify drafts" in message and "allowed: 'none'" in message


@pytest.mark.parametrize(
    ("assignment", "fragment"),
    [
        ("speculative.method=eagle", "speculative.method"),
        ("speculative.num_speculative_tokens=16", "less than or equal to 15"),
        ("speculative.prompt_lookup_min=5", "prompt_lookup_min = 5: must be at most"),
    ],
)
def test_speculative_settings_out_of_range_are_refused(assignment, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(overrides=[assignment], environ={})


def test_uni_executor_with_several_ranks_is_refused():
    loaded = load_config(
        overrides=[
            "parallel.distributed_executor_backend=uni",
            "parallel.pipeline_parallel_size=2",
        ],
        environ={},
    )
    with pytest.raises(
        ConfigError, match="'uni' runs one rank in-process, but the layout has 2 ranks"
    ):
        check_config(loaded, Registry.load(), {})


@pytest.mark.parametrize(
    ("environ", "sizes", "expected"),
    [
        ({}, [], "uni"),
        ({}, ["parallel.tensor_parallel_size=2"], "mp"),
        ({"TORCHELASTIC_RUN_ID": "x"}, ["parallel.tensor_parallel_size=2"], "external_launcher"),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, ["parallel.tensor_parallel_size=2"], "external_launcher"),
        ({"PMI_SIZE": "2"}, ["parallel.tensor_parallel_size=2"], "external_launcher"),
    ],
)
def test_auto_executor_selection(environ, sizes, expected):
    decision = choose_executor(
        load_config(overrides=sizes, environ={}).config, Registry.load(), environ
    )
    assert decision.chosen == expected


def test_schema_describes_every_section():
    schema = EngineConfig.model_json_schema()
    assert set(schema["properties"]) == {
        "model",
        "cache",
        "scheduler",
        "sampling",
        "speculative",
        "parallel",
        "serve",
        "plugins",
    }
    assert "tensor_parallel_size" in json.dumps(schema)


@pytest.mark.parametrize(
    ("assignment", "fragment"),
    [
        (
            "parallel.distributed_executor_backend=os:system",
            "'os:system': os:system is a builtin_function_or_method, not a subclass of "
            "shardline.interfaces.executor.Executor; allowed: a registered executor "
            "({executors})",
        ),
        (
            "model.runner=shardline.interfaces:Executor",
            "is a class Executor, not a subclass of shardline.interfaces.model_runner.ModelRunner",
        ),
        ("model.runner=nosuch", "model.runner = 'nosuch': no installed plugin provides this "),
        ("parallel.communicator=os:path", "os:path is a module, not a subclass of"),
    ],
)
def test_components_of_the_wrong_kind_or_type_are_refused_at_validation(assignment, fragment):
    loaded = load_config(overrides=[assignment], environ={})
    registry = Registry.load()
    # Every installed executor is offered (ray only where its requirement is installed).
    fragment = fragment.replace("{executors}", ", ".join(registry.names("executor")))
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        check_config(loaded, registry, {})


@pytest.mark.parametrize(
    ("value", "native_runs"),
    [("0", False), ("false", False), ("Off", False), ("1", True), ("yes", True), ("", True)],
)
def test_the_native_switch_takes_the_usual_words_without_a_warning(value, native_runs):
    from shardline.native import native_extension

    environ = {"SHARDLINE_NATIVE": value}
    assert load_config(environ=environ).warnings == ()
    built = native_extension("shardline.layers._kernels", {}) is not None
    assert (native_extension("shardline.layers._kernels", environ) is not None) == (
        native_runs and built
    )


def test_a_native_switch_value_that_means_nothing_is_warned_about():
    (warning,) = load_config(environ={"SHARDLINE_NATIVE": "garbage"}).warnings
    assert warning.startswith("SHARDLINE_NATIVE = 'garbage' is not understood; allowed: 0,")
    assert warning.endswith("the C paths run")
