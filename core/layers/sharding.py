"""Which slice of a full checkpoint tensor each tensor-parallel rank keeps: pure functions.

Weights follow torch's ``Linear`` layout ``[out_features, in_features]``:

- column-parallel splits the output dim (dim 0) into ``tp`` equal parts;
- row-parallel splits the input dim (dim 1);
- QKV splits by heads (:class:`HeadShard`): rank r keeps query heads ``[r*h/t, (r+1)*h/t)``
  and the key/value heads those read; when ``tp`` divides the counts, KV heads are split the
  same way for ``tp <= num_kv_heads`` and otherwise replicated on ``tp / num_kv_heads``
  consecutive ranks, rank r keeping KV head ``r // replicas``;
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


def divide(
    numerator: int, denominator: int, what: str, by: str = "the tensor-parallel size"
) -> int:
    """``numerator / denominator``, or ValueError naming both quantities (``what`` and
    ``by``) when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by {by} ({denominator})")
    return numerator // denominator


def column_slice(out_features: int, tp_size: int, tp_rank: int) -> ShardSlice:
    size = divide(out_features, tp_size, "output features")
    return ShardSlice(0, tp_rank * size, size)


def row_slice(in_features: int, tp_size: int, tp_rank: int) -> ShardSlice:
    size = divide(in_features, tp_size, "input features")
    return ShardSlice(1, tp_rank * size, size)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one TP rank keeps: query heads ``[q_start, q_end)`` and the
    key/value heads they use, ``[kv_start, kv_end)``.

    Query heads are split in balanced contiguous ranges (equal when ``tp`` divides the head
    count). Query head ``h`` reads KV head ``h // group`` (``group = heads / kv_heads``), so a
    rank keeps exactly the KV heads of its query heads. When ``tp`` divides the head counts
    this is the usual layout: KV heads split evenly, or, with ``tp >= kv_heads``, each KV
    head replicated on ``tp / kv_heads`` ranks, rank r keeping KV head ``r // replicas``.
    Otherwise (9 heads, 3 KV heads over 2 ranks) ranks hold 4 and 5 query heads and a KV head
    may be held by both neighbours.
    """

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int
    group: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start

    def kv_index_of_query_heads(self) -> list[int]:
        """For each local query head, the local index of the KV head it reads."""
        return [h // self.group - self.kv_start for h in range(self.q_start, self.q_end)]


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """The heads rank ``tp_rank`` of ``tp_size`` keeps (see :class:`HeadShard`)."""
    group = divide(num_heads, num_kv_heads, "attention heads", "key/value heads")
    if num_heads < tp_size:
        raise ValueError(
            f"attention heads ({num_heads}) are fewer than the tensor-parallel size ({tp_size})"
        )
    q_start = tp_rank * num_heads // tp_size
    q_end = (tp_rank + 1) * num_heads // tp_size
    return HeadShard(q_start, q_end, q_start // group, (q_end - 1) // group + 1, group)


def qkv_slices(
    num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int, tp_rank: int
) -> dict[str, ShardSlice]:
    """Rows of the full ``q_proj``, ``k_proj`` and ``v_proj`` weights this rank keeps."""
    heads = head_shard(num_heads, num_kv_heads, tp_size, tp_rank)
    kv_slice = ShardSlice(0, heads.kv_start * head_dim, heads.num_kv_heads * head_dim)
    return {
        "q": ShardSlice(0, heads.q_start * head_dim, heads.num_heads * head_dim),
        "k": kv_slice,
        "v": kv_slice,
    }


#: Each rank's vocabulary range is a multiple of this many rows (the embedding, the LM head and
#: the memory plan all shard through :func:`vocab_shard`, so they agree).
VOCAB_PADDING = 64


@dataclass(frozen=True)
class VocabShard:
    """Rank's vocabulary range ``[start, end)`` of real tokens, within a padded part of
    ``padded_per_rank`` rows (rows past ``end - start`` are padding)."""

    start: int
    end: int
    padded_per_rank: int


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int) -> VocabShard:
    """Pad the vocabulary to a multiple of :data:`VOCAB_PADDING` ``* tp_size`` and give each
    rank an equal range; the last ranks may hold fewer (or no) real tokens."""
    multiple = VOCAB_PADDING * tp_size
    padded = -(-vocab_size // multiple) * multiple
    per_rank = padded // tp_size
    start = min(tp_rank * per_rank, vocab_size)
    end = min(start + per_rank, vocab_size)
    return VocabShard(start, end, per_rank)
