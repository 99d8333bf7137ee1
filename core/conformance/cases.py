"""Deterministic inputs and expected results, computed identically on every rank.

Inputs hold small integers, so every dtype (float16 and bfloat16 included) represents them,
and their sums over four ranks, exactly: any difference is a bug, not rounding.
"""

from __future__ import annotations

import math

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


#: Inputs repeat every PERIOD elements (value ``(3 i + offset) % 11 - 5`` at flat index i),
#: so they, and any elementwise reduction of them, are one period tiled.
PERIOD = 11


def _period(rank: int, salt: int) -> torch.Tensor:
    return (torch.arange(PERIOD, dtype=torch.int64) * 3 + rank * 5 + salt) % PERIOD - 5


def _laid_out(period: torch.Tensor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``period`` tiled to ``shape`` (built transposed, then viewed back, for "noncontig")."""
    numel = math.prod(shape)
    flat = period.repeat(-(-numel // PERIOD))[:numel]
    if name == "noncontig":
        tensor = flat.reshape(shape[1], shape[0]).t()
        assert not tensor.is_contiguous()
        return tensor
    return flat.reshape(shape)


def make_input(rank: int, name: str, dtype: str, leading: int = 1, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input of shape ``name`` (non-contiguous for ``"noncontig"``)."""
    period = _period(rank, salt).to(torch_dtype(dtype))
    return _laid_out(period, name, shape_of(name, dtype, leading))


def reduce_expected(ranks: range, name: str, dtype: str, op: str, leading: int = 1) -> torch.Tensor:
    """What reducing the inputs of ``ranks`` with ``op`` gives, contiguous: computed on one
    period in ``dtype`` and tiled (elementwise, so the same as reducing the whole inputs)."""
    stacked = torch.stack([_period(rank, 0).to(torch_dtype(dtype)) for rank in ranks])
    if op == "sum":
        period = stacked.sum(0)
    elif op == "max":
        period = stacked.amax(0)
    else:
        period = stacked.amin(0)
    shape = shape_of(name, dtype, leading)
    return _laid_out(period.to(stacked.dtype), name, shape).contiguous()


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
