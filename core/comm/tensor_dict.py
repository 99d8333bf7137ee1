"""Tensor dicts on the wire: metadata (an object) followed by the non-empty tensors.

The metadata is a list of ``(key, value)`` pairs in dict order, where ``value`` is a
:class:`TensorMeta` for a tensor and the plain value otherwise. Receivers allocate buffers
from it; zero-element tensors are rebuilt from metadata alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardline.dtypes import DTYPE_NAMES, dtype_name, torch_dtype
from shardline.errors import ProtocolError


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype name and device type of one tensor in a tensor dict."""

    dtype: str
    shape: tuple[int, ...]
    device: str

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


Metadata = list[tuple[str, Any]]


def split(tensor_dict: dict[str, Any]) -> tuple[Metadata, list[torch.Tensor]]:
    """Metadata for ``tensor_dict`` and its non-empty tensors (contiguous), in key order."""
    if not isinstance(tensor_dict, dict):
        raise TypeError(f"tensor dict must be a dict, got {type(tensor_dict).__name__}")
    metadata: Metadata = []
    tensors: list[torch.Tensor] = []
    for key, value in tensor_dict.items():
        if not isinstance(key, str):
            raise TypeError(f"tensor dict keys must be str, got {key!r}")
        if isinstance(value, torch.Tensor):
            metadata.append(
                (key, TensorMeta(dtype_name(value.dtype), tuple(value.shape), value.device.type))
            )
            if value.numel() > 0:
                tensors.append(value.contiguous())
        else:
            metadata.append((key, value))
    return metadata, tensors


#: Most elements one received tensor may announce (a larger one is refused as ill-formed).
MAX_ELEMENTS = 1 << 31


def allocate(
    metadata: Metadata, device: str | None = None, sender: str = "a peer"
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A dict shaped like the sender's, and the buffers to receive into, in wire order.

    Raises :class:`ProtocolError` naming ``sender`` for metadata that is not a list of
    ``(str, value)`` pairs, or whose tensor entries name an unknown dtype or device, a shape
    that is not a tuple of non-negative ints, or more than :data:`MAX_ELEMENTS` elements.
    """

    def refuse(what: str) -> ProtocolError:
        return ProtocolError(f"tensor dict from {sender}: {what}")

    if not isinstance(metadata, list):
        raise refuse(f"metadata must be a list, got {type(metadata).__name__}")
    result: dict[str, Any] = {}
    buffers: list[torch.Tensor] = []
    for entry in metadata:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            raise refuse(f"metadata entry must be (str, value), got {_short(entry)}")
        key, value = entry
        if isinstance(value, TensorMeta):
            if not isinstance(value.dtype, str) or value.dtype not in DTYPE_NAMES:
                raise refuse(f"entry {key!r}: unknown dtype {_short(value.dtype)}")
            shape = value.shape
            if not isinstance(shape, tuple) or any(
                type(size) is not int or size < 0 for size in shape
            ):
                raise refuse(f"entry {key!r}: bad shape {_short(shape)}")
            if value.numel > MAX_ELEMENTS:
                raise refuse(f"entry {key!r}: {value.numel} elements; allowed: {MAX_ELEMENTS}")
            if device is None and value.device not in ("cpu", "cuda"):
                raise refuse(f"entry {key!r}: device {_short(value.device)}; allowed: cpu, cuda")
            try:
                tensor = torch.empty(
                    shape, dtype=torch_dtype(value.dtype), device=device or value.device
                )
            except RuntimeError as error:
                raise refuse(f"entry {key!r}: cannot allocate {_short(shape)}: {error}") from error
            if value.numel > 0:
                buffers.append(tensor)
            result[key] = tensor
        else:
            result[key] = value
    return result, buffers


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
