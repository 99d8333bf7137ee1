"""Attention over a paged KV cache, for ragged batches mixing prefill and decode.

The batch is flattened: ``N`` tokens from ``B`` sequences. Sequence ``i`` contributes the
query tokens ``query_start_loc[i]:query_start_loc[i+1]``; those are the *last* tokens of a
sequence that is ``seq_lens[i]`` tokens long once they are added. Keys and values live in a
cache of fixed-size blocks; ``block_tables[i]`` lists sequence ``i``'s blocks in order and
``slot_mapping[t]`` is where token ``t``'s key and value are written (``block * size + offset``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardline.layers.kernels import TORCH_KERNELS, KVHeadIndex, TorchKernels, per_query_head
from shardline.profiling import ATTENTION


def attention_kernels():
    """The scaled-dot-product kernels attention may use, as a context for a whole step:
    flash, memory-efficient or math, never cuDNN's, which builds a new graph for every new
    sequence length (each decode step, each prompt length) in float16 and bfloat16."""
    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    )


@dataclass
class DecodeBatch:
    """The query rows of a step that attend row by row (``AttentionMetadata.row_wise_queries``),
    gathered for one batched attention call, each as a one-token sequence: their rows in the
    batch (None when they are all the batch's rows, in order: e.g. a step of decodes only),
    their cache blocks (``[B * blocks_per_seq]``, each table padded with block 0), the longest
    length, each row's length (``[B]``, int64, in host memory) and the device the blocks are
    on; :attr:`visible` says which positions are real, made when first asked (the fused C
    step never asks)."""

    rows: torch.Tensor | None
    blocks: torch.Tensor
    blocks_per_seq: int
    length: int
    lengths: torch.Tensor
    device: torch.device | str

    @functools.cached_property
    def visible(self) -> torch.Tensor | None:
        """Which of the first ``length`` positions of each row are real (``[B, 1, 1,
        length]``, on ``device``); None when none is padding."""
        mask = (torch.arange(self.length, device="cpu") < self.lengths[:, None])[:, None, None, :]
        return None if bool(mask.all()) else mask.to(self.device)


@dataclass
class AttentionMetadata:
    """Where each sequence's queries are in the batch and where its keys live in the cache;
    ``device`` is the cache's (where tensors built from the lists go)."""

    query_start_loc: list[int]
    seq_lens: list[int]
    slot_mapping: torch.Tensor
    block_tables: list[list[int]]
    device: torch.device | str = "cpu"
    #: The most queries of one sequence the decode path takes, row by row (the model's
    #: kernels say: :meth:`~shardline.layers.kernels.TorchKernels.row_wise_queries`); 1: only
    #: one-token sequences.
    row_wise_queries: int = 1
    _decode: dict[int, DecodeBatch | None] = field(default_factory=dict, repr=False)

    def decode_batch(self, block_size: int) -> DecodeBatch | None:
        """The query rows of this step that attend row by row (None when there are none),
        built once per step and shared by every layer."""
        if block_size not in self._decode:
            self._decode[block_size] = self._build_decode_batch(block_size)
        return self._decode[block_size]

    def row_wise(self, sequence: int) -> bool:
        """Whether sequence ``sequence``'s queries attend row by row (in the decode batch)."""
        starts = self.query_start_loc
        return 0 < starts[sequence + 1] - starts[sequence] <= self.row_wise_queries

    def _build_decode_batch(self, block_size: int) -> DecodeBatch | None:
        starts = self.query_start_loc
        rows: list[int] = []
        row_lengths: list[int] = []
        row_tables: list[list[int]] = []
        for i, seq_len in enumerate(self.seq_lens):
            if not self.row_wise(i):
                continue
            count = starts[i + 1] - starts[i]
            rows += range(starts[i], starts[i + 1])
            row_lengths += range(seq_len - count + 1, seq_len + 1)
            row_tables += [self.block_tables[i]] * count
        if not rows:
            return None
        longest = max(row_lengths)
        per_seq = -(-longest // block_size)
        blocks = []
        for table in row_tables:
            table = table[:per_seq]
            blocks += table + [0] * (per_seq - len(table))
        every_row = starts[-1] == len(rows)
        # Built on the host from the lists, then moved to the device once per step.
        return DecodeBatch(
            None if every_row else torch.tensor(rows, dtype=torch.long, device=self.device),
            torch.tensor(blocks, dtype=torch.long, device=self.device),
            per_seq,
            longest,
            torch.tensor(row_lengths, device="cpu"),
            self.device,
        )


class KVCache:
    """One layer's keys and values: ``[num_blocks, block_size, kv_heads, head_dim]`` each."""

    def __init__(
        self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        self.block_size = block_size
        self.key = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
        self.value = torch.zeros_like(self.key)

    def write(self, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` (``[N, kv_heads, d]``) at the flat slots."""
        self.key.view(-1, *self.key.shape[2:])[slot_mapping] = key
        self.value.view(-1, *self.value.shape[2:])[slot_mapping] = value

    def read(self, blocks: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` keys and values of a sequence stored in ``blocks``."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.key.device)
        key = self.key[index].reshape(-1, *self.key.shape[2:])[:length]
        value = self.value[index].reshape(-1, *self.value.shape[2:])[:length]
        return key, value


class PagedAttention(nn.Module):
    """:func:`paged_attention` as a layer: a layer's softmax ``scale``, which KV head each of
    its query heads reads (``kv_index``) and the kernels it runs on."""

    profile_part = ATTENTION

    def __init__(
        self, scale: float, kv_index: KVHeadIndex, kernels: TorchKernels = TORCH_KERNELS
    ) -> None:
        super().__init__()
        self.scale = scale
        self.kernels = kernels
        self.kv_index = kv_index

    def forward(self, q: torch.Tensor, cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        return paged_attention(q, cache, metadata, self.scale, self.kv_index, self.kernels)


def paged_attention(
    q: torch.Tensor,
    cache: KVCache,
    metadata: AttentionMetadata,
    scale: float,
    kv_index: KVHeadIndex,
    kernels: TorchKernels = TORCH_KERNELS,
) -> torch.Tensor:
    """Causal attention of ``q`` (``[N, heads, d]``) over each sequence's cached keys, this
    batch's already written. Query head ``i`` reads KV head ``kv_index.index[i]``. Returns
    ``[N, heads * d]``."""
    decode = metadata.decode_batch(cache.block_size)
    if decode is not None and decode.rows is None:  # decodes only
        return kernels.decode_attention(q, cache, decode, scale, kv_index).reshape(q.shape[0], -1)
    out = torch.empty_like(q)
    if decode is not None:
        out[decode.rows] = kernels.decode_attention(q, cache, decode, scale, kv_index)
    for i, seq_len in enumerate(metadata.seq_lens):
        start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
        if end == start or metadata.row_wise(i):
            continue
        keys, values = cache.read(metadata.block_tables[i], seq_len)
        # [1, heads, n, d]: with a batch dimension torch's fused attention kernels run (on the
        # CPU its flash kernel: 4x its reference path at 512 queries over 2000 keys here).
        query = q[start:end].transpose(0, 1).unsqueeze(0)
        keys, values = per_query_head(
            keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0), kv_index
        )
        n_q = end - start
        visible = None  # the whole sequence: plain causal (the kernel skips masked tiles)
        if n_q < seq_len:
            # Query t sits at position seq_len - n_q + t and sees keys up to there.
            key_positions = torch.arange(seq_len, device=q.device)
            query_positions = seq_len - n_q + torch.arange(n_q, device=q.device)
            visible = key_positions.unsqueeze(0) <= query_positions.unsqueeze(1)
        attended = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=visible,
            is_causal=visible is None,
            scale=scale,
            enable_gqa=kv_index.grouped,
        )
        out[start:end] = attended[0].transpose(0, 1)
    return out.reshape(q.shape[0], -1)
