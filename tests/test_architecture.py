"""Reading HF config.json in both transformers 4.x and 5.x forms; pipeline layer partition."""

import json

import pytest

from shardline.errors import ConfigError
from shardline.models.architecture import LlamaArchitecture, partition_layers
from shardline.weights.hf import HFCheckpoint
from support.tiny_llama import write_tiny_llama

BASE = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


def test_transformers_4_form():
    arch = LlamaArchitecture.from_hf_config(
        {**BASE, "rope_theta": 100000.0, "rope_scaling": None, "torch_dtype": "bfloat16"}
    )
    assert arch.rope_theta == 100000.0
    assert arch.head_dim == 64
    assert arch.checkpoint_dtype == "bfloat16"
    assert arch.tie_word_embeddings


def test_transformers_5_form():
    config = {
        **BASE,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
        "head_dim": 64,
        "dtype": "float32",
    }
    arch = LlamaArchitecture.from_hf_config(config)
    assert (arch.rope_theta, arch.head_dim, arch.checkpoint_dtype) == (100000.0, 64, "float32")


def test_config_written_by_installed_transformers_is_read(tmp_path):
    directory = write_tiny_llama(tmp_path, rope_theta=5000.0)
    written = json.loads((directory / "config.json").read_text())
    arch = HFCheckpoint(directory).architecture
    assert arch.rope_theta == 5000.0
    assert arch.num_kv_heads == written["num_key_value_heads"] == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type = 'gpt2': only 'llama' is supported"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}},
            "rope type 'yarn' is not supported",
        ),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_configs_are_refused_by_name(change, message):
    config = {**BASE, **change}
    if config.get("hidden_size") is None:
        del config["hidden_size"]
    with pytest.raises(ConfigError, match=message):
        LlamaArchitecture.from_hf_config(config)


def test_missing_weights_file_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "rope_theta": 1.0}))
    missing = r"no model\.safetensors or model\.safetensors\.index\.json"
    with pytest.raises(ConfigError, match=missing):
        HFCheckpoint(tmp_path)


@pytest.mark.parametrize("layers", [1, 4, 7, 30])
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_partition_layers(layers, pp):
    if layers < pp:
        with pytest.raises(ConfigError, match="the model has only"):
            partition_layers(layers, pp, 0)
        return
    stages = [partition_layers(layers, pp, r) for r in range(pp)]
    assert [i for stage in stages for i in stage] == list(range(layers))
    sizes = [len(stage) for stage in stages]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
