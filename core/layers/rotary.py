"""Rotary position embeddings (the "rotate half" form HF Llama uses)."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """Applies RoPE to query and key heads at given positions.

    ``cos``/``sin`` for every position up to ``max_positions`` are computed once, in float32.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos()
        self.sin = angles.sin()
        self.max_positions = max_positions

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q``: ``[N, heads, d]``, ``k``: ``[N, kv_heads, d]``, ``positions``: ``[N]``, each
        below ``max_positions`` (the caller checks: reading them here would wait for the
        device)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
