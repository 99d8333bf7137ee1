"""Tensor-parallel linear layers (weights ``[out, in]``, as torch and HF store them).

Each layer holds only its rank's shard and loads it from the *full* checkpoint tensor with
``load_full`` (or ``load_part`` for merged layers): the narrowing is
:mod:`shardline.layers.sharding`, so a rank never keeps more than its share.

Once loaded, :func:`pack_linear_weights` has each layer's kernels
(:mod:`shardline.layers.kernels`) lay its weight out for their linear kernel: the C kernel's
own for float32 on a CPU with AVX-512 or AVX2 and FMA (held in bfloat16 with ``model.weight_dtype:
bfloat16``; shared among a rank's threads), all of a model's back
to back in one buffer in the order a step reads them, else oneDNN's blocked layout (float32,
bfloat16 on the CPU; faster than torch's default GEMM at every decode batch size,
``benchmarks/linear_kernels.py``). Where neither applies the weights stay as they are and
``F.linear`` runs.
"""

from __future__ import annotations

import torch
from torch import nn

from shardline.distributed import GroupCoordinator
from shardline.layers.kernels import FILE_BLOCKS, TORCH_KERNELS, TorchKernels, WeightPacker
from shardline.layers.sharding import (
    ShardSlice,
    TensorSource,
    column_slice,
    divide,
    head_shard,
    qkv_slices,
    row_slice,
)
from shardline.profiling import MATMUL


def _parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def weight_matrix(out_features: int, in_features: int, dtype: torch.dtype) -> nn.Parameter:
    """A ``[out, in]`` weight, uninitialized (loading writes all of it; its memory is
    committed only as it is written), made on torch's default device. A float32 weight on
    the CPU is stored column by column (its transpose contiguous): torch's CPU GEMM multiplies
    by a contiguous ``[in, out]`` matrix faster at decode batch sizes, which matters for a
    weight that is not packed (a tied LM head; no oneDNN)."""
    if dtype == torch.float32 and torch.get_default_device().type == "cpu":
        storage = torch.empty(in_features, out_features, dtype=dtype)
        return nn.Parameter(storage.t(), requires_grad=False)
    return nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)


class LinearPacking:
    """Packs a model's linear weights as they are loaded: one
    :meth:`~TorchKernels.weight_packer` per kernels object, made up front from every layer
    with a ``pack`` method (their shapes), so that the C kernel's weights lie back to back in
    module order (the order a step multiplies by them). Call :meth:`pack` on each part of the
    model once its weights are loaded, in module order: a loaded layer is packed (its loaded
    copy freed) before the next is read, so loading holds one layer's unpacked weights at a
    time, not the model's."""

    def __init__(self, model: nn.Module) -> None:
        packable: dict[int, list[nn.Module]] = {}
        for module in model.modules():
            if callable(getattr(module, "pack", None)):
                packable.setdefault(id(module.kernels), []).append(module)
        self._packers = {
            kernels: modules[0].kernels.weight_packer([module.weight for module in modules])
            for kernels, modules in packable.items()
        }
        self._packed: set[int] = set()

    def pack(self, part: nn.Module) -> None:
        """Pack every layer with a ``pack`` method in ``part`` (loaded) not packed yet; the
        file blocks its weight carried (:func:`note_file_blocks`) are let go."""
        for module in part.modules():
            if callable(getattr(module, "pack", None)) and id(module) not in self._packed:
                self._packed.add(id(module))
                loaded = module.weight
                module.pack(self._packers[id(module.kernels)])
                loaded.__dict__.pop(FILE_BLOCKS, None)


def pack_linear_weights(model: nn.Module) -> None:
    """Pack the weight of every layer of ``model`` that has a ``pack`` method (call once the
    weights are loaded; loading into a packed weight is not possible): :class:`LinearPacking`
    of the whole model at once."""
    LinearPacking(model).pack(model)


def note_file_blocks(weight: nn.Parameter, first_row: int, shard: torch.Tensor) -> None:
    """Where ``shard`` (a checkpoint tensor's part, copied into ``weight`` from row
    ``first_row``) carries the file's blocks it was decoded from (a GGUF file's, read with
    ``keep_blocks``), add ``(first_row, type name, bytes)`` to ``weight``'s
    :data:`FILE_BLOCKS`: its kernels may hold it as those blocks."""
    blocks = getattr(shard, FILE_BLOCKS, None)
    if blocks is not None:
        weight.__dict__.setdefault(FILE_BLOCKS, []).append((first_row, *blocks))


