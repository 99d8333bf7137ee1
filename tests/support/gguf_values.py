"""Float32 weights whose values are those of GGUF quantization blocks: what a GGUF file's
Q8_0, Q4_0, Q4_1 or Q5_0 tensor decodes to, made here by quantizing as GGML's reference quantizer
does (32 inputs of a row share a float16 scale; Q4_1 a float16 minimum too) and decoding as
the gguf package does (one float32 multiply, for Q4_1 one add)."""

import numpy as np
import torch

GROUP = 32


def gguf_valued(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``weight`` (``[out, in]``, in a multiple of 32) quantized to blocks of ``kind`` and
    decoded back to float32."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // GROUP, GROUP)
    if kind == "Q8_0":
        scale = (groups.abs().amax(-1, keepdim=True) / 127).half().float()
        q = _divided(groups, scale).round().clamp(-127, 127) + 0.0
        values = scale * q
    elif kind == "Q4_0":
        widest = groups.gather(-1, groups.abs().argmax(-1, keepdim=True))
        scale = (widest / -8).half().float()
        q = (_divided(groups, scale) + 8).round().clamp(0, 15) + 0.0
        values = scale * (q - 8)
    elif kind == "Q5_0":
        widest = groups.gather(-1, groups.abs().argmax(-1, keepdim=True))
        scale = (widest / -16).half().float()
        q = (_divided(groups, scale) + 16).round().clamp(0, 31) + 0.0
        values = scale * (q - 16)
    elif kind == "Q4_1":
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale, minimum = ((high - low) / 15).half().float(), low.half().float()
        q = _divided(groups - low, scale).round().clamp(0, 15) + 0.0
        values = scale * q + minimum
    else:
        raise ValueError(f"kind {kind!r}; allowed: Q8_0, Q4_0, Q4_1, Q5_0")
    return values.reshape(out_features, in_features).contiguous()


def _divided(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values / scale, 0 where the scale is; rounded by the caller, whose q are then made
    whole numbers without a sign on zero (as a file's integers are: + 0.0 turns -0 into 0)."""
    return torch.where(scale == 0, torch.zeros_like(values), values / scale)


#: Byte offsets of each GGUF block type's float16 fields (scales, minimums).
_HALF_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip


def random_blocks(kind: str, rows: int, inputs: int, generator: np.random.Generator) -> np.ndarray:
    """``rows`` rows of ``inputs`` weights as random GGUF blocks of ``kind`` (bytes, as a
    file holds them): every q and packed scale random, the float16 fields small finite
    numbers."""
    import gguf

    values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = generator.integers(0, 256, (rows, inputs // values, block_bytes), dtype=np.uint8)
    for at in _HALF_FIELDS[kind]:
        halves = (generator.standard_normal(raw.shape[:2]) * 0.02).astype(np.float16)
        raw[:, :, at : at + 2] = halves.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)
