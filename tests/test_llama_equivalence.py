"""The parallel Llama against HF transformers on the same safetensors files: a ragged
prefill of two prompts, then a decode step through the paged KV cache, under TP=1, TP=2,
PP=2 and TP=2 x PP=2 (real gloo worlds, through the executors that ship), on the C layer
kernels (what a CPU rank runs) and on the torch ones; bfloat16 within its precision, and
float32 with linear weights rounded to bfloat16 (``model.weight_dtype``) as transformers with
its linear weights so rounded. The decode step (decodes only) runs each half of a layer in one
C call where the ranks' weights are the C linear kernel's, bit-identical to the same step run
module by module."""

import pytest
import torch

from shardline.config import load_config
from shardline.conformance.executors.probe import PROBE_RUNNER
from shardline.layers.attention import AttentionMetadata
from shardline.layers.kernels import NativeKernels, layer_kernels
from shardline.models.llama import LlamaForCausalLM
from shardline.registry import Registry
from shardline.weights.hf import HFCheckpoint
from support.tiny_llama import PROMPTS, reference_logits, write_tiny_llama

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 4


def _metadata(
    new_tokens: list[int], seq_lens: list[int], block_tables: list[list[int]]
) -> AttentionMetadata:
    starts = [0]
    slots = []
    for count, seq_len, blocks in zip(new_tokens, seq_lens, block_tables, strict=True):
        starts.append(starts[-1] + count)
        for position in range(seq_len - count, seq_len):
            slots.append(blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
    return AttentionMetadata(starts, seq_lens, torch.tensor(slots), block_tables)


def _step(model, state, caches, input_ids, positions, metadata):
    """One forward through every pipeline stage (stage hand-off done here, as a Worker will)."""
    intermediate = None
    if not state.pp.is_first_rank:
        intermediate = state.pp.recv_tensor_dict(all_gather_group=state.tp)
        from shardline.interfaces import IntermediateTensors

        intermediate = IntermediateTensors(intermediate)
    out = model(input_ids, positions, metadata, caches, intermediate)
    if not state.pp.is_last_rank:
        state.pp.send_tensor_dict(out.tensors, all_gather_group=state.tp)
        return None
    return model.compute_logits(out)


def _prefill_then_decode(
    worker, directory: str, environ: dict, dtype: str, weight_dtype: str | None
) -> dict | None:
    state = worker.state
    checkpoint = HFCheckpoint(directory)
    kernels = layer_kernels(torch.device("cpu"), environ, getattr(torch, weight_dtype or dtype))
    model = LlamaForCausalLM(checkpoint.architecture, state, getattr(torch, dtype), kernels)
    model.load_weights(checkpoint.tensor)
    caches = model.make_kv_caches(num_blocks=16, block_size=BLOCK_SIZE)
    tables = [[3, 0, 7], [5, 9]]  # deliberately scattered blocks
    ids = torch.tensor(PROMPTS[0] + PROMPTS[1])
    positions = torch.tensor(list(range(len(PROMPTS[0]))) + list(range(len(PROMPTS[1]))))
    lens = [len(p) for p in PROMPTS]
    prefill = _step(model, state, caches, ids, positions, _metadata(lens, lens, tables))
    next_ids = torch.tensor([11, 42])  # fixed decode tokens, same on every stage

    def decode_step():
        decoding = _metadata([1, 1], [n + 1 for n in lens], tables)
        return _step(model, state, caches, next_ids, torch.tensor(lens), decoding)

    decode = decode_step()
    # A step of decodes only runs each half of a layer in one call where the kernels have one;
    # the same step again (same cache writes) with the layers' modules one by one.
    fused = [layer.blocks is not None for layer in model.layers.values()]
    blocked = [layer.mlp.down_proj.weight.dim() == 1 for layer in model.layers.values()]
    held = {str(layer.mlp.down_proj.weight.dtype) for layer in model.layers.values()}
    for layer in model.layers.values():
        layer.blocks = None
    one_by_one = decode_step()
    if prefill is None:
        return None
    return {
        "prefill": prefill.float(),
        "decode": decode.float(),
        "decode_one_by_one": one_by_one.float(),
        "fused": fused,
        "blocked": blocked,
        "held": held,
        "kernels": type(kernels).__name__,
    }


# GQA with 8 query / 2 KV heads; and 9 / 3 heads (as SmolLM2), which no tp > 1 here divides.
SHAPES = {
    "gqa": {},
    "uneven": {"hidden_size": 72, "num_attention_heads": 9, "num_key_value_heads": 3},
}
#: (shape, tp, pp, kernels, dtype, weight_dtype)
CASES = [
    ("gqa", 1, 1, "C", "float32", None),
    ("gqa", 2, 1, "C", "float32", None),
    ("gqa", 1, 2, "C", "float32", None),
    ("gqa", 2, 2, "C", "float32", None),
    ("uneven", 2, 1, "C", "float32", None),
    ("uneven", 4, 1, "C", "float32", None),
    ("gqa", 1, 1, "torch", "float32", None),
    ("uneven", 2, 1, "torch", "float32", None),
    ("uneven", 2, 1, "C", "bfloat16", None),
    ("gqa", 2, 1, "C", "float32", "bfloat16"),
    ("uneven", 2, 1, "C", "float32", "bfloat16"),
    ("uneven", 2, 1, "torch", "float32", "bfloat16"),
]
#: How close each dtype's logits come to transformers' float32 ones.
TOLERANCE = {"float32": 1e-5, "bfloat16": 6e-2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        name: write_tiny_llama(tmp_path_factory.mktemp(name), **shape)
        for name, shape in SHAPES.items()
    }


@pytest.mark.parametrize(
    ("shape", "tp", "pp", "kernels", "dtype", "weight_dtype"),
    CASES,
    ids=[f"{s}-tp{t}-pp{p}-{k}-{d}" + (f"-weights-{w}" if w else "") for s, t, p, k, d, w in CASES],
)
def test_matches_transformers(checkpoints, shape, tp, pp, kernels, dtype, weight_dtype):
    if kernels == "C" and not isinstance(layer_kernels(torch.device("cpu"), {}), NativeKernels):
        pytest.skip("the C layer kernels were not built (pip install found no compiler)")
    environ = {} if kernels == "C" else {"SHARDLINE_NATIVE": "0"}
    checkpoint_dir = checkpoints[shape]
    config = load_config(
        overrides=[
            f"parallel.tensor_parallel_size={tp}",
            f"parallel.pipeline_parallel_size={pp}",
            f"model.runner={PROBE_RUNNER}",  # the ranks load nothing: the test builds the model
        ],
        environ={},
    ).config
    executor_name = "uni" if tp * pp == 1 else "mp"
    executor = Registry.load().get("executor", executor_name).load_available()(config)
    try:
        results = executor.collective_rpc(
            _prefill_then_decode, (str(checkpoint_dir), environ, dtype, weight_dtype)
        )
    finally:
        executor.shutdown()
    extended = [PROMPTS[0] + [11], PROMPTS[1] + [42]]
    rounded = getattr(torch, weight_dtype) if weight_dtype else None
    reference = reference_logits(checkpoint_dir, extended, linear_weights=rounded)
    expected_prefill = torch.cat([reference[0][:-1], reference[1][:-1]])
    expected_decode = torch.stack([reference[0][-1], reference[1][-1]])
    last_stage = results[(pp - 1) * tp :]
    assert all(r is None for r in results[: (pp - 1) * tp])
    close = TOLERANCE[dtype]
    # A layer is fused where its weights are the C linear kernel's (float32, AVX-512 or AVX2;
    # held in bfloat16 with weight_dtype bfloat16), under uni (its threads sharing each linear)
    # as in each mp rank.
    blocks_here = (
        kernels == "C" and dtype == "float32"
        and layer_kernels(torch.device("cpu"), {}).native.blocked_linear_available()
    )  # fmt: skip
    for result in last_stage:  # every TP rank of the last stage has the full logits
        assert result["kernels"] == ("NativeKernels" if kernels == "C" else "TorchKernels")
        assert result["fused"] == result["blocked"]
        assert all(result["blocked"]) or not blocks_here
        held = weight_dtype if blocks_here and weight_dtype else dtype
        assert result["held"] == {f"torch.{held}"}
        assert torch.equal(result["decode"], result["decode_one_by_one"])
        torch.testing.assert_close(result["prefill"], expected_prefill, atol=close, rtol=close)
        torch.testing.assert_close(result["decode"], expected_decode, atol=close, rtol=close)
        if dtype == "float32":
            assert torch.equal(result["decode"].argmax(-1), expected_decode.argmax(-1))
