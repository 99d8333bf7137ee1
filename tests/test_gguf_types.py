"""The block types of today's GGUF files, end to end: SmolLM2 quantized again the way
llama.cpp's Q4_K_M mixes types (K super-blocks where a row holds whole ones, Q5_0 / Q5_1 /
Q8_0 where it does not, a BF16 embedding) answers as transformers does with the same file."""

import pytest
import torch

from shardline.engine import LLM, SamplingParams
from shardline.tokenizer import Tokenizer
from shardline.weights.gguf_checkpoint import GGUFCheckpoint
from support.memory_probe import bytes_held
from support.quick_gguf import quick_gguf_reading
from support.requantized import requantized_copy
from support.smollm2 import smollm2_gguf

pytestmark = pytest.mark.timeout(600)

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
NEW_TOKENS = 24
DOWN_KINDS = ("Q4_K", "Q5_K", "Q6_K")


def mixed_kind(name: str, shape: tuple) -> str:
    """Each layer's down projection (1536 inputs: six super-blocks) in a K type, by turns;
    the value projection Q8_0, the other projections Q5_0 and Q5_1 by turns (576 inputs: no
    whole super-block); the embedding BF16; the norms float32."""
    if len(shape) < 2 or shape[0] == 1:
        return "F32"
    if name == "token_embd.weight":
        return "BF16"
    layer, tensor = int(name.split(".")[1]), name.split(".")[2]
    if tensor == "ffn_down":
        return DOWN_KINDS[layer % len(DOWN_KINDS)]
    if tensor == "attn_v":
        return "Q8_0"
    return "Q5_0" if layer % 2 == 0 else "Q5_1"


def test_a_k_quant_mix_answers_as_transformers_does_with_the_same_file(tmp_path):
    path = requantized_copy(smollm2_gguf(), tmp_path / "SmolLM2-mixed.gguf", mixed_kind)
    types = set(GGUFCheckpoint(path).tensor_types().values())
    assert types == {"F32", "BF16", "Q8_0", "Q5_0", "Q5_1", *DOWN_KINDS}

    from transformers import AutoModelForCausalLM

    # Shardline's tokenizer: test_smollm2 shows its chat prompts are transformers' ids.
    tokenizer = Tokenizer.from_gguf(GGUFCheckpoint(path))
    with quick_gguf_reading():
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    expected = []
    for question in QUESTIONS:
        prompt = tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": question}])
        )
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(out[0, len(prompt) :].tolist())
    del model

    # float32, and held in the file's blocks (merged projections of mixed types, Q5_1 with
    # Q8_0 say, held as their blocks split): the same tokens; the plan exact for float32,
    # an upper bound for blocks (it plans each weight in its widest kind over the layers).
    parameter_bytes = {}
    for weight_dtype in ("float32", "gguf"):
        overrides = [
            f"model.path={path}",
            "parallel.tensor_parallel_size=2",
            f"model.weight_dtype={weight_dtype}",
        ]
        with LLM(overrides=overrides, environ={}) as llm:
            planned = {r: share for share in llm.engine.capacity.shares for r in share.ranks}
            held = llm.engine.executor.collective_rpc(bytes_held)
            for rank, (parameters, _) in enumerate(held):
                assert parameters <= planned[rank].memory.weights
                assert parameters == planned[rank].memory.weights or weight_dtype == "gguf"
            parameter_bytes[weight_dtype] = [parameters for parameters, _ in held]
            answers = llm.chat(
                [[{"role": "user", "content": q}] for q in QUESTIONS],
                SamplingParams(max_tokens=NEW_TOKENS),
            )
        assert [answer.token_ids for answer in answers] == expected, weight_dtype
    assert all(len(tokens) > 4 for tokens in expected)
    # The BF16 embedding (and its float32 head copy) is most of what stays.
    for blocks, float32 in zip(parameter_bytes["gguf"], parameter_bytes["float32"], strict=True):
        assert blocks < 0.75 * float32


def one_kind_a_weight(name: str, shape: tuple) -> str:
    """Every projection Q5_1 but the down projections, Q4_K; the tied embedding (the head)
    Q5_0; the norms float32."""
    if len(shape) < 2 or shape[0] == 1:
        return "F32"
    if name == "token_embd.weight":
        return "Q5_0"
    return "Q4_K" if name.endswith("ffn_down.weight") else "Q5_1"


def test_weights_are_held_in_their_files_blocks_with_the_float32_models_bits(tmp_path):
    """``model.weight_dtype: gguf`` at TP=2 on a file of K and legacy types: the Q5_1
    projections held as Q5_K (nibbles and fifth bits), the Q4_K down projections
    as Q4_K, the Q5_0 head in Q8_0 blocks, each as the plan counted it, and the answers and
    log-probabilities are the float32 model's, bit for bit."""
    kernels = pytest.importorskip("shardline.layers._kernels", reason="C extension not built")
    if not kernels.quantized_linear_available():
        pytest.skip("weights held in quantization blocks need AVX-512 or AVX2 with F16C")
    path = requantized_copy(smollm2_gguf(), tmp_path / "SmolLM2-K.gguf", one_kind_a_weight)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    found = {}
    for weight_dtype in ("float32", "gguf"):
        overrides = [
            f"model.path={path}",
            f"model.weight_dtype={weight_dtype}",
            "parallel.tensor_parallel_size=2",
        ]
        with LLM(overrides=overrides, environ={}) as llm:
            held = llm.engine.executor.collective_rpc("weight_bytes_per_step")
            planned = {r: share for share in llm.engine.capacity.shares for r in share.ranks}
            for rank, (parameters, _) in enumerate(llm.engine.executor.collective_rpc(bytes_held)):
                assert parameters == planned[rank].memory.weights
            answers = llm.chat(conversations, SamplingParams(max_tokens=NEW_TOKENS, logprobs=2))
        found[weight_dtype] = held, [(a.token_ids, [(t.logprob, t.top) for t in a.logprobs])
                                     for a in answers]  # fmt: skip
    (blocks_held, blocks_answers), (float32_held, float32_answers) = found["gguf"], found["float32"]
    assert blocks_answers == float32_answers
    assert all(len(tokens) > 4 for tokens, _ in blocks_answers)
    # 28 bytes for 32 weights (Q4_K's 24 for the downs, Q8_0's 34 for the head), against 128
    # (and float32's greedy step reads its head's Q8_0 screen: 0.26 in all).
    assert all(0.24 < b / f < 0.28 for b, f in zip(blocks_held, float32_held, strict=True))
