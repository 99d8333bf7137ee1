"""``model.activation_dtype: int8`` with ``weight_dtype: gguf``: weights of the file's 4-bit types
held as codes (``Q4_CODES_F16`` for Q4_0 and Q4_1, ``Q4_CODES`` for Q4_K), and of its types of
one scale per 32 weights (Q8_0, Q5_0, IQ4_NL) as 8-bit codes (``Q8_CODES_F16``), multiplied
by their inputs quantized to int8 per 16, in integers. The kernel gives that arithmetic's
sums (against a float64 reference of the same rounded inputs), the same bits on the AVX2
kernels and on a team, at the codes' extremes too; a non-finite input spoils only its row;
the plan counts the codes' bytes; SmolLM2 keeps float32's top choice almost everywhere, and
the config refuses the mode without gguf."""

import numpy as np
import pytest
import torch

from shardline.config import load_config
from shardline.engine import LLM, SamplingParams
from shardline.errors import ConfigError
from shardline.layers.kernels import NativeKernels
from shardline.models.memory import HeldBlocks, HeldKind, block_bytes, merged_block_bytes
from support.cpu_flags import has_avx2_f16c
from support.gguf_values import file_weight, random_blocks
from support.memory_probe import bytes_held
from support.smollm2 import smollm2_gguf

native = pytest.importorskip("shardline.layers._kernels", reason="C extension not built")
needs_code_kernels = pytest.mark.skipif(
    not native.quantized_linear_available(),
    reason="weights held as codes need AVX-512, or AVX2 with FMA and F16C",
)
CODES = NativeKernels(native, quantized=True, codes=True)
CODE_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "IQ4_NL")
#: The code kind each type is held in first.
CODE_KIND_OF = {
    "Q4_0": "Q4_CODES_F16", "Q4_1": "Q4_CODES_F16", "Q4_K": "Q4_CODES",
    "Q8_0": "Q8_CODES_F16", "Q5_0": "Q8_CODES_F16", "IQ4_NL": "Q8_CODES_F16",
}  # fmt: skip
#: Inputs that share one int8 scale.
ACTIVATION_GROUP = 16


def _quantized_inputs(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it: per 16 inputs, s = largest |x| / 127 (float32) and each input
    s times round(x / s) (to nearest, ties to even), in float64."""
    groups = x.view(x.shape[0], -1, ACTIVATION_GROUP)
    scale = groups.abs().amax(-1, keepdim=True) / 127.0
    codes = torch.round(groups / torch.where(scale > 0, scale, 1.0)).clamp(-127, 127)
    return (codes.double() * scale.double()).view(x.shape)


def _blocked(held, x, bias, avx2):
    out_features, in_features = held.blocked_shape
    y = torch.empty(x.shape[0], out_features)
    native.blocked_linear(
        held.data_ptr(), x.data_ptr(), y.data_ptr(), 0 if bias is None else bias.data_ptr(),
        x.shape[0], out_features, in_features, None, held.weight_kind,
        native.KERNELS_AVX2 if avx2 else native.KERNELS_CHOSEN,
    )  # fmt: skip
    return y


def _holds(kind: int, weight) -> bool:
    """Whether ``kind`` (a WEIGHT_* code) holds weight's file blocks (each value checked)."""
    out_features, in_features = weight.shape
    place = torch.zeros(native.quantized_size(kind, out_features, in_features), dtype=torch.uint8)
    parts = [(type_name, raw.ctypes.data, raw.strides[0], first, raw.shape[0])
             for first, type_name, raw in weight.file_blocks]  # fmt: skip
    loaded = (weight.data_ptr(), *weight.stride())
    return native.pack_file_blocks(kind, place.data_ptr(), out_features, in_features, loaded,
                                   parts, None)  # fmt: skip


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 16, 65])  # tiles of 4 rows and 1, 2, 3 left
@pytest.mark.parametrize("file_type", CODE_TYPES)
@needs_code_kernels
def test_weights_held_as_codes_multiply_int8_inputs_in_integers(file_type, rows):
    rng = np.random.default_rng([CODE_TYPES.index(file_type), rows])
    shapes = [(130, 512), (7, 256)] if file_type == "Q4_K" else [(100, 64), (130, 576), (7, 96)]
    for out_features, in_features in shapes:
        blocks = random_blocks(file_type, out_features, in_features, rng)
        weight = file_weight([(file_type, blocks)], out_features)
        held = CODES.pack_linear(weight)
        kind = CODE_KIND_OF[file_type]
        assert held.held_as == kind and held.dtype is torch.uint8
        assert held.numel() == block_bytes(kind, out_features, in_features)
        x, bias = torch.randn(rows, in_features), torch.randn(out_features)
        y = CODES.linear(x, held, bias)
        rounded = _quantized_inputs(x)
        expected = rounded @ weight.double().T + bias.double()
        # float32 sums of the terms: within a few units in the last place of their magnitude.
        magnitude = rounded.abs() @ weight.double().abs().T + bias.double().abs()
        assert ((y.double() - expected).abs() <= 1e-6 * magnitude).all()
        # Not the float32 product: the inputs were rounded.
        assert not torch.equal(y, torch.nn.functional.linear(x, weight, bias))
        team = NativeKernels(native, threads=3, quantized=True, codes=True)
        assert torch.equal(team.linear(x, held, bias), y)
        if has_avx2_f16c():
            assert torch.equal(_blocked(held, x, bias, avx2=True), y)


