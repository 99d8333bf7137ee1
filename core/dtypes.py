"""Dtype names used in config and capability declarations, and their torch dtypes.

Names are plain strings so that config validation and capability checks never import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES: tuple[str, ...] = ("float32", "float16", "bfloat16", "int32", "int64", "uint8")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name``; raises ValueError naming the allowed names."""
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a torch dtype (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")
