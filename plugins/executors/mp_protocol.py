"""Messages between the mp executor and its worker processes (pickled through the rings).

Driver -> every worker (broadcast ring): ``Call(call_id, method, args, kwargs, reply_rank)``;
``method`` is a Worker method name or a cloudpickled callable taking the Worker first;
``method=None`` asks workers to exit.

Worker -> driver (one ring per worker): ``Phase(name)`` during start-up, ``Reply(call_id,
value)`` from the reply rank (every rank when ``reply_rank`` is None), and ``Failure(call_id,
phase, failure)`` from any rank that raised (``failure``: the
:class:`~shardline.errors.RemoteFailure` envelope every executor uses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardline.errors import RemoteFailure

PHASES = ("spawn", "distributed init", "model load", "ready")


@dataclass(frozen=True)
class Call:
    call_id: int
    method: str | bytes | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    reply_rank: int | None


@dataclass(frozen=True)
class Phase:
    name: str


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: Any


@dataclass(frozen=True)
class Failure:
    """``call_id`` is None for a start-up failure, with ``phase`` naming the phase."""

    call_id: int | None
    phase: str
    failure: RemoteFailure