@needs_code_kernels
def test_8_bit_codes_at_their_extremes_give_exact_sums_on_both_kernels():
    """Q8_0's q of -128 (even rows) and 127 (odd rows) against inputs that all round to codes
    of 127 (or all to -127): the AVX2 kernel's int16 pairs (2 x 128 x 127, the most they
    hold) stay exact, the AVX-512 kernel's codes q + 128 (0 and 255) come back to q through
    the inputs' code totals, and both give the same bits."""
    rng = np.random.default_rng(13)
    blocks = random_blocks("Q8_0", 64, 64, rng)
    q = np.where(np.arange(64)[:, None] % 2 == 0, -128, 127) * np.ones((1, 32), dtype=int)
    for block in (0, 1):  # each row's two blocks: scale 0.5
        blocks[:, 34 * block : 34 * block + 2] = np.frombuffer(
            np.float16(0.5).tobytes(), dtype=np.uint8
        )
        blocks[:, 34 * block + 2 : 34 * block + 34] = q.astype(np.int8).view(np.uint8)
    weight = file_weight([("Q8_0", blocks)], 64)
    assert set(weight.unique().tolist()) == {-64.0, 63.5}
    held = CODES.pack_linear(weight)
    assert held.held_as == "Q8_CODES_F16"
    x = torch.ones(2, 64)
    x[1] = -1.0
    y = CODES.linear(x, held, None)
    exact = x.double() @ weight.double().T  # +-64 x 64 or +-63.5 x 64
    assert ((y.double() - exact).abs() <= 1e-6 * exact.abs()).all()
    if has_avx2_f16c():
        assert torch.equal(_blocked(held, x, None, avx2=True), y)


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@needs_code_kernels
def test_4_bit_codes_at_their_extreme_give_exact_sums(rows):
    """Q4_1 codes all 15 against inputs that all round to codes of 127 (or -127, alternate
    rows): one or two rows (every group read once, the AVX2 kernel's int16 sums over an
    activation group's 16 inputs: 16 x 15 x 127 in two lanes, 15240 each) and three or four
    (each half of a block's outputs in turn, int32 sums) give exact sums and the AVX-512
    kernel's bits."""
    rng = np.random.default_rng(17)
    blocks = random_blocks("Q4_1", 64, 128, rng)
    for block in range(4):  # each row's four blocks: d 0.5, m 0.25, every nibble 15
        at = 20 * block
        blocks[:, at : at + 2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)
        blocks[:, at + 2 : at + 4] = np.frombuffer(np.float16(0.25).tobytes(), dtype=np.uint8)
        blocks[:, at + 4 : at + 20] = 0xFF
    weight = file_weight([("Q4_1", blocks)], 64)
    assert set(weight.unique().tolist()) == {7.75}
    held = CODES.pack_linear(weight)
    assert held.held_as == "Q4_CODES_F16"
    x = torch.ones(rows, 128)
    x[1::2] = -1.0
    y = CODES.linear(x, held, None)
    exact = x.double() @ weight.double().T  # +-7.75 x 128
    assert ((y.double() - exact).abs() <= 1e-6 * exact.abs()).all()
    if has_avx2_f16c():
        assert torch.equal(_blocked(held, x, None, avx2=True), y)


