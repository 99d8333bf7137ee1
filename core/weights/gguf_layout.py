"""The layout of a GGUF file (format versions 2 and 3, little-endian): its metadata and where
each tensor's bytes are, read in one pass over the header.

The ``gguf`` package's reader builds a numpy view for every part of every metadata field: on
SmolLM2's file (98k tokenizer strings) that took ~3 s, paid by every process that opened the
model (the driver twice, each rank once). This reader decodes strings and scalars with
``struct``, numeric arrays with one ``numpy.frombuffer`` each and string arrays in one call
of the ``_dequantize`` extension where it is given (SmolLM2's 98k strings), else in one
tight loop (SmolLM2's header: 63 ms against 134 with a call per string), and maps the tensor
data read-only; the ``gguf`` package still names the tensor types and dequantizes.
"""

from __future__ import annotations

import codecs
import struct
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
#: GGUF value types: struct format (scalars) or numpy dtype (array elements).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorLayout:
    """One tensor: ``data`` is a read-only view of its bytes shaped as the ``gguf`` reader
    shapes it (rows of elements, or of quantized blocks' bytes); ``shape`` lists GGUF's
    dimensions, innermost first."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFLayout:
    """A GGUF file's metadata (strings decoded, arrays as lists) and tensors by name."""

    metadata: dict[str, Any]
    tensors: dict[str, TensorLayout]

    @classmethod
    def read(cls, path: str | Path, native: ModuleType | None = None) -> GGUFLayout:
        """Parse ``path``; ValueError on anything that is not a GGUF file this reads.
        ``native``: the ``_dequantize`` extension, which decodes string arrays (else Python
        does, to the same strings)."""
        import gguf

        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        header = _Cursor(memoryview(mapped), native)
        if header.take(4) != _MAGIC:
            raise ValueError("no GGUF magic number")
        version = header.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}: this reads versions 2 and 3")
        tensor_count, field_count = header.unpack("<Q"), header.unpack("<Q")
        metadata = {}
        for _ in range(field_count):
            key = header.string()
            metadata[key] = header.value(header.unpack("<I"))
        infos = []
        for _ in range(tensor_count):
            name = header.string()
            dims = tuple(header.unpack("<Q") for _ in range(header.unpack("<I")))
            infos.append((name, gguf.GGMLQuantizationType(header.unpack("<I")), dims,
                          header.unpack("<Q")))  # fmt: skip
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-header.offset // alignment) * alignment
        tensors = {}
        for name, kind, dims, offset in infos:
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            count = int(np.prod(dims)) if dims else 1
            size = count // block * block_bytes
            first = start + offset
            if first + size > len(mapped):
                raise ValueError(f"tensor {name} lies past the end of the file")
            raw = mapped[first : first + size]
            rows = tuple(reversed(dims[1:]))
            if kind.name in ("F32", "F16"):
                data = raw.view(np.float32 if kind.name == "F32" else np.float16)
                data = data.reshape(*rows, dims[0])
            else:
                data = raw.reshape(*rows, dims[0] // block * block_bytes)
            tensors[name] = TensorLayout(name, kind, dims, data)
        return cls(metadata, tensors)


class _Cursor:
    """Reads little-endian values from ``buffer`` front to back."""

    def __init__(self, buffer: memoryview, native: ModuleType | None = None) -> None:
        self.buffer = buffer
        self.offset = 0
        self._native = native

    def take(self, size: int) -> bytes:
        if self.offset + size > len(self.buffer):
            raise ValueError("the header runs past the end of the file")
        chunk = bytes(self.buffer[self.offset : self.offset + size])
        self.offset += size
        return chunk

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        except struct.error:
            raise ValueError("the header runs past the end of the file") from None
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        element, count = self.unpack("<I"), self.unpack("<Q")
        if element in _SCALARS and element != 7:
            dtype = np.dtype(_SCALARS[element])
            size = dtype.itemsize * count
            if self.offset + size > len(self.buffer):
                raise ValueError("an array runs past the end of the file")
            values = np.frombuffer(self.buffer, dtype, count, self.offset)
            self.offset += size
            return values.tolist()
        if element == _STRING:
            return self.strings(count)
        return [self.value(element) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a tokenizer's vocabulary: ~100k of them), in one call
        of the extension where given, else in one loop over local names (half the time of a
        method call per string)."""
        if self._native is not None:
            values, self.offset = self._native.strings(self.buffer, self.offset, count)
            return values
        buffer, offset, end = self.buffer, self.offset, len(self.buffer)
        length_at, decode = _LENGTH.unpack_from, codecs.utf_8_decode
        values = []
        for _ in range(count):
            if offset + 8 > end:
                raise ValueError("the header runs past the end of the file")
            (length,) = length_at(buffer, offset)
            offset += 8
            if offset + length > end:
                raise ValueError("the header runs past the end of the file")
            values.append(decode(buffer[offset : offset + length], "replace", True)[0])
            offset += length
        self.offset = offset
        return values
