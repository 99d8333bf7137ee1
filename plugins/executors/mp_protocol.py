"""Messages between the mp executor and its worker processes (pickled through the rings).

Driver -> every worker (broadcast ring): a call, the tuple ``(call_id, method, args, kwargs,
reply_rank)`` (:func:`call_message`); call ids count up by one from :data:`FIRST_CALL_ID` in
the order calls are broadcast (a worker that cannot load a call fails the id after the last
one it loaded); ``method`` is a Worker method name or a cloudpickled callable
taking the Worker first; ``method=None`` asks workers to exit. A model step travels as
``(call_id, STEP, encode_step(step), None, reply_rank)``: the worker runs
``execute_model(decode_step(encoded))``.

Worker -> driver (one ring per worker): ``Phase(name)`` during start-up, a reply, the tuple
``(call_id, value)``, from the reply rank (every rank when ``reply_rank`` is None), and
``Failure(call_id, phase, failure)`` from any rank that raised (``failure``: the
:class:`~shardline.errors.RemoteFailure` envelope every executor uses).

Calls and replies, sent every step, are bare tuples: pickle writes and reads a tuple several
microseconds faster than a dataclass instance (which it rebuilds through ``__reduce_ex__`` and
a state dict, after finding its class through the import system), and a round trip pickles
each twice. For the same reason a step's :class:`SchedulerOutput` and its cached requests (the
requests of every decode step) travel as tuples of their fields (:func:`encode_step`); new
requests, rarer, stay objects. Rare messages stay dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from shardline.errors import RemoteFailure
from shardline.interfaces import CachedRequest, SchedulerOutput

PHASES = ("spawn", "distributed init", "model load", "ready")

#: The id of an executor's first call (the next call's is one more).
FIRST_CALL_ID = 0

#: ``(call_id, method, args, kwargs, reply_rank)``
Call = tuple[int, "str | bytes | int | None", Any, "dict[str, Any] | None", "int | None"]


def call_message(
    call_id: int,
    method: str | bytes | int | None,
    args: Any,
    kwargs: dict[str, Any] | None,
    reply_rank: int | None,
) -> Call:
    """A call as it travels (a tuple; see the module docstring): ``args`` a tuple and
    ``kwargs`` a dict for a Worker method or a callable, the encoded step for ``STEP``."""
    return (call_id, method, args, kwargs, reply_rank)


#: The ``method`` of a call that runs a model step (see the module docstring).
STEP = 0
#: Where the cached requests are among ``SchedulerOutput``'s fields (encoded one by one).
_CACHED = [field.name for field in fields(SchedulerOutput)].index("cached_requests")


def encode_step(step: SchedulerOutput) -> list[Any]:
    """``step``'s field values in order (a dataclass's ``__dict__`` keeps it), each cached
    request as the tuple of its fields."""
    values = list(vars(step).values())
    values[_CACHED] = [tuple(vars(cached).values()) for cached in step.cached_requests]
    return values


def decode_step(values: list[Any]) -> SchedulerOutput:
    """The step :func:`encode_step` encoded (``values`` is consumed)."""
    values[_CACHED] = [CachedRequest(*cached) for cached in values[_CACHED]]
    return SchedulerOutput(*values)


@dataclass(frozen=True)
class Phase:
    name: str


@dataclass(frozen=True)
class Failure:
    """``call_id`` is None for a start-up failure, with ``phase`` naming the phase."""

    call_id: int | None
    phase: str
    failure: RemoteFailure
