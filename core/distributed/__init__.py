"""Rank layout (pure), group coordinators and a rank's ParallelState.

Names load on first use: the layout (which the config schema needs) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "GroupCoordinator": "shardline.distributed.group",
    "ParallelLayout": "shardline.distributed.layout",
    "RankCoordinates": "shardline.distributed.layout",
    "ParallelState": "shardline.distributed.parallel_state",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
