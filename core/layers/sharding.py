"""Which slice of a full checkpoint tensor each tensor-parallel rank keeps: pure functions.

Weights follow torch's ``Linear`` layout ``[out_features, in_features]``:

- column-parallel splits the output dim (dim 0) into ``tp`` equal parts;
- row-parallel splits the input dim (dim 1);
- QKV splits by heads: rank r keeps query heads ``[r*h/t, (r+1)*h/t)``; key/value heads are
  split the same way when ``tp <= num_kv_heads``, and otherwise each KV head is replicated on
  ``tp / num_kv_heads`` consecutive ranks, rank r keeping KV head ``r // replicas``;
- vocab-parallel embeddings split the (padded) vocabulary into equal ranges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class TensorSource(Protocol):
    """A full checkpoint tensor, possibly not in memory: it has a ``shape`` and indexing with
    slices returns just that part as a tensor. A ``torch.Tensor`` is one."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class ShardSlice:
    """Keep ``length`` entries from ``start`` along ``dim`` of the full tensor."""

    dim: int
    start: int
    length: int

    def apply(self, full: TensorSource) -> torch.Tensor:
        """This rank's part of ``full``: a view of a tensor, or only that part read from a
        lazy checkpoint tensor."""
        if self.start + self.length > full.shape[self.dim]:
            raise ValueError(
                f"shard [{self.start}, {self.start + self.length}) along dim {self.dim} exceeds "
                f"the checkpoint tensor's shape {tuple(full.shape)}"
            )
        return full[(slice(None),) * self.dim + (slice(self.start, self.start + self.length),)]


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, or ValueError naming ``what`` when it does not divide."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})"
        )
    return numerator // denominator


def column_slice(out_features: int, tp_size: int, tp_rank: int) -> ShardSlice:
    size = divide(out_features, tp_size, "output features")
    return ShardSlice(0, tp_rank * size, size)


def row_slice(in_features: int, tp_size: int, tp_rank: int) -> ShardSlice:
    size = divide(in_features, tp_size, "input features")
    return ShardSlice(1, tp_rank * size, size)


@dataclass(frozen=True)
class KVHeadLayout:
    """How key/value heads spread over a TP group: ``heads_per_rank`` on each rank, each
    head held by ``replicas`` ranks."""

    heads_per_rank: int
    replicas: int

    @classmethod
    def of(cls, num_kv_heads: int, tp_size: int) -> KVHeadLayout:
        if tp_size >= num_kv_heads:
            return cls(1, divide(tp_size, num_kv_heads, "tensor-parallel size over KV heads"))
        return cls(divide(num_kv_heads, tp_size, "key/value heads"), 1)

    def first_head(self, tp_rank: int) -> int:
        """Index of the first KV head rank ``tp_rank`` keeps."""
        return (tp_rank // self.replicas) * self.heads_per_rank


def qkv_slices(
    num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int, tp_rank: int
) -> dict[str, ShardSlice]:
    """Rows of the full ``q_proj``, ``k_proj`` and ``v_proj`` weights this rank keeps."""
    q_heads = divide(num_heads, tp_size, "attention heads")
    kv = KVHeadLayout.of(num_kv_heads, tp_size)
    kv_slice = ShardSlice(0, kv.first_head(tp_rank) * head_dim, kv.heads_per_rank * head_dim)
    return {
        "q": ShardSlice(0, tp_rank * q_heads * head_dim, q_heads * head_dim),
        "k": kv_slice,
        "v": kv_slice,
    }


@dataclass(frozen=True)
class VocabShard:
    """Rank's vocabulary range ``[start, end)`` of real tokens, within a padded part of
    ``padded_per_rank`` rows (rows past ``end - start`` are padding)."""

    start: int
    end: int
    padded_per_rank: int


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int, pad_to: int = 64) -> VocabShard:
    """Pad the vocabulary to a multiple of ``pad_to * tp_size`` and give each rank an equal
    range; the last ranks may hold fewer (or no) real tokens."""
    multiple = pad_to * tp_size
    padded = -(-vocab_size // multiple) * multiple
    per_rank = padded // tp_size
    start = min(tp_rank * per_rank, vocab_size)
    end = min(start + per_rank, vocab_size)
    return VocabShard(start, end, per_rank)
