"""Float32 weights decoded from GGUF blocks, carrying those blocks as a rank reading a GGUF
file with ``keep_blocks`` has them (``file_blocks``: ``[(first row, type name, bytes)]``),
for the kernels that hold a weight as its file's blocks."""

import numpy as np
import torch

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


def file_weight(parts: list[tuple[str, np.ndarray]], out_features: int) -> torch.Tensor:
    """The float32 ``[out, in]`` weight whose rows from the first on are ``parts`` ((type
    name, rows of its blocks' bytes) in turn; rows past them zeros), decoded as the gguf
    package decodes them, carrying them as ``file_blocks``."""
    import gguf

    in_features = None
    decoded, blocks, first = [], [], 0
    for kind, raw in parts:
        values = gguf.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)
        in_features = values.shape[1]
        decoded.append(torch.from_numpy(values))
        blocks.append((first, kind, raw))
        first += raw.shape[0]
    padding = torch.zeros(out_features - first, in_features)
    weight = torch.cat([*decoded, padding]).contiguous()
    weight.file_blocks = blocks
    return weight


def quantized_weight(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``weight`` quantized to GGUF blocks of ``kind`` (as ``support.requantized`` writes a
    file's) and decoded again, carrying them (:func:`file_weight`)."""
    from support.requantized import quantized

    return file_weight([(kind, quantized(weight.float().numpy(), kind))], weight.shape[0])