@needs_code_kernels
def test_a_q4_0_offset_float16_cannot_hold_takes_q4_0s_exact_kind():
    """Q4_0's -8 is held as an offset of -8 scales: a scale of 10000 makes one float16
    cannot hold (-80000), so the weight takes Q4_0's own kind (float32's bits, fewer bytes
    than the plan, which cannot see scales, counts for the code kind)."""
    rng = np.random.default_rng(11)
    blocks = random_blocks("Q4_0", 64, 64, rng)
    blocks[:, 0:2] = np.frombuffer(np.float16(10000.0).tobytes(), dtype=np.uint8)
    weight = file_weight([("Q4_0", blocks)], 64)
    assert weight.abs().max() >= 10000.0
    assert not _holds(native.WEIGHT_Q4_CODES_F16, weight)
    assert not _holds(native.WEIGHT_Q4_CODES, weight)  # Q4_K's code kind alone
    held = CODES.pack_linear(weight)
    assert held.held_as == "Q4_0"
    x = torch.randn(2, 64)
    exact = NativeKernels(native)
    assert torch.equal(
        CODES.linear(x, held, None),
        exact.linear(x, exact.pack_linear(weight.detach().clone()), None),
    )
    assert HeldBlocks.of({"blk.0.ffn_down.weight": "Q4_0"}, tied=True, codes=True).down.kind \
        == "Q4_CODES_F16"  # fmt: skip


