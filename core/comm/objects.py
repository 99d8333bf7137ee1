"""Picklable objects as uint8 tensors, for control-plane messages."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch


def to_tensor(obj: Any, device: str = "cpu") -> torch.Tensor:
    """``obj`` pickled into a 1-D uint8 tensor on ``device``."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def from_tensor(tensor: torch.Tensor) -> Any:
    """The object pickled in a uint8 tensor made by :func:`to_tensor`."""
    return pickle.loads(np.asarray(tensor.cpu()).tobytes())
