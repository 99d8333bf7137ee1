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


def allocate(
    metadata: Metadata, device: str | None = None
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A dict shaped like the sender's, and the buffers to receive into, in wire order.

    Raises ValueError for metadata that is not a list of ``(str, value)`` pairs or names an
    unknown dtype or a negative size.
    """
    if not isinstance(metadata, list):
        raise ValueError(f"tensor dict metadata must be a list, got {type(metadata).__name__}")
    result: dict[str, Any] = {}
    buffers: list[torch.Tensor] = []
    for entry in metadata:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ValueError(f"tensor dict metadata entry must be (str, value), got {entry!r}")
        key, value = entry
        if isinstance(value, TensorMeta):
            if value.dtype not in DTYPE_NAMES:
                raise ValueError(f"tensor dict entry {key!r}: unknown dtype {value.dtype!r}")
            if any(not isinstance(s, int) or s < 0 for s in value.shape):
                raise ValueError(f"tensor dict entry {key!r}: bad shape {value.shape!r}")
            tensor = torch.empty(
                value.shape, dtype=torch_dtype(value.dtype), device=device or value.device
            )
            if value.numel > 0:
                buffers.append(tensor)
            result[key] = tensor
        else:
            result[key] = value
    return result, buffers
