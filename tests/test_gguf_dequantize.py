"""GGUF blocks decoded in C (``shardline.weights._dequantize``) give the gguf package's bits,
for each block type, for whole tensors and for the row and column cuts ranks read."""

import numpy as np
import pytest
import torch

from shardline.weights.gguf_checkpoint import NATIVE_TYPES, GGUFCheckpoint
from support.tiny_gguf import write_tiny_gguf

pytest.importorskip(
    "shardline.weights._dequantize", reason="the dequantize extension is not built (no compiler)"
)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# A down projection of 64 rows and 768 inputs: three 256-weight super-blocks a row.
ROWS, INPUTS = 64, 768
TENSOR = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """A file for each block type whose down projection is random bytes: its float16 scales
    include subnormals, infinities and NaNs, its q every value."""
    import gguf

    rng = np.random.default_rng(7)
    folder = tmp_path_factory.mktemp("gguf")
    files = {}
    for kind in NATIVE_TYPES:
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        raw = rng.integers(0, 256, (ROWS, INPUTS // block * block_bytes), dtype=np.uint8)
        tensors = {
            "token_embd.weight": (np.zeros((100, 64), dtype=np.float32), None),
            "blk.0.ffn_down.weight": (raw, kind),
        }
        files[kind] = write_tiny_gguf(folder / f"{kind}.gguf", tensors, feed_forward_length=INPUTS)
    return files


@pytest.mark.parametrize("kind", NATIVE_TYPES)
@pytest.mark.parametrize(
    "cut",
    [
        (slice(None), slice(None)),
        (slice(10, 45), slice(None)),
        (slice(None), slice(256, 768)),
        (slice(3, 50), slice(5, 77)),
    ],
    ids=["whole", "rows", "block-columns", "unaligned-columns"],
)
def test_c_decoding_gives_the_gguf_packages_bits(gguf_files, kind, cut):
    in_c = GGUFCheckpoint(gguf_files[kind], environ={}).tensor(TENSOR)[cut]
    in_numpy = GGUFCheckpoint(gguf_files[kind], environ={"SHARDLINE_NATIVE": "0"}).tensor(TENSOR)
    in_numpy = in_numpy[cut]
    assert in_c.shape == in_numpy.shape and in_c.dtype == torch.float32
    assert torch.equal(in_c.view(torch.int32), in_numpy.view(torch.int32))


def test_each_type_is_decoded_in_c_and_its_random_scales_cover_nan_and_finite(
    gguf_files, monkeypatch
):
    import gguf

    def no_numpy(*args):
        raise AssertionError("decoded by the gguf package")

    monkeypatch.setattr(gguf, "dequantize", no_numpy)
    for kind in NATIVE_TYPES:
        whole = GGUFCheckpoint(gguf_files[kind], environ={}).tensor(TENSOR)[:]
        assert whole.shape == (ROWS, INPUTS)
        assert whole.isnan().any() and whole.isfinite().any(), kind
