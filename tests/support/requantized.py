"""Real GGUF files in the block types the catalog's model lacks: the model's own values
quantized again, tensor by tensor, to the type a rule picks (``requantized_copy``), the way
llama.cpp's Q4_K_M mixes types. The gguf package writes Q8_0, Q5_0, Q5_1 and BF16; Q4_K, Q5_K
and Q6_K are written here, plainly (each group's scale and minimum from its range, no search
for the best ones as llama.cpp's quantizer makes): any such blocks are a valid file, decoded
by every reader alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from support.quick_gguf import quick_gguf_reading

SUPER_BLOCK = 256


def _half(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to float16 and widened back (what the file's scales decode to)."""
    return values.astype(np.float16).astype(np.float32)


def _divided(values: np.ndarray, by: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(by == 0, 0.0, values / by)


def _super_blocks(rows: np.ndarray, group: int) -> np.ndarray:
    """``[rows, in]`` float32 as ``[blocks, 256 // group, group]``."""
    if rows.shape[-1] % SUPER_BLOCK:
        raise ValueError(f"{rows.shape[-1]} inputs are not whole super-blocks of {SUPER_BLOCK}")
    return rows.astype(np.float32).reshape(-1, SUPER_BLOCK // group, group)


def _k_scales(values: np.ndarray, levels: int):
    """Q4_K / Q5_K: each group of 32's 6-bit scale and minimum under the super-block's float16
    d and dmin, and its q (0 to ``levels``)."""
    low = np.minimum(values.min(-1), 0.0)
    step, offset = (values.max(-1) - low) / levels, -low
    d = _half(step.max(-1, keepdims=True) / 63)
    dmin = _half(offset.max(-1, keepdims=True) / 63)
    scales = np.clip(np.round(_divided(step, d)), 0, 63).astype(np.uint8)
    minimums = np.clip(np.round(_divided(offset, dmin)), 0, 63).astype(np.uint8)
    group_scale = (d * scales)[..., None]
    group_min = (dmin * minimums)[..., None]
    q = np.clip(np.round(_divided(values + group_min, group_scale)), 0, levels).astype(np.uint8)
    packed = np.zeros((values.shape[0], 12), np.uint8)
    packed[:, 0:4] = (scales[:, :4] & 63) | (scales[:, 4:] >> 4) << 6
    packed[:, 4:8] = (minimums[:, :4] & 63) | (minimums[:, 4:] >> 4) << 6
    packed[:, 8:12] = (scales[:, 4:] & 15) | (minimums[:, 4:] & 15) << 4
    header = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                             dmin.astype(np.float16).view(np.uint8).reshape(-1, 2), packed],
                            axis=1)  # fmt: skip
    return header, q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Groups of 32 q (``[blocks, 8, 32]``) as 128 bytes: groups 2c and 2c + 1 in byte c*32+l."""
    low, high = q[:, 0::2] & 15, q[:, 1::2] & 15
    return (low | high << 4).reshape(q.shape[0], -1)


def q4_k(rows: np.ndarray) -> np.ndarray:
    values = _super_blocks(rows, 32)
    header, q = _k_scales(values, 15)
    return np.concatenate([header, _nibbles(q)], axis=1).reshape(rows.shape[0], -1)


def q5_k(rows: np.ndarray) -> np.ndarray:
    values = _super_blocks(rows, 32)
    header, q = _k_scales(values, 31)
    fifth = ((q >> 4 & 1) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)
    return np.concatenate([header, fifth, _nibbles(q)], axis=1).reshape(rows.shape[0], -1)


def q6_k(rows: np.ndarray) -> np.ndarray:
    values = _super_blocks(rows, 16)
    step = np.abs(values).max(-1) / 31
    d = _half(step.max(-1, keepdims=True) / 127)
    scales = np.clip(np.round(_divided(step, d)), 0, 127).astype(np.int8)
    q = np.clip(np.round(_divided(values, (d * scales)[..., None])), -32, 31).astype(np.int16)
    q = (q + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128
    low = (q[..., :64] & 15) | (q[..., 64:] & 15) << 4  # [blocks, 2, 64]
    quarters = (q >> 4).reshape(-1, 2, 4, 32)
    high = (
        quarters[:, :, 0]
        | quarters[:, :, 1] << 2
        | quarters[:, :, 2] << 4
        | (quarters[:, :, 3] << 6)
    )
    blocks = np.concatenate(
        [low.reshape(-1, 128), high.reshape(-1, 64), scales.view(np.uint8),
         d.astype(np.float16).view(np.uint8).reshape(-1, 2)],
        axis=1,
    )  # fmt: skip
    return blocks.reshape(rows.shape[0], -1)


WRITTEN_HERE: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_K": q4_k,
    "Q5_K": q5_k,
    "Q6_K": q6_k,
}


def quantized(rows: np.ndarray, kind: str) -> np.ndarray:
    """float32 ``[rows, in]`` as the bytes of GGUF blocks of ``kind`` (``F32``: unchanged)."""
    import gguf

    if kind == "F32":
        return rows.astype(np.float32)
    if kind in WRITTEN_HERE:
        return WRITTEN_HERE[kind](rows)
    return gguf.quantize(rows.astype(np.float32), gguf.GGMLQuantizationType[kind])


def requantized_copy(source: Path, target: Path, kind_of: Callable[[str, tuple], str]) -> Path:
    """``source``'s metadata and tensors written to ``target``, each tensor decoded and
    quantized again to ``kind_of(gguf_name, [rows, in])`` (``F32``: kept as float32)."""
    import gguf

    with quick_gguf_reading():
        reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        values = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        rows = values.reshape(-1, values.shape[-1])
        kind = kind_of(tensor.name, rows.shape)
        data = quantized(rows, kind).reshape(*values.shape[:-1], -1)
        raw_dtype = None if kind == "F32" else gguf.GGMLQuantizationType[kind]
        writer.add_tensor(tensor.name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
