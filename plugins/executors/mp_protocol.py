"""Messages between the mp executor and its worker processes (pickled through the rings).

Driver -> every worker (broadcast ring): ``Call(call_id, method, args, kwargs, reply_rank)``;
``method`` is a Worker method name or a cloudpickled callable taking the Worker first;
``method=None`` asks workers to exit.

Worker -> driver (one ring per worker): ``Phase(name)`` during start-up, ``Reply(call_id,
value)`` from the reply rank (every rank when ``reply_rank`` is None), and ``Failure(call_id,
phase, exc_type, message, traceback, error)`` from any rank that raised (``error``: the
exception itself when it is a Shardline error, see :func:`shardline.errors.portable`).
"""

from __future__ import annotations

import traceback as tracebacks
from dataclasses import dataclass
from typing import Any

from shardline.errors import ShardlineError, portable

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
    exc_type: str
    message: str
    traceback: str
    error: ShardlineError | None = None

    @classmethod
    def of(cls, call_id: int | None, phase: str, error: BaseException) -> Failure:
        """The failure to report for ``error``, being handled now."""
        return cls(
            call_id,
            phase,
            type(error).__name__,
            str(error),
            tracebacks.format_exc(),
            portable(error),
        )
