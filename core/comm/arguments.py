"""Argument checks every backend makes the same way (same messages everywhere)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def group_ranks(ranks: list[int], world_size: int) -> list[int]:
    """``ranks`` for ``new_group``, checked: distinct ranks of a group of ``world_size``."""
    ranks = list(ranks)
    if len(set(ranks)) != len(ranks) or any(not 0 <= r < world_size for r in ranks):
        raise ValueError(
            f"new_group ranks must be distinct ranks of this group (0..{world_size - 1}), "
            f"got {ranks}"
        )
    return ranks


def check_peer(peer: int, world_size: int, op: str) -> None:
    """ValueError unless ``peer`` is a rank of a group of ``world_size``."""
    if not 0 <= peer < world_size:
        raise ValueError(f"{op}: rank {peer} is not in this group of {world_size}")


def check_reply_rank(unique_reply_rank: int | None, world_size: int) -> None:
    """ValueError unless ``unique_reply_rank`` (of ``Executor.collective_rpc``) is None or a
    rank of a world of ``world_size``."""
    if unique_reply_rank is not None and not 0 <= unique_reply_rank < world_size:
        raise ValueError(f"unique_reply_rank = {unique_reply_rank}: ranks are 0..{world_size - 1}")


def method_name(method: str | Callable[..., Any]) -> str:
    """How errors name a ``collective_rpc`` method: a Worker method's name, a callable's."""
    return method if isinstance(method, str) else getattr(method, "__name__", "callable")
