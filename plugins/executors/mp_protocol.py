"""Messages between the mp executor and its worker processes (pickled through the rings).

Driver -> every worker (broadcast ring): a call, the tuple ``(call_id, method, args, kwargs,
reply_rank)`` (:func:`call_message`); ``method`` is a Worker method name or a cloudpickled callable
taking the Worker first; ``method=None`` asks workers to exit.

Worker -> driver (one ring per worker): ``Phase(name)`` during start-up, a reply, the tuple
``(call_id, value)``, from the reply rank (every rank when ``reply_rank`` is None), and
``Failure(call_id, phase, failure)`` from any rank that raised (``failure``: the
:class:`~shardline.errors.RemoteFailure` envelope every executor uses).

Calls and replies, sent every step, are bare tuples: pickle writes and reads a tuple several
microseconds faster than a dataclass instance (which it rebuilds through ``__reduce_ex__`` and
a state dict), and a round trip pickles each twice. Rare messages stay dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardline.errors import RemoteFailure

PHASES = ("spawn", "distributed init", "model load", "ready")

#: ``(call_id, method, args, kwargs, reply_rank)``
Call = tuple[int, "str | bytes | None", tuple[Any, ...], dict[str, Any], "int | None"]


def call_message(
    call_id: int,
    method: str | bytes | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    reply_rank: int | None,
) -> Call:
    """A call as it travels (a tuple; see the module docstring)."""
    return (call_id, method, args, kwargs, reply_rank)


@dataclass(frozen=True)
class Phase:
    name: str


@dataclass(frozen=True)
class Failure:
    """``call_id`` is None for a start-up failure, with ``phase`` naming the phase."""

    call_id: int | None
    phase: str
    failure: RemoteFailure
