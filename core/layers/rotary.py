"""Rotary position embeddings (the "rotate half" form HF Llama uses; the rotation itself is
:meth:`shardline.layers.kernels.TorchKernels.rotate_and_store`)."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """The angles RoPE rotates query and key heads by, at given positions.

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

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` at ``positions`` (``[N]``, each below ``max_positions``: the caller
        checks, since reading them here would wait for the device), shaped ``[N, 1, d]`` to
        rotate ``[N, heads, d]``; made once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
