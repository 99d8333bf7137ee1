"""Bad weights and impossible layouts end in one ConfigError naming the tensor or field."""

import importlib
import importlib.util
import re

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from shardline.config import load_config
from shardline.errors import ConfigError
from shardline.models.architecture import LlamaArchitecture, check_tensor_parallel
from shardline.registry import Registry
from shardline.weights.gguf_checkpoint import GGUFCheckpoint
from support.cli import shardline
from support.tiny_gguf import write_tiny_gguf
from support.tiny_llama import write_tiny_llama


@pytest.fixture
def checkpoint_dir(tmp_path):
    return write_tiny_llama(tmp_path / "tiny")


def _start_uni(path):
    config = load_config(
        overrides=[f"model.path={path}", "parallel.distributed_executor_backend=uni"], environ={}
    )
    executor = Registry.load().get("executor", "uni").load_available()(config.config)
    executor.shutdown()


def _rewrite(directory, change):
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(checkpoint_dir):
    _rewrite(checkpoint_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ConfigError, match=re.escape("no tensor 'model.layers.1.mlp.up_proj.weight'")
    ):
        _start_uni(checkpoint_dir)


def test_the_tensor_names_are_those_safetensors_lists_and_a_cut_file_is_named(checkpoint_dir):
    """The checkpoint reads the names from the file's header itself (no torch to open it):
    every tensor safetensors lists is found, with its shape; a file cut short is named."""
    from safetensors import safe_open

    from shardline.weights import open_checkpoint

    weights = checkpoint_dir / "model.safetensors"
    checkpoint = open_checkpoint(str(checkpoint_dir))
    with safe_open(weights, framework="numpy") as handle:
        names = handle.keys()  # a list (the handle itself is not iterable)
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in names}
    assert len(shapes) > 10
    assert {name: checkpoint.tensor(name).shape for name in shapes} == shapes
    with pytest.raises(ConfigError, match=re.escape("no tensor 'lm_head.bias'")):
        checkpoint.tensor("lm_head.bias")
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ConfigError, match=f"{re.escape(str(weights))}: not a readable safetensors"):
        open_checkpoint(str(checkpoint_dir))


def test_wrong_shape_is_named(checkpoint_dir):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = tensors[
            "model.layers.0.self_attn.k_proj.weight"
        ][:4]

    _rewrite(checkpoint_dir, shrink)
    message = re.escape(
        "tensor model.layers.0.self_attn.k_proj.weight has shape (4, 64); "
        "the model config implies (16, 64)"
    )
    with pytest.raises(ConfigError, match=message):
        _start_uni(checkpoint_dir)


def test_missing_model_path_and_wrong_kind_of_path(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("model.path is not set")):
        _start_uni_config([])
    allowed = "; allowed: an HF model directory (with config.json) or an existing .gguf file"
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match=re.escape(f"weights.bin': not a .gguf file{allowed}")):
        _start_uni(tmp_path / "weights.bin")
    with pytest.raises(ConfigError) as refused:
        _start_uni(tmp_path)
    assert (
        str(refused.value) == f"model.path = '{tmp_path}': a directory without config.json{allowed}"
    )
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match=re.escape(f"model.path = '{tmp_path}': cannot read")):
        _start_uni(tmp_path)


def _start_uni_config(overrides):
    config = load_config(
        overrides=["parallel.distributed_executor_backend=uni", *overrides], environ={}
    )
    Registry.load().get("executor", "uni").load_available()(config.config).shutdown()


def test_unsupported_gguf_type_is_named(tmp_path):
    # An importance-matrix type (256 weights in 66 bytes), which Shardline does not decode.
    embedding = (np.zeros((100, 66), dtype=np.uint8), "IQ2_XXS")
    path = write_tiny_gguf(tmp_path / "iq2.gguf", {"token_embd.weight": embedding})
    checkpoint = GGUFCheckpoint(path)
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "tensor token_embd.weight has type IQ2_XXS; supported: F32, F16, Q8_0, Q4_0, Q4_1, "
            "Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16"
        ),
    ):
        checkpoint.tensor("model.embed_tokens.weight")