@pytest.mark.parametrize("scale", [3 * 2.0**-24, 2.0**-14, -0.5, 8188.0, 8190.0])
@needs_code_kernels
def test_q4_0_offsets_are_held_in_float16_wherever_it_holds_them(scale):
    """-8 scales in float16, from a subnormal scale to the largest whose -8 scales float16
    holds (8188: -65504) and a negative one (codes of 8 give +0 where the decoder gives -0);
    past it (8190), Q4_0's own kind."""
    blocks = random_blocks("Q4_0", 64, 64, np.random.default_rng(12))
    blocks[:, 0:2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    blocks[:, 18:20] = blocks[:, 0:2]  # each row's second block
    weight = file_weight([("Q4_0", blocks)], 64)
    held = CODES.pack_linear(weight)
    assert held.held_as == ("Q4_CODES_F16" if scale < 8189 else "Q4_0")
    x = torch.randn(3, 64)
    rounded = _quantized_inputs(x) if scale < 8189 else x.double()
    magnitude = rounded.abs() @ weight.double().abs().T
    error = (CODES.linear(x, held, None).double() - rounded @ weight.double().T).abs()
    assert (error <= 1e-6 * magnitude).all()


@needs_code_kernels
def test_a_non_finite_input_spoils_only_its_row():
    rng = np.random.default_rng(9)
    weight = file_weight([("Q4_1", random_blocks("Q4_1", 64, 64, rng))], 64)
    held = CODES.pack_linear(weight)
    x = torch.randn(3, 64)
    x[1, 5] = float("inf")
    y = CODES.linear(x, held, None)
    assert y[1].isnan().all()
    assert torch.isfinite(y[[0, 2]]).all()


@needs_code_kernels
def test_other_types_keep_their_exact_kinds():
    rng = np.random.default_rng(3)
    weight = file_weight([("Q6_K", random_blocks("Q6_K", 64, 256, rng))], 64)
    held = CODES.pack_linear(weight)
    assert held.held_as == "Q6_K"
    x = torch.randn(2, 256)
    assert torch.equal(CODES.linear(x, held, None), NativeKernels(native).linear(
        x, NativeKernels(native).pack_linear(weight.detach().clone()), None
    ))  # fmt: skip


@needs_code_kernels
def test_a_merged_weight_holds_its_4_bit_part_as_codes_in_a_segment():
    """A Q4_K_M file's query rows (Q4_K) and value rows (Q6_K) in one weight: the queries as
    codes multiplying int8 inputs, the values in Q6_K blocks giving float32's bits."""
    rng = np.random.default_rng(4)
    parts = [("Q4_K", random_blocks("Q4_K", 64, 256, rng)),
             ("Q6_K", random_blocks("Q6_K", 64, 256, rng))]  # fmt: skip
    weight = file_weight(parts, 128)
    held = CODES.pack_linear(weight)
    assert held.held_as == "Q4_CODES+Q6_K" and held.weight_kind == native.WEIGHT_SEGMENTED
    x = torch.randn(3, 256)
    y = CODES.linear(x, held, None)
    exact = NativeKernels(native)
    assert torch.equal(y[:, 64:], exact.linear(x, exact.pack_linear(weight[64:].clone()), None))
    rounded = _quantized_inputs(x) @ weight[:64].double().T
    magnitude = _quantized_inputs(x).abs() @ weight[:64].double().abs().T
    assert ((y[:, :64].double() - rounded).abs() <= 1e-6 * magnitude).all()


@needs_code_kernels
def test_a_merged_weight_of_4_and_8_bit_types_holds_both_as_codes_in_segments():
    """Q4_1 rows and Q8_0 rows in one weight: each part in its own code kind, one quantized
    input for both, the bytes the plan counts for that layer."""
    rng = np.random.default_rng(5)
    parts = [("Q4_1", random_blocks("Q4_1", 64, 256, rng)),
             ("Q8_0", random_blocks("Q8_0", 64, 256, rng))]  # fmt: skip
    weight = file_weight(parts, 128)
    held = CODES.pack_linear(weight)
    assert held.held_as == "Q4_CODES_F16+Q8_CODES_F16"
    plan = HeldKind.of([["Q4_1", "Q8_0"]], codes=True)
    assert held.numel() == merged_block_bytes(plan, [64, 64], 256)
    x = torch.randn(3, 256)
    y = CODES.linear(x, held, None)
    rounded = _quantized_inputs(x)
    magnitude = rounded.abs() @ weight.double().abs().T
    assert ((y.double() - rounded @ weight.double().T).abs() <= 1e-6 * magnitude).all()
    if has_avx2_f16c():
        assert torch.equal(_blocked(held, x, None, avx2=True), y)


def test_the_plan_holds_types_as_codes_only_when_asked():
    types = {"blk.0.attn_q.weight": "Q4_1", "blk.0.ffn_down.weight": "Q4_K",
             "blk.0.attn_v.weight": "Q6_K", "token_embd.weight": "Q8_0"}  # fmt: skip
    plain, codes = HeldBlocks.of(types, tied=True), HeldBlocks.of(types, tied=True, codes=True)
    assert (plain.down.kind, codes.down.kind) == ("Q4_K", "Q4_CODES")
    # The merged q/k/v: Q4_1 queries and Q6_K values need a kind holding both either way.
    assert plain.qkv.kind == codes.qkv.kind == "INT8_SCALED"
    assert (plain.head.kind, codes.head.kind) == ("Q8_0", "Q8_CODES_F16")
    assert block_bytes("Q4_CODES", 64, 32) == block_bytes("Q4_K", 64, 32) == 64 * 24
    assert block_bytes("Q8_CODES_F16", 64, 32) == block_bytes("Q8_0", 64, 32) == 64 * 34
    q4_1 = {"blk.0.attn_q.weight": "Q4_1", "blk.0.attn_k.weight": "Q4_1",
            "blk.0.attn_v.weight": "Q4_1", "token_embd.weight": "Q8_0"}  # fmt: skip
    assert HeldBlocks.of(q4_1, tied=True, codes=True).qkv.kind == "Q4_CODES_F16"
    assert block_bytes("Q4_CODES_F16", 64, 32) == block_bytes("Q4_1", 64, 32) == 64 * 20


def test_int8_activations_need_gguf_blocks():
    with pytest.raises(ConfigError) as raised:
        load_config(overrides=["model.activation_dtype=int8"], environ={})
    assert "activation_dtype = 'int8' with weight_dtype = None: allowed: activation_dtype " \
        "null, or 'int8' with weight_dtype 'gguf'" in str(raised.value)  # fmt: skip
    with pytest.raises(ConfigError, match=r"activation_dtype"):
        load_config(overrides=["model.activation_dtype=int4"], environ={})


@pytest.mark.timeout(600)
@needs_code_kernels
def test_smollm2_with_int8_activations_keeps_float32s_top_choice_almost_everywhere():
    """TP=2 on the Q4_1 file: every layer's weights held as codes, as the plan counted them;
    teacher-forced on float32's greedy answers, the int8 mode picks the same next token at
    nine positions in ten or more (benchmarks/dtype_agreement.py: 0.984 on held-out prompts)."""
    path = smollm2_gguf()
    questions = ["What is the capital of France?", "Name three colours of the rainbow."]
    with LLM(overrides=[f"model.path={path}"], environ={}) as llm:
        prompts = [llm.tokenizer.encode(q) for q in questions]
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        reference = [list(out.token_ids) for out in llm.generate(prompts, params)]
    overrides = [
        f"model.path={path}", "model.weight_dtype=gguf", "model.activation_dtype=int8",
        "parallel.tensor_parallel_size=2",
    ]  # fmt: skip
    with LLM(overrides=overrides, environ={}) as llm:
        planned = {r: share for share in llm.engine.capacity.shares for r in share.ranks}
        for rank, (parameters, _) in enumerate(llm.engine.executor.collective_rpc(bytes_held)):
            assert parameters == planned[rank].memory.weights
        prefixes = [p + ref[:k] for p, ref in zip(prompts, reference, strict=True)
                    for k in range(len(ref))]  # fmt: skip
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        chosen = [out.token_ids[0] for out in llm.generate(prefixes, one)]
    expected = [token for ref in reference for token in ref]
    agreement = sum(a == b for a, b in zip(chosen, expected, strict=True)) / len(expected)
    assert agreement >= 0.9, agreement
