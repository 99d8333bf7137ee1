"""An LM head's greedy screen (``GreedyScreen``): each row's largest logit and its first index
found through the head's Q8_0 copy and exact bounds, always the choice of the head's own
logits (the blocked kernel's), bit for bit, whether the codes multiply rows in float32 (Q8_0
blocks) or rows quantized twice to int8 in integers (Q8_CODES_F16, AVX-512 VNNI); and where it
cannot decide, it says so."""

import numpy as np
import pytest
import torch

from shardline.layers.kernels import (
    SCREENED_ROWS_MAX,
    TORCH_KERNELS,
    GreedyScreen,
    NativeKernels,
    _q8_0_rows,
)
from support.gguf_values import file_weight, random_blocks

native_module = pytest.importorskip(
    "shardline.layers._kernels",
    reason="the C extension was not built (pip install found no compiler); torch path only",
)
pytestmark = pytest.mark.skipif(
    not native_module.quantized_linear_available(),
    reason="the screen's Q8_0 kernel needs AVX-512, or AVX2 with FMA and F16C",
)

FLOAT32 = NativeKernels(native_module, screen_kind="Q8_0")
#: Both kinds of screen, the integer one where this CPU has AVX-512 VNNI.
SCREEN_KINDS = [
    "Q8_0",
    pytest.param(
        "Q8_CODES_F16",
        marks=pytest.mark.skipif(
            not native_module.int8_dot_available(),
            reason="the screen's integer kind needs AVX-512 VNNI (this CPU has none)",
        ),
    ),
]


def _screened(kernels: NativeKernels, table: torch.Tensor) -> tuple[torch.Tensor, GreedyScreen]:
    held = kernels.pack_linear(table)
    screen = kernels.greedy_screen(table, held)
    assert isinstance(screen, GreedyScreen)
    return held, screen


def _head_choice(kernels, held, x, valid):
    """What the head's own logits choose: the largest of the first ``valid`` and its index."""
    return kernels.linear(x, held, None)[:, :valid].max(dim=-1)


