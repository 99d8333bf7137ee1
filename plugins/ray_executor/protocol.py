"""Messages between the driver, a rank's actor and the rank's process (pickled bytes; the
actor relays them without reading them).

Driver -> rank: ``Call(method, args, kwargs, reply_rank)``; ``method`` is a Worker method
name or a cloudpickled callable taking the Worker first.

Rank -> driver, one message per start-up phase and per call: ``Phase(name)`` as each phase
ends, ``Reply(value)`` from the reply rank (every rank when ``reply_rank`` is None),
``Done()`` from the others, ``Failure(phase, failure)`` from a rank that raised (``phase``
is ``"call"`` for a call; ``failure``: the :class:`~shardline.errors.RemoteFailure` every
executor uses). The actor answers ``Died(pid, exitcode)`` instead when the rank's process
has ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardline.errors import RemoteFailure

PHASES = ("spawn", "distributed init", "model load", "ready")


@dataclass(frozen=True)
class Call:
    method: str | bytes
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    reply_rank: int | None


@dataclass(frozen=True)
class Phase:
    name: str


@dataclass(frozen=True)
class Reply:
    value: Any


@dataclass(frozen=True)
class Done:
    pass


@dataclass(frozen=True)
class Failure:
    phase: str
    failure: RemoteFailure


@dataclass(frozen=True)
class Died:
    """The rank's process ended: its pid and exit status (minus the signal that ended it)."""

    pid: int
    exitcode: int | None
