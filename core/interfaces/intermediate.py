"""What one pipeline stage hands to the next."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class IntermediateTensors:
    """Named tensors produced by a non-last pipeline stage (``hidden_states``, ``residual``).

    The next stage receives them over the pipeline group as a tensor dict with the same keys.
    """

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]
