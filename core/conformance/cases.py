"""Deterministic inputs and expected results, computed identically on every rank.

Inputs hold small integers, so every dtype (float16 and bfloat16 included) represents them,
and their sums over four ranks, exactly: any difference is a bug, not rounding.
"""

from __future__ import annotations

import torch

from shardline.dtypes import torch_dtype

DTYPES = ("float32", "float16", "bfloat16", "int32", "int64")
SHAPES = ("empty", "one", "odd", "noncontig", "large")
LARGE_BYTES = 4 * 1024 * 1024


def shape_of(name: str, dtype: str, leading: int = 1) -> tuple[int, ...]:
    """The shape called ``name``; its first dimension multiplied by ``leading``."""
    itemsize = torch.empty(0, dtype=torch_dtype(dtype)).element_size()
    base = {
        "empty": (0,),
        "one": (1,),
        "odd": (7, 3),
        "noncontig": (6, 5),
        "large": (LARGE_BYTES // itemsize // 1024, 1024),
    }[name]
    return (base[0] * leading, *base[1:])


def make_input(rank: int, name: str, dtype: str, leading: int = 1, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input of shape ``name`` (non-contiguous for ``"noncontig"``)."""
    shape = shape_of(name, dtype, leading)
    numel = 1
    for size in shape:
        numel *= size
    values = (torch.arange(numel, dtype=torch.int64) * 3 + rank * 5 + salt) % 11 - 5
    if name == "noncontig":
        # Built transposed, then viewed back: same values, non-contiguous strides.
        tensor = values.reshape(shape[1], shape[0]).to(torch_dtype(dtype)).t()
        assert not tensor.is_contiguous()
        return tensor
    return values.reshape(shape).to(torch_dtype(dtype))


def reduce_expected(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack([t.contiguous() for t in inputs])
    if op == "sum":
        result = stacked.sum(0)
    elif op == "max":
        result = stacked.amax(0) if stacked.numel() else stacked.sum(0)
    else:
        result = stacked.amin(0) if stacked.numel() else stacked.sum(0)
    return result.to(inputs[0].dtype)


def assert_same(actual: torch.Tensor | None, expected: torch.Tensor, what: str) -> None:
    """Shape, dtype and values equal; raises AssertionError describing the first difference."""
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor, got {type(actual).__name__}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype}, expected {expected.dtype}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(
            f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        )
    if not torch.equal(actual, expected):
        wrong = (actual != expected).nonzero()
        index = tuple(wrong[0].tolist())
        raise AssertionError(
            f"{what}: {len(wrong)} wrong elements; first at {index}: "
            f"{actual[index].item()} != {expected[index].item()}"
        )