#: How a GGUF header's string arrays are decoded: in Python, and in C where it was built.
STRING_READERS = [
    pytest.param(None, id="python"),
    pytest.param(
        "shardline.weights._dequantize",
        id="c",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("shardline.weights._dequantize") is None,
            reason="the C extension was not built (pip install found no compiler)",
        ),
    ),
]


@pytest.mark.parametrize("reader", STRING_READERS)
def test_gguf_string_arrays_read_whole_and_a_cut_one_is_a_clear_error(tmp_path, reader):
    """Both readers give the same strings, bytes that are not UTF-8 replaced alike, and a
    string cut short (or a count past the file) is the same clear error."""
    from shardline.weights.gguf_layout import GGUFLayout

    native = None if reader is None else importlib.import_module(reader)
    written = ["<s>", "caf\u00e9", "", "\u2581the"]
    path = write_tiny_gguf(
        tmp_path / "tokens.gguf",
        {"token_embd.weight": (np.zeros((4, 64), dtype=np.float32), None)},
        arrays={"tokenizer.ggml.tokens": written},
    )
    assert GGUFLayout.read(path, native).metadata["tokenizer.ggml.tokens"] == written
    whole = path.read_bytes()
    at = whole.index("caf\u00e9".encode())
    spoiled = tmp_path / "spoiled.gguf"
    spoiled.write_bytes(whole[: at + 3] + b"\xff" + whole[at + 4 :])  # half of the e-acute
    tokens = GGUFLayout.read(spoiled, native).metadata["tokenizer.ggml.tokens"]
    assert tokens == ["<s>", "caf\ufffd\ufffd", "", "\u2581the"]
    count_at = at - 8 - (8 + 3) - 8  # the array's count: before the first string's length
    assert int.from_bytes(whole[count_at : count_at + 8], "little") == len(written)
    for name, cut in (
        ("cut.gguf", whole[: at + 2]),  # inside the 2nd string
        (
            "counted.gguf",
            whole[:count_at] + (1 << 40).to_bytes(8, "little") + whole[count_at + 8 :],
        ),
    ):
        (tmp_path / name).write_bytes(cut)
        with pytest.raises(ValueError, match="past the end"):
            GGUFLayout.read(tmp_path / name, native)
    path.write_bytes(whole[: at + 2])
    with pytest.raises(ConfigError, match=r"not a readable GGUF file .*past the end"):
        GGUFCheckpoint(path, environ=None if reader is None else {})


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        GGUFCheckpoint(path)


ARCH = LlamaArchitecture(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=1e4,
    max_positions=64,
    tie_word_embeddings=False,
)


def test_tensor_parallel_sizes_the_model_cannot_take():
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "tensor_parallel_size = 5: does not divide the model's intermediate_size (96); "
            "allowed: 1, 2, 3, 4, 6, 8"
        ),
    ):
        check_tensor_parallel(ARCH, 5)
    with pytest.raises(
        ConfigError, match="tensor_parallel_size = 16: more than the model's 8 attention heads"
    ):
        check_tensor_parallel(ARCH, 16)
    import dataclasses

    with pytest.raises(
        ConfigError,
        match=r"num_attention_heads \(8\) is not a multiple of num_key_value_heads \(3\)",
    ):
        check_tensor_parallel(dataclasses.replace(ARCH, num_kv_heads=3), 2)
    check_tensor_parallel(ARCH, 3)  # uneven heads (3, 3, 2) are fine: 96 divides by 3


def test_a_rank_refusing_the_weights_ends_the_cli_with_exit_2_and_one_line(checkpoint_dir):
    """The ConfigError is raised inside a worker process; its type survives the trip to the
    driver, so the command ends as if it had been raised there (exit 2, one message), and
    shutting the other workers down prints nothing."""

    def shrink(tensors):
        tensors["model.layers.0.mlp.down_proj.weight"] = tensors[
            "model.layers.0.mlp.down_proj.weight"
        ][:, :8].contiguous()

    _rewrite(checkpoint_dir, shrink)
    result = shardline(
        "run",
        "x",
        "--set",
        f"model.path={checkpoint_dir}",
        "--set",
        "parallel.tensor_parallel_size=2",
        "--set",
        "parallel.communicator=gloo",
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: rank 0 raised ConfigError: failed in start-up phase 'model")
    assert "model.layers.0.mlp.down_proj.weight has shape (64, 8)" in line