def test_the_heads_q8_0_blocks_are_ggmls_and_their_sums_are_exact():
    """The C quantizer gives the gguf package's Q8_0 bytes (ggml's reference) and values for
    groups of every magnitude (float16 scales subnormal, normal and near the largest; zero
    groups; values on a code's half step), and each row's float64 sums; a group whose scale
    passes float16's range, or a value that is not finite, is refused."""
    import gguf

    generator = torch.Generator().manual_seed(7)
    rows, groups = 64, 6
    magnitudes = torch.logspace(-11, 7.5, rows * groups, dtype=torch.float64)
    values = torch.randn(rows * groups, 32, generator=generator, dtype=torch.float64)
    values = (values * magnitudes[:, None]).float().view(rows, groups * 32)
    values[3] = 0.0
    values[4, :31] = (torch.arange(31) + 0.5) * 0.25  # x * (1 / d) on a half step: away from 0
    values[4, 31] = 127 * 0.25  # d = 0.25
    finite_rows = values.abs().amax(dim=1) / 127 < 65504
    kept = values[finite_rows]
    raw, decoded, sums = _q8_0_rows(native_module, kept)
    expected_raw = gguf.quants.quantize(kept.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(raw.numpy(), expected_raw)
    expected = gguf.quants.dequantize(expected_raw, gguf.GGMLQuantizationType.Q8_0)
    # The same bits (a negative value whose code is 0 decodes to +0.0, as the blocks say).
    assert torch.equal(decoded.view(torch.int32), torch.from_numpy(expected).view(torch.int32))
    exact, held = kept.double(), decoded.double()
    expected_sums = torch.stack([((exact - held) ** 2).sum(1), (exact**2).sum(1), (held**2).sum(1)])
    torch.testing.assert_close(sums, expected_sums, rtol=1e-12, atol=0)
    assert not finite_rows.all()  # some group's scale passes float16's range
    assert _q8_0_rows(native_module, values) is None
    for bad in (float("nan"), float("inf")):
        spoiled = kept.clone()
        spoiled[1, 7] = bad
        assert _q8_0_rows(native_module, spoiled) is None


@pytest.mark.parametrize("screen_kind", SCREEN_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("out_features", [130, 490, 4160])
def test_the_screen_chooses_what_the_heads_logits_choose(screen_kind, dtype, out_features):
    """Random heads (a partial last block; four blocks at a time and fewer), 1 to 8 rows (with
    a few large inputs, as hidden states have), the whole range and one whose last outputs are
    padding: the same largest logit, bit for bit, and the same index."""
    kernels = NativeKernels(native_module, weight_dtype=dtype, screen_kind=screen_kind)
    generator = torch.Generator().manual_seed(out_features)
    table = torch.randn(out_features, 96, generator=generator) * 0.05
    held, screen = _screened(kernels, table)
    for rows in (1, 3, SCREENED_ROWS_MAX):
        x = torch.randn(rows, 96, generator=generator) * 4
        x[:, 5] *= 30
        for valid in (out_features, out_features - 9):
            best, index = screen.argmax(x, held, valid)
            expected_best, expected_index = _head_choice(kernels, held, x, valid)
            assert torch.equal(index, expected_index) and torch.equal(best, expected_best)


@pytest.mark.parametrize("screen_kind", SCREEN_KINDS)
def test_equal_rows_give_the_first_and_rows_the_codes_cannot_tell_apart_their_sums_decide(
    screen_kind,
):
    """Rows 3 and 7 equal and the largest: the first (3). Rows 5 and 9 the largest, 9 a
    little larger along x than 5 but below what the codes resolve (the same codes, so the
    same screen logit, where its first would be 5): 9, by its exact sum."""
    kernels = NativeKernels(native_module, screen_kind=screen_kind)
    generator = torch.Generator().manual_seed(1)
    table = torch.randn(64, 64, generator=generator) * 0.01
    x = torch.randn(1, 64, generator=generator)
    table[3] = table[7] = x[0] * 0.2
    held, screen = _screened(kernels, table)
    assert screen.argmax(x, held, 64)[1].tolist() == [3]
    table[5] = x[0] * 0.3
    table[9] = table[5] + x[0].sign() * 1e-6
    held, screen = _screened(kernels, table)
    raw, _, _ = _q8_0_rows(native_module, table[[5, 9]])
    assert (raw[0] == raw[1]).all()  # the same codes
    assert screen.argmax(x, held, 64)[1].tolist() == [9]


@pytest.mark.parametrize("screen_kind", SCREEN_KINDS)
def test_an_order_the_codes_reverse_is_still_the_heads(screen_kind):
    """Two rows whose codes reverse their order (row 0 is larger through the head's values,
    row 1 through their Q8_0 codes: one value rounds down by 0.49 of a step, another up by
    0.49): the screen's bounds keep row 0 in reach, and its exact sum wins."""
    step = 2.0**-7  # each group's scale: its largest value, 127 steps, in every row
    row = torch.zeros(32)
    row[0] = 127 * step
    larger, smaller = row.clone(), row.clone()
    larger[1], smaller[1] = 10.49 * step, 10.45 * step  # both code 10: larger by 0.04 steps
    larger[2], smaller[2] = 20.499 * step, 20.51 * step  # codes 20 and 21: smaller by 0.011
    table = torch.stack([larger, smaller])
    x = torch.tensor([[0.0, 1.0, 1.0] + [0.0] * 29])
    exact = table @ x[0]
    assert exact[0] > exact[1]  # the head's order
    kernels = NativeKernels(native_module, screen_kind=screen_kind)
    held, screen = _screened(kernels, table)
    _, decoded, _ = _q8_0_rows(native_module, table)
    approx = decoded @ x[0]
    assert approx[1] > approx[0]  # the codes' order, reversed
    assert screen.argmax(x, held, 2)[1].tolist() == [0]


@pytest.mark.parametrize("screen_kind", SCREEN_KINDS)
def test_an_input_below_the_rows_quantization_still_counts(screen_kind):
    """An input of 0.455 of the step a row is quantized in (its group's largest / 32512: the
    integer screen reads it as 0) that decides the order: row 1's logit is 8128 x that input
    (0.114), row 0's 0.062; through the quantized row, 0 against 0.062, further apart than the
    sums' rounding reaches. What quantizing the row missed, times row 1's norm, keeps it in
    reach (the bound's second term), and its exact sum wins; the float32 screen reads the
    input as it is."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 1.4e-5, 1.0
    table = torch.zeros(2, 32)
    table[0, 1] = 127 * 2.0**-11  # 0.062: a float16 scale of 2^-11, code 127 (exact)
    table[1, 0] = 127 * 64.0  # 8128: scale 64, code 127 (exact)
    exact = table @ x[0]
    assert exact[1] > exact[0] > 0.05 and exact[1] < 0.12
    kernels = NativeKernels(native_module, screen_kind=screen_kind)
    held, screen = _screened(kernels, table)
    assert screen.argmax(x, held, 2)[1].tolist() == [1]


@pytest.mark.parametrize("screen_kind", SCREEN_KINDS)
def test_rows_it_cannot_decide_are_left_to_the_logits(screen_kind):
    """None (compute the logits) for more rows than it pays for, a row of infinite norm, and
    more outputs in reach than a sixteenth (at least 64): all of 200 equal rows."""
    kernels = NativeKernels(native_module, screen_kind=screen_kind)
    table = torch.randn(200, 64) * 0.05
    held, screen = _screened(kernels, table)
    assert screen.argmax(torch.randn(SCREENED_ROWS_MAX + 1, 64), held, 200) is None
    infinite = torch.randn(2, 64)
    infinite[1, 5] = float("inf")
    assert screen.argmax(infinite, held, 200) is None
    equal = table[:1].repeat(200, 1)
    held, screen = _screened(kernels, equal)
    assert screen.argmax(torch.randn(1, 64), held, 200) is None
    assert screen.argmax(torch.randn(1, 64), held, 60)[1].tolist() == [0]  # 60 in reach: few


def test_no_screen_where_it_cannot_be_exact_or_the_head_is_not_blocked_floats():
    """A head with an infinite value, one held in a file's blocks, one whose inputs are not
    whole groups of 32, and the torch kernels: no screen (the head's logits decide)."""
    table = torch.randn(100, 64)
    table[7, 3] = float("inf")
    assert FLOAT32.greedy_screen(table, FLOAT32.pack_linear(table)) is None
    odd = torch.randn(100, 40)
    assert FLOAT32.greedy_screen(odd, FLOAT32.pack_linear(odd)) is None
    blocks = NativeKernels(native_module, quantized=True)
    rng = np.random.default_rng(0)
    weight = file_weight([("Q8_0", random_blocks("Q8_0", 100, 64, rng))], 100)
    held = blocks.pack_linear(weight)
    assert held.held_as == "Q8_0" and blocks.greedy_screen(weight, held) is None
    plain = torch.randn(100, 64)
    assert TORCH_KERNELS.greedy_screen(plain, TORCH_KERNELS.pack_linear(plain)) is None


def test_a_screen_kind_this_cpu_cannot_multiply_is_refused():
    """Only the two kinds, and the integer one only where this CPU has AVX-512 VNNI: refused
    when the kernels are made, not at the first greedy step."""
    with pytest.raises(ValueError, match="screen_kind = 'Q4_0': allowed: 'Q8_0', or"):
        NativeKernels(native_module, screen_kind="Q4_0")
    if not native_module.int8_dot_available():
        with pytest.raises(ValueError, match="'Q8_CODES_F16' on a CPU with AVX-512 VNNI"):
            NativeKernels(native_module, screen_kind="Q8_CODES_F16")
