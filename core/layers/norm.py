"""RMSNorm with the fused residual add used between decoder layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back (as HF Llama does)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: the normalized ``x``. With it: ``(norm(x + residual),
        x + residual)``, the new residual stream."""
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:  # one fused kernel, the same arithmetic
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return out if residual is None else (out, residual)
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)
        return out if residual is None else (out, residual)
