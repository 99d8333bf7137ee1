"""The tests' quicker way for transformers to read GGUF files (support/quick_gguf.py) reads
what gguf's own reader reads: every field's parts and every tensor's bytes, and the same
tensor names."""

import numpy as np

from support.quick_gguf import quick_gguf_reading
from support.tiny_gguf import write_tiny_gguf


def _everything(path):
    from gguf.gguf_reader import GGUFReader

    reader = GGUFReader(path)
    fields = {
        name: (field.offset, field.types, field.data, [part.tobytes() for part in field.parts])
        for name, field in reader.fields.items()
    }
    tensors = [
        (t.name, t.tensor_type, t.shape.tolist(), t.n_elements, t.data_offset, t.data.tobytes())
        for t in reader.tensors
    ]
    return reader, fields, tensors


def test_fields_tensors_and_names_are_gguf_readers_own(tmp_path):
    import gguf
    from gguf.gguf_reader import GGUFReader

    rows = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    path = write_tiny_gguf(
        tmp_path / "tiny.gguf",
        {"token_embd.weight": (rows, None), "output_norm.weight": (np.ones(64, np.float32), None)},
        arrays={"tokenizer.ggml.tokens": ["a", "bc", "déf", ""], "numbers": [3, 1, 4, 1, 5]},
    )
    _, expected_fields, expected_tensors = _everything(path)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3).mapping
    reader_get, name_map = GGUFReader._get, gguf.get_tensor_name_map
    with quick_gguf_reading():
        reader, fields, tensors = _everything(path)
        assert type(reader.data) is np.ndarray  # the quicker way was taken
        first = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is first
        assert first.mapping == names
    assert fields == expected_fields
    assert tensors == expected_tensors
    assert any(part == b"d\xc3\xa9f" for part in fields["tokenizer.ggml.tokens"][3])
    # Undone on leaving.
    assert (GGUFReader._get, gguf.get_tensor_name_map) == (reader_get, name_map)
    assert type(GGUFReader(path).data) is np.memmap
