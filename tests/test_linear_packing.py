"""Linear weights packed for oneDNN: the same products as ``F.linear`` (float32 to rounding,
bfloat16 to its precision), at the row counts a decode step has, and weights that cannot be
packed left as they are."""

import pytest
import torch
import torch.nn.functional as F

from shardline.layers.kernels import linear, packed, packs

needs_onednn = pytest.mark.skipif(
    not packs("cpu", "float32"), reason="this torch has no oneDNN linear packing"
)


@needs_onednn
@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=str
)
@pytest.mark.parametrize("rows", [1, 5, 16, 40])
def test_a_packed_weight_multiplies_as_f_linear(dtype, tolerance, rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    x = torch.randn(rows, 64, generator=generator).to(dtype)
    blocked = packed(weight)
    assert blocked.is_mkldnn is packs("cpu", str(dtype).removeprefix("torch."))
    assert tuple(blocked.shape) == (96, 64)
    expected = F.linear(x.float(), weight.float(), bias.float())
    got = linear(x, blocked, bias)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


def test_weights_that_cannot_be_packed_stay_as_they_are():
    half = torch.randn(8, 4, dtype=torch.float16)
    assert packed(half) is half
    assert not packs("cuda", "float32") and not packs("cpu", "float16")
    plain = torch.randn(8, 4)
    x = torch.randn(3, 4)
    if not packs("cpu", "float32"):
        assert packed(plain) is plain
    assert torch.equal(linear(x, plain, None), F.linear(x, plain))


def test_bfloat16_weights_multiply_where_the_cpu_cannot_pack_them():
    """Without oneDNN's bfloat16 instructions (an AVX2-only CPU) a bfloat16 weight stays
    plain rather than failing to pack; with them it is packed. It multiplies either way."""
    weight = torch.randn(32, 16).to(torch.bfloat16)
    x = torch.randn(2, 16).to(torch.bfloat16)
    laid_out = packed(weight)
    assert laid_out.is_mkldnn is packs("cpu", "bfloat16")
    assert (laid_out is weight) is not packs("cpu", "bfloat16")
    torch.testing.assert_close(
        linear(x, laid_out, None).float(), F.linear(x.float(), weight.float()), rtol=3e-2, atol=3e-2
    )
