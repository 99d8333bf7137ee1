"""GGUF blocks decoded in C (``shardline.weights._dequantize``) give the gguf package's bits,
for each block type, for whole tensors and for the row and column cuts ranks read."""

import numpy as np
import pytest
import torch

from shardline.weights.gguf_checkpoint import GGUFCheckpoint
from support.tiny_gguf import write_tiny_gguf

pytest.importorskip(
    "shardline.weights._dequantize", reason="the dequantize extension is not built (no compiler)"
)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# Random bytes: the float16 scales include subnormals, infinities and NaNs.
KINDS = {"ffn_up": ("Q8_0", 34), "ffn_gate": ("Q4_0", 18), "ffn_down": ("Q4_1", 20)}
ROWS, BLOCKS_PER_ROW = 70, 6  # 192 columns


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    rng = np.random.default_rng(7)
    tensors = {"token_embd.weight": (np.zeros((100, 64), dtype=np.float32), None)}
    for name, (kind, block_bytes) in KINDS.items():
        raw = rng.integers(0, 256, (ROWS, BLOCKS_PER_ROW * block_bytes), dtype=np.uint8)
        tensors[f"blk.0.{name}.weight"] = (raw, kind)
    path = tmp_path_factory.mktemp("gguf") / "kinds.gguf"
    return write_tiny_gguf(path, tensors, feed_forward_length=BLOCKS_PER_ROW * 32)


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize(
    "cut",
    [
        (slice(None), slice(None)),
        (slice(10, 45), slice(None)),
        (slice(None), slice(64, 160)),
        (slice(3, 50), slice(5, 77)),
    ],
    ids=["whole", "rows", "block-columns", "unaligned-columns"],
)
def test_c_decoding_gives_the_gguf_packages_bits(gguf_file, name, cut):
    hf_name = {"ffn_up": "mlp.up_proj", "ffn_gate": "mlp.gate_proj", "ffn_down": "mlp.down_proj"}
    tensor = f"model.layers.0.{hf_name[name]}.weight"
    in_c = GGUFCheckpoint(gguf_file, environ={}).tensor(tensor)[cut]
    in_numpy = GGUFCheckpoint(gguf_file, environ={"SHARDLINE_NATIVE": "0"}).tensor(tensor)[cut]
    assert in_c.shape == in_numpy.shape and in_c.dtype == torch.float32
    assert torch.equal(in_c.view(torch.int32), in_numpy.view(torch.int32))
    assert in_c.isnan().any() and in_c.isfinite().any()  # the scales covered both