class ColumnParallelLinear(nn.Module):
    """``Y = X W^T``, W split along its output dim: input replicated, output sharded
    (``[..., out / tp]``), no communication."""

    profile_part = MATMUL

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: GroupCoordinator,
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        kernels: TorchKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.kernels = kernels
        self.in_features = in_features
        self.out_features = out_features
        self.out_per_rank = divide(out_features, tp.world_size, "output features")
        self.weight = weight_matrix(self.out_per_rank, in_features, dtype)
        self.bias = _parameter(self.out_per_rank, dtype=dtype) if bias else None

    def load_full(self, weight: TensorSource, bias: TensorSource | None = None) -> None:
        """Copy this rank's rows of the full ``[out, in]`` weight (and bias)."""
        part = column_slice(self.out_features, self.tp.world_size, self.tp.rank_in_group)
        shard = part.apply(weight)
        copy_into(self.weight, shard, "weight")
        note_file_blocks(self.weight, 0, shard)
        if self.bias is not None and bias is not None:
            copy_into(self.bias, part.apply(bias), "bias")

    def pack(self, packer: WeightPacker | None = None) -> None:
        self.weight = (packer or self.kernels.pack_linear)(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in a single GEMM (e.g. gate and up):
    the rank's output is its shard of each part, concatenated in order."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        tp: GroupCoordinator,
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        kernels: TorchKernels = TORCH_KERNELS,
    ) -> None:
        for size in output_sizes:
            divide(size, tp.world_size, "output features of each merged part")
        super().__init__(
            in_features, sum(output_sizes), tp, bias=bias, dtype=dtype, kernels=kernels
        )
        self.output_sizes = list(output_sizes)

    def load_part(self, index: int, weight: TensorSource, bias: TensorSource | None = None) -> None:
        """Copy this rank's shard of part ``index`` (its full ``[out_i, in]`` weight)."""
        size = self.output_sizes[index]
        part = column_slice(size, self.tp.world_size, self.tp.rank_in_group)
        offset = sum(self.output_sizes[:index]) // self.tp.world_size
        shard = part.apply(weight)
        copy_into(self.weight[offset : offset + part.length], shard, f"weight part {index}")
        note_file_blocks(self.weight, offset, shard)
        if self.bias is not None and bias is not None:
            copy_into(
                self.bias[offset : offset + part.length], part.apply(bias), f"bias part {index}"
            )


class QKVParallelLinear(nn.Module):
    """Query, key and value projections split by heads (:class:`HeadShard`): the rank's output
    is ``[q | k | v]`` for its query heads and the KV heads they read. No communication."""

    profile_part = MATMUL

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        tp: GroupCoordinator,
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        kernels: TorchKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.kernels = kernels
        self.heads = head_shard(num_heads, num_kv_heads, tp.world_size, tp.rank_in_group)
        self.head_dim = head_dim
        self.total_heads = num_heads
        self.total_kv_heads = num_kv_heads
        out_per_rank = self.q_size + 2 * self.kv_size
        self.weight = weight_matrix(out_per_rank, hidden_size, dtype)
        self.bias = _parameter(out_per_rank, dtype=dtype) if bias else None

    @property
    def q_size(self) -> int:
        return self.heads.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.heads.num_kv_heads * self.head_dim

    def load_part(self, name: str, weight: TensorSource, bias: TensorSource | None = None) -> None:
        """Copy this rank's heads of the full ``q``, ``k`` or ``v`` projection."""
        slices = qkv_slices(
            self.total_heads,
            self.total_kv_heads,
            self.head_dim,
            self.tp.world_size,
            self.tp.rank_in_group,
        )
        offset = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[name]
        part = slices[name]
        shard = part.apply(weight)
        copy_into(self.weight[offset : offset + part.length], shard, f"{name} weight")
        note_file_blocks(self.weight, offset, shard)
        if self.bias is not None and bias is not None:
            copy_into(self.bias[offset : offset + part.length], part.apply(bias), f"{name} bias")

    def pack(self, packer: WeightPacker | None = None) -> None:
        self.weight = (packer or self.kernels.pack_linear)(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``Y = X W^T``, W split along its input dim: each rank multiplies its slice of X
    (``[..., input_shard.length]``, e.g. a column-parallel layer's output) and the partial
    results are all-reduced. The bias is added once, after the reduction."""

    profile_part = MATMUL

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: GroupCoordinator,
        *,
        bias: bool = False,
        input_shard: ShardSlice | None = None,
        dtype: torch.dtype = torch.float32,
        kernels: TorchKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.kernels = kernels
        self.in_features = in_features
        self.out_features = out_features
        # Even split by default; attention passes its heads' range, which may be uneven.
        self.input_shard = input_shard or row_slice(in_features, tp.world_size, tp.rank_in_group)
        self.weight = weight_matrix(out_features, self.input_shard.length, dtype)
        self.bias = _parameter(out_features, dtype=dtype) if bias else None

    def load_full(self, weight: TensorSource, bias: TensorSource | None = None) -> None:
        shard = self.input_shard.apply(weight)
        copy_into(self.weight, shard, "weight")
        note_file_blocks(self.weight, 0, shard)
        if self.bias is not None and bias is not None:
            copy_into(self.bias, bias[:], "bias")

    def pack(self, packer: WeightPacker | None = None) -> None:
        self.weight = (packer or self.kernels.pack_linear)(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.kernels.linear(x, self.weight, None))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's ``partial`` product (``X_rank W_rank^T``, no
        bias): all-reduced over the TP group, then the bias added."""
        y = self.tp.all_reduce(partial)
        if self.bias is not None:
            y = y + self.bias
        return y


def copy_into(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    """Copy (and cast) ``source`` into ``target``; shapes must match."""
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(
            f"{what}: checkpoint shard has shape {tuple(source.shape)}, "
            f"expected {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(source)
