"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded to a multiple of ``VOCAB_PADDING * tp`` and split in equal ranges
(:func:`~shardline.layers.sharding.vocab_shard`). The embedding looks up the tokens in its
range, zeroes the others, and all-reduces; the head computes logits for its range and
all-gathers them, dropping the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardline.distributed import GroupCoordinator
from shardline.interfaces import ReduceOp
from shardline.layers.kernels import TORCH_KERNELS, GreedyScreen, TorchKernels, WeightPacker
from shardline.layers.linear import note_file_blocks, weight_matrix
from shardline.layers.sharding import TensorSource, vocab_shard
from shardline.profiling import EMBEDDING_LOOKUP, MATMUL


class VocabParallelEmbedding(nn.Module):
    """Token embedding split along the vocabulary; with several ranks, each looks up its
    range's rows through ``kernels`` (:meth:`~TorchKernels.embedding_rows`)."""

    profile_part = EMBEDDING_LOOKUP

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: GroupCoordinator,
        *,
        dtype: torch.dtype = torch.float32,
        kernels: TorchKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.kernels = kernels
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.shard = vocab_shard(vocab_size, tp.world_size, tp.rank_in_group)
        self.weight = self._table(self.shard.padded_per_rank, hidden_size, dtype)

    @staticmethod
    def _table(rows: int, hidden_size: int, dtype: torch.dtype) -> nn.Parameter:
        """The uninitialized table: row by row, as a lookup reads it (one row a token; a
        float32 table stored column by column put each of a row's values in another page:
        a lookup in a decode step took 0.2-0.5 ms)."""
        return nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype), requires_grad=False)

    def load_full(self, weight: TensorSource) -> None:
        """Copy this rank's rows of the full ``[vocab, hidden]`` table; padding rows are zeros."""
        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(
                f"embedding: checkpoint shape {tuple(weight.shape)}, expected "
                f"{(self.vocab_size, self.hidden_size)}"
            )
        rows = self.shard.end - self.shard.start
        shard = weight[self.shard.start : self.shard.end]
        with torch.no_grad():
            self.weight[:rows].copy_(shard)
            # Made uninitialized (weight_matrix): a lookup outside the shard reads row 0 and
            # masks it with a 0 multiply, which a NaN left here would survive.
            self.weight[rows:].zero_()
        note_file_blocks(self.weight, 0, shard)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(token_ids, self.weight)
        embedded = self.kernels.embedding_rows(token_ids, self.weight, self.shard.start)
        return self.tp.all_reduce(embedded)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary, computed per vocabulary range and gathered. With tied
    embeddings, pass the embedding layer: the head then shares its weight."""

    profile_part = MATMUL

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: GroupCoordinator,
        *,
        tied_to: VocabParallelEmbedding | None = None,
        dtype: torch.dtype = torch.float32,
        kernels: TorchKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__(vocab_size, hidden_size, tp, dtype=dtype, kernels=kernels)
        if tied_to is not None:  # row by row, then, where the head's kernels keep it unpacked
            self.weight = tied_to.weight
        #: Where the kernels have one for the packed weight, what greedy steps read instead of
        #: it (:class:`~shardline.layers.kernels.GreedyScreen`).
        self.screen: GreedyScreen | None = None

    @staticmethod
    def _table(rows: int, hidden_size: int, dtype: torch.dtype) -> nn.Parameter:
        """A head's own weight: as a linear layer's (:func:`weight_matrix`)."""
        return weight_matrix(rows, hidden_size, dtype)

    def pack(self, packer: WeightPacker | None = None) -> None:
        """Lay the head's weight out for its kernels' linear (``packer``, from
        :meth:`~shardline.layers.kernels.TorchKernels.weight_packer`, or
        :meth:`~shardline.layers.kernels.TorchKernels.pack_linear`). A tied head then holds
        its own copy: the embedding keeps the plain table its lookups read. Then the kernels'
        greedy screen of it, where they have one."""
        table = self.weight
        self.weight = (packer or self.kernels.pack_linear)(table)
        self.screen = self.kernels.greedy_screen(table, self.weight)

    def forward(self, hidden: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab_size]`` logits, identical on every TP rank; with
        ``greedy``, ``[N]`` token ids instead (:meth:`_greedy`)."""
        if greedy:
            return self._greedy(hidden)
        local = self.kernels.linear(hidden, self.weight, None)
        full = self.tp.all_gather(local, dim=-1)
        return full[..., : self.vocab_size]

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of the logits (the first of equal maxima), identical on every TP rank,
        without gathering them: each rank takes its range's best (through the screen where
        there is one: the same choice), and two all-reduces of ``N`` values pick the global
        best and, among ranks holding it, the lowest id."""
        valid = self.shard.end - self.shard.start
        settled = None
        if self.screen is not None and valid > 0:
            settled = self.screen.argmax(hidden, self.weight, valid)
        if settled is not None:
            best, index = settled
        elif valid > 0:
            best, index = self.kernels.linear(hidden, self.weight, None)[:, :valid].max(dim=-1)
        else:  # only padding on this rank (never so at TP=1)
            best = hidden.new_full((hidden.shape[0],), float("-inf"))
            index = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
        if self.tp.world_size == 1:
            return index
        overall = self.tp.all_reduce(best, ReduceOp.MAX)
        candidate = torch.where(best == overall, index + self.shard.start, self.vocab_size)
        return self.tp.all_reduce(candidate, ReduceOp.MIN)
