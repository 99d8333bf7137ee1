"""RMSNorm with the fused residual add used between decoder layers."""

from __future__ import annotations

import torch
from torch import nn

from shardline.layers.kernels import TORCH_KERNELS, TorchKernels


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back (as HF Llama does), by
    ``kernels``."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype = torch.float32,
        kernels: TorchKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: the normalized ``x``. With it: ``(norm(x + residual),
        x + residual)``, the new residual stream."""
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)
