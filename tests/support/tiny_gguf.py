"""Tiny llama-architecture GGUF files written with the gguf package, for reader tests."""

from pathlib import Path

import numpy as np


def write_tiny_gguf(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, str | None]],
    feed_forward_length: int = 96,
    arrays: dict[str, list] | None = None,
) -> Path:
    """A GGUF file with the llama metadata a checkpoint needs (hidden 64, 8 heads, 1 layer),
    the string or number ``arrays`` and ``tensors`` (GGUF name -> data and, for raw bytes
    of another type, that type's name)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "llama.embedding_length": 64,
        "llama.attention.head_count": 8,
        "llama.feed_forward_length": feed_forward_length,
        "llama.block_count": 1,
        "llama.context_length": 64,
    }.items():
        writer.add_uint32(key, value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, values in (arrays or {}).items():
        writer.add_array(key, values)
    for name, (data, raw_type) in tensors.items():
        raw_dtype = None if raw_type is None else gguf.GGMLQuantizationType[raw_type]
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
